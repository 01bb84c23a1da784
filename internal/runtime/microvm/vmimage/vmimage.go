// Package vmimage prepares what a microVM boots: a Debian kernel and an
// initramfs whose /init is dsec-agent.
//
// The kernel is a Debian package (linux-image-*-cloud-amd64: small, with
// the virtio drivers, erofs and overlay as modules) fetched with
// `apt-get download` and unpacked with `dpkg-deb -x` into a cache
// directory; it is never installed as the host's kernel. The initramfs is
// written here with cpio: the static dsec-agent as /init, the few kernel
// modules the guest loads (and what they depend on, read from each
// module's .modinfo since the package ships no modules.dep), and
// /modules.dep in a small format of its own (guestinit reads it).
// Everything is cached by content (package name; agent bytes and module
// set), and a lock file serialises concurrent preparers, so that two
// backends starting at once neither download twice nor see a half-written
// file.
package vmimage

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/cavaliergopher/cpio"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/fail"
)

// DefaultCacheDir is where kernels and initramfs images are kept unless
// Options.CacheDir or $DSEC_VM_CACHE says otherwise: outside any clone, so
// that a fresh checkout on the same machine reuses them.
const DefaultCacheDir = "/var/cache/dsec/vm"

// MetaPackage is the Debian package whose dependency names the current
// cloud kernel.
const MetaPackage = "linux-image-cloud-amd64"

// Modules are the kernel modules the initramfs carries (with their
// dependencies): the virtio transports (mmio for -M microvm, pci for q35),
// the console (the agent channel), block, balloon and pmem devices, and the
// file systems of the layers and the overlay. ext4 (the writable disk) is
// built in.
var Modules = []string{
	"virtio_mmio", "virtio_pci", "virtio_console", "virtio_blk", "virtio_balloon",
	"virtio_pmem", "nd_pmem", "erofs", "overlay",
}

// Options says where and from what to build.
type Options struct {
	// CacheDir defaults to $DSEC_VM_CACHE, then DefaultCacheDir.
	CacheDir string
	// KernelPackage is the Debian package to boot; default: the one
	// MetaPackage depends on now.
	KernelPackage string
	// AgentPath is the static dsec-agent binary (required).
	AgentPath string
}

// Image is a prepared guest.
type Image struct {
	// Kernel is the vmlinuz file; Initrd the uncompressed cpio archive
	// (uncompressed because unpacking costs the guest nothing then, which
	// matters under TCG).
	Kernel, Initrd string
	// Package is the kernel package it came from.
	Package string
}

// CacheDir is o's cache directory after defaults.
func (o Options) cacheDir() string {
	switch {
	case o.CacheDir != "":
		return o.CacheDir
	case os.Getenv("DSEC_VM_CACHE") != "":
		return os.Getenv("DSEC_VM_CACHE")
	}
	return DefaultCacheDir
}

// Ensure returns the image for o, fetching the kernel and writing the
// initramfs when the cache lacks them.
func Ensure(ctx context.Context, o Options) (*Image, error) {
	if o.AgentPath == "" {
		return nil, fail.Invalid("vmimage: AgentPath: empty")
	}
	dir := o.cacheDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fail.Errorf(fail.Internal, "vmimage: %w", err)
	}
	unlock, err := lock(filepath.Join(dir, "lock"))
	if err != nil {
		return nil, err
	}
	defer unlock()
	pkg := o.KernelPackage
	if pkg == "" {
		if pkg, err = currentKernelPackage(ctx); err != nil {
			return nil, err
		}
	}
	kdir, err := ensureKernel(ctx, dir, pkg)
	if err != nil {
		return nil, err
	}
	kernel, err := filepath.Glob(filepath.Join(kdir, "boot", "vmlinuz-*"))
	if err != nil || len(kernel) != 1 {
		return nil, fail.Errorf(fail.Internal, "vmimage: %s holds no single vmlinuz", kdir)
	}
	initrd, err := ensureInitramfs(dir, kdir, o.AgentPath)
	if err != nil {
		return nil, err
	}
	return &Image{Kernel: kernel[0], Initrd: initrd, Package: pkg}, nil
}

// lock takes an exclusive flock on path.
func lock(path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fail.Errorf(fail.Internal, "vmimage: lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fail.Errorf(fail.Internal, "vmimage: lock: %w", err)
	}
	return func() { f.Close() }, nil
}

// currentKernelPackage asks apt which kernel MetaPackage depends on.
func currentKernelPackage(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "apt-cache", "depends", MetaPackage).Output()
	if err != nil {
		return "", fail.Errorf(fail.Unavailable, "vmimage: apt-cache depends %s: %w (run apt-get update, or set the kernel package)", MetaPackage, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") {
			return f[1], nil
		}
	}
	return "", fail.Errorf(fail.Unavailable, "vmimage: apt-cache names no kernel for %s", MetaPackage)
}

// ensureKernel unpacks pkg into dir/kernel/pkg unless it is there.
func ensureKernel(ctx context.Context, dir, pkg string) (string, error) {
	if strings.ContainsAny(pkg, "/ ") || !strings.HasPrefix(pkg, "linux-image-") {
		return "", fail.Invalid("vmimage: kernel package %q: not a linux-image package name", pkg)
	}
	kdir := filepath.Join(dir, "kernel", pkg)
	if _, err := os.Stat(filepath.Join(kdir, ".complete")); err == nil {
		return kdir, nil
	}
	if err := os.MkdirAll(filepath.Dir(kdir), 0o755); err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: %w", err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(kdir), ".fetch-")
	if err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: %w", err)
	}
	defer os.RemoveAll(tmp)
	dl := exec.CommandContext(ctx, "apt-get", "download", "-q", pkg)
	dl.Dir = tmp
	if out, err := dl.CombinedOutput(); err != nil {
		return "", fail.Errorf(fail.Unavailable, "vmimage: apt-get download %s: %w: %s", pkg, err, bytes.TrimSpace(out))
	}
	debs, _ := filepath.Glob(filepath.Join(tmp, "*.deb"))
	if len(debs) != 1 {
		return "", fail.Errorf(fail.Internal, "vmimage: apt-get download %s left %d .deb files", pkg, len(debs))
	}
	root := filepath.Join(tmp, "root")
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", debs[0], root).CombinedOutput(); err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: dpkg-deb -x %s: %w: %s", debs[0], err, bytes.TrimSpace(out))
	}
	if err := os.WriteFile(filepath.Join(root, ".complete"), nil, 0o644); err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: %w", err)
	}
	os.RemoveAll(kdir) // a partial one from a crash
	if err := os.Rename(root, kdir); err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: %w", err)
	}
	return kdir, nil
}

// module is one kernel module file and the modules it needs.
type module struct {
	name, path string
	deps       []string
}

// moduleSet finds Modules and their dependencies under kdir/lib/modules,
// in an order where each module comes after what it depends on.
func moduleSet(kdir string) ([]module, error) {
	files := map[string]string{}
	err := filepath.WalkDir(filepath.Join(kdir, "lib", "modules"), func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if n := d.Name(); strings.HasSuffix(n, ".ko") {
			files[strings.ReplaceAll(strings.TrimSuffix(n, ".ko"), "-", "_")] = p
		}
		return nil
	})
	if err != nil {
		return nil, fail.Errorf(fail.Internal, "vmimage: modules: %w", err)
	}
	var out []module
	seen := map[string]bool{}
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		if seen[name] {
			return nil
		}
		if len(chain) > 32 {
			return fmt.Errorf("dependency loop through %v", chain)
		}
		p, ok := files[name]
		if !ok {
			return fmt.Errorf("module %s not in the kernel package", name)
		}
		deps, err := moduleDeps(p)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d, append(chain, name)); err != nil {
				return err
			}
		}
		seen[name] = true
		out = append(out, module{name: name, path: p, deps: deps})
		return nil
	}
	for _, m := range Modules {
		if err := visit(m, nil); err != nil {
			return nil, fail.Errorf(fail.Internal, "vmimage: %w", err)
		}
	}
	return out, nil
}

// moduleDeps reads "depends=" from a module's .modinfo section.
func moduleDeps(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	s := f.Section(".modinfo")
	if s == nil {
		return nil, fmt.Errorf("%s: no .modinfo", path)
	}
	b, err := s.Data()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok {
			if len(v) == 0 {
				return nil, nil
			}
			return strings.Split(strings.ReplaceAll(string(v), "-", "_"), ","), nil
		}
	}
	return nil, nil
}

// ensureInitramfs writes the initramfs for the agent and the kernel's
// modules unless the cache has it.
func ensureInitramfs(dir, kdir, agentPath string) (string, error) {
	mods, err := moduleSet(kdir)
	if err != nil {
		return "", err
	}
	agentBin, err := os.ReadFile(agentPath)
	if err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: agent: %w", err)
	}
	h := sha256.New()
	h.Write(agentBin)
	fmt.Fprintf(h, "\x00%s\x00", kdir)
	var dep strings.Builder
	for _, m := range mods {
		// One line a module, in load order: "name: dep dep".
		fmt.Fprintf(&dep, "%s: %s\n", m.name, strings.Join(m.deps, " "))
	}
	h.Write([]byte(dep.String()))
	path := filepath.Join(dir, "initramfs-"+hex.EncodeToString(h.Sum(nil))[:24]+".cpio")
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	tmp, err := os.CreateTemp(dir, ".initramfs-")
	if err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: %w", err)
	}
	defer os.Remove(tmp.Name())
	w := cpio.NewWriter(tmp)
	add := func(name string, mode cpio.FileMode, data []byte) error {
		if err := w.WriteHeader(&cpio.Header{Name: name, Mode: mode, Size: int64(len(data)), Links: 1}); err != nil {
			return err
		}
		_, err := w.Write(data)
		return err
	}
	err = func() error {
		for _, d := range []string{"dev", "proc", "sys", "lib", "lib/modules", "newroot"} {
			if err := w.WriteHeader(&cpio.Header{Name: d, Mode: cpio.TypeDir | 0o755, Links: 2}); err != nil {
				return err
			}
		}
		if err := add("init", cpio.TypeReg|0o755, agentBin); err != nil {
			return err
		}
		for _, m := range mods {
			b, err := os.ReadFile(m.path)
			if err != nil {
				return err
			}
			if err := add("lib/modules/"+m.name+".ko", cpio.TypeReg|0o644, b); err != nil {
				return err
			}
		}
		if err := add("lib/modules/modules.dep", cpio.TypeReg|0o644, []byte(dep.String())); err != nil {
			return err
		}
		if err := w.Close(); err != nil {
			return err
		}
		if err := tmp.Chmod(0o644); err != nil {
			return err
		}
		return tmp.Close()
	}()
	if err != nil {
		tmp.Close()
		return "", fail.Errorf(fail.Internal, "vmimage: write initramfs: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", fail.Errorf(fail.Internal, "vmimage: %w", err)
	}
	return path, nil
}
