package testsuite

import (
	"debug/elf"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The base layer carries a marker file so the suite can tell that the
// sandbox's root really is the harness's image.
const (
	BaseMarkerPath    = "/etc/dsec-base"
	BaseMarkerContent = "dsec testsuite base layer\n"
)

// BusyboxRootfs builds a minimal root filesystem in a temporary directory
// (removed when t ends) from the host's static busybox: /bin/busybox, a
// symlink for every applet, /etc/passwd and /etc/group with root and
// nobody (65534), empty mount points (/proc, /sys, /dev, /tmp, ...) and
// the base marker file. The backend's test turns it into a layer.
func BusyboxRootfs(t testing.TB) string {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skipf("busybox not installed (Debian: busybox-static): %v", err)
	}
	if err := requireStatic(bb); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := buildRootfs(root, bb); err != nil {
		t.Fatalf("building busybox rootfs in %s: %v", root, err)
	}
	return root
}

// requireStatic refuses a dynamically linked busybox: it would not run in a
// rootfs without its libc.
func requireStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("busybox %s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("busybox %s is dynamically linked; install busybox-static", path)
		}
	}
	return nil
}

func buildRootfs(root, busybox string) error {
	dirs := map[string]os.FileMode{
		"bin": 0o755, "sbin": 0o755, "usr/bin": 0o755, "usr/sbin": 0o755,
		"etc": 0o755, "root": 0o700, "home": 0o755, "var": 0o755, "run": 0o755,
		"mnt": 0o755, "proc": 0o555, "sys": 0o555, "dev": 0o755,
		"tmp": os.ModeSticky | 0o777, "var/tmp": os.ModeSticky | 0o777,
	}
	for d, mode := range dirs {
		p := filepath.Join(root, d)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return err
		}
		// Chmod because MkdirAll is subject to the umask and drops the sticky bit.
		if err := os.Chmod(p, mode); err != nil {
			return err
		}
	}
	if err := copyFile(busybox, filepath.Join(root, "bin/busybox"), 0o755); err != nil {
		return err
	}
	out, err := exec.Command(busybox, "--list-full").Output()
	if err != nil {
		return fmt.Errorf("busybox --list-full: %w", err)
	}
	for _, applet := range strings.Fields(string(out)) {
		p := filepath.Join(root, applet)
		if p == filepath.Join(root, "bin/busybox") {
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.Symlink("/bin/busybox", p); err != nil {
			return fmt.Errorf("applet %s: %w", applet, err)
		}
	}
	files := map[string]string{
		"etc/passwd":        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":         "root:x:0:\nnogroup:x:65534:\n",
		"etc/hosts":         "127.0.0.1\tlocalhost\n",
		"etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
		BaseMarkerPath[1:]:  BaseMarkerContent,
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(root, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
