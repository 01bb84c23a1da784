package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// packPhase: a sandbox writes packMiB files of 1 MiB from /dev/urandom
// under /root (in its writable layer; /tmp is a tmpfs outside it), then
// Snapshot is timed reps times, each with a new tag. Interleaved with
// every snapshot, the same bytes (read back out of the sandbox) are packed
// on the host by the peers. Afterwards a sandbox restored from the last
// snapshot must hold exactly those bytes.
func (h *harness) packPhase(ctx context.Context) (err error) {
	cfg := h.cfg
	src := filepath.Join(h.work, "pack-src")
	out := filepath.Join(h.work, "pack-out")
	for _, d := range []string{src, out} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	defer func() { err = errors.Join(err, os.RemoveAll(src), os.RemoveAll(out)) }()

	var ids []string
	defer func() { err = errors.Join(err, h.api.destroy(ctx, cfg.Batch, ids...)) }()
	sb, err := h.api.create(ctx, map[string]string{"statebench": "pack"})
	if err != nil {
		return err
	}
	ids = append(ids, sb.ID)
	want, err := fillUpper(ctx, sb, "/root/pack", cfg.PackMiB, src)
	if err != nil {
		return err
	}

	peers := packPeers(src, filepath.Join(out, "layer"))
	for _, p := range peers {
		if p.skip != "" {
			h.rep.Skipped = append(h.rep.Skipped, p.skip)
		}
	}
	h.rep.Skipped = append(h.rep.Skipped, "pack_diff / docker commit: not measured (no usable dockerd on this machine by default)")

	var (
		dsecTimes []time.Duration
		peerTimes = make([][]time.Duration, len(peers))
		lastRef   string
	)
	// What was measured is reported also when the phase stops early.
	defer func() {
		h.rep.addRow(figPack, "dsec Snapshot", true, dsecTimes, 0,
			"API round trip: freeze, pack the upper into an EROFS layer (fsynced), thaw, store and tag the image")
		for j, p := range peers {
			h.rep.addRow(figPack, p.name, false, peerTimes[j], 0, p.note)
		}
	}()
	for i := 1; i <= cfg.Reps; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		ref := fmt.Sprintf("statebench-pack:r%d", i)
		t0 := time.Now()
		img, err := h.api.snapshot(ctx, sb.ID, ref)
		d := time.Since(t0)
		if err != nil {
			return err
		}
		if img.GetSize() < int64(cfg.PackMiB)<<20 {
			return fmt.Errorf("snapshot %s: image of %d bytes, less than the %d MiB written", ref, img.GetSize(), cfg.PackMiB)
		}
		dsecTimes = append(dsecTimes, d)
		lastRef = ref
		for j, p := range peers {
			if p.skip != "" {
				continue
			}
			d, err := p.run(ctx)
			if err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
			peerTimes[j] = append(peerTimes[j], d)
			if err := clearDir(out); err != nil {
				return err
			}
		}
	}
	// The snapshot must restore to the same bytes.
	restored, err := h.api.createFrom(ctx, lastRef)
	if err != nil {
		return fmt.Errorf("verify: restore %s: %w", lastRef, err)
	}
	ids = append(ids, restored.ID)
	got, err := sh(ctx, restored, sumScript("/root/pack", cfg.PackMiB))
	if err != nil {
		return fmt.Errorf("verify restore of %s: %w", lastRef, err)
	}
	if got != want {
		return fmt.Errorf("verify: a sandbox restored from %s holds other bytes:\n%s\nwant:\n%s", lastRef, got, want)
	}
	slog.Info("pack_diff verified", "image", lastRef, "files", cfg.PackMiB)
	return nil
}

// createFrom makes a sandbox from image ref.
func (a *api) createFrom(ctx context.Context, ref string) (*dsec.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	sb, err := a.c.Create(ctx, dsec.Spec{Image: ref})
	if err != nil {
		return nil, err
	}
	return a.c.Sandbox(sb.ID, dsec.Unnumbered()), nil
}

// fillUpper has sb write n files of 1 MiB from /dev/urandom into dir (in
// its writable layer), copies the same bytes into hostDir (unless it is
// ""), and returns the files' checksums as sumScript prints them.
func fillUpper(ctx context.Context, sb *dsec.Sandbox, dir string, n int, hostDir string) (string, error) {
	want, err := sh(ctx, sb, fillScript(dir, n)+"; "+sumScript(dir, n))
	if err != nil || hostDir == "" {
		return want, err
	}
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("f%d", i)
		rctx, cancel := context.WithTimeout(ctx, opTimeout)
		b, err := sb.ReadFile(rctx, dir+"/"+name, 2<<20)
		cancel()
		if err != nil {
			return "", err
		}
		if len(b) != 1<<20 {
			return "", fmt.Errorf("%s/%s: %d bytes, want 1 MiB", dir, name, len(b))
		}
		if !strings.Contains(want, sha(b)+"  "+dir+"/"+name+"\n") {
			return "", fmt.Errorf("%s/%s read back with checksum %s, not in %q", dir, name, sha(b), want)
		}
		if err := os.WriteFile(filepath.Join(hostDir, name), b, 0o644); err != nil {
			return "", err
		}
	}
	return want, nil
}

// fillScript writes files f1..fn of 1 MiB from /dev/urandom into dir.
func fillScript(dir string, n int) string {
	return fmt.Sprintf("set -e; mkdir -p %s; for i in $(seq 1 %d); do head -c 1048576 /dev/urandom > %s/f$i; done", dir, n, dir)
}

// sumScript prints the sha256 of files f1..fn in dir.
func sumScript(dir string, n int) string {
	var files []string
	for i := 1; i <= n; i++ {
		files = append(files, fmt.Sprintf("%s/f%d", dir, i))
	}
	return "sha256sum " + strings.Join(files, " ")
}

// hostPeer is one way of doing a DSec operation's work on the host.
type hostPeer struct {
	name string
	note string
	skip string // why it is not measured, if it is not
	run  func(context.Context) (time.Duration, error)
}

// packPeers pack src into the file out: tar (page cache, as a user would),
// tar then fsync (DSec fsyncs its layer), mkfs.erofs with DSec's options
// then fsync (the floor: the packer DSec runs, without API, freeze or
// store), and mksquashfs if installed.
func packPeers(src, out string) []hostPeer {
	cmd := func(name string, args ...string) func(context.Context) (time.Duration, error) {
		return func(ctx context.Context) (time.Duration, error) {
			t0 := time.Now()
			if b, err := exec.CommandContext(ctx, name, args...).CombinedOutput(); err != nil {
				return 0, fmt.Errorf("%s: %w: %s", name, err, strings.TrimSpace(string(b)))
			}
			return time.Since(t0), nil
		}
	}
	synced := func(run func(context.Context) (time.Duration, error)) func(context.Context) (time.Duration, error) {
		return func(ctx context.Context) (time.Duration, error) {
			t0 := time.Now()
			if _, err := run(ctx); err != nil {
				return 0, err
			}
			if err := fsyncFile(out); err != nil {
				return 0, err
			}
			return time.Since(t0), nil
		}
	}
	tar := cmd("tar", "-cf", out, "-C", src, ".")
	peers := []hostPeer{
		{name: "tar -cf", note: "the same files packed on the host into a tar file (page cache, no fsync)", run: tar},
		{name: "tar -cf + fsync", note: "as tar -cf, then fsync of the archive (DSec fsyncs its layer)", run: synced(tar)},
		{name: "mkfs.erofs + fsync", note: "floor: the packer DSec runs, with its options (-Enoinline_data), on the host, no API/freeze/store",
			run: synced(cmd("mkfs.erofs", "-Enoinline_data", "--quiet", out, src))},
	}
	if _, err := exec.LookPath("mksquashfs"); err == nil {
		peers = append(peers, hostPeer{name: "mksquashfs + fsync", note: "squashfs image of the same files (default compression), then fsync",
			run: synced(cmd("mksquashfs", src, out, "-noappend", "-quiet", "-no-progress"))})
	} else {
		peers = append(peers, hostPeer{name: "mksquashfs", skip: "pack_diff / mksquashfs: not installed (apt-get install -y squashfs-tools)"})
	}
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		peers[2].skip = "pack_diff / mkfs.erofs: not installed"
	}
	return peers
}

func fsyncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// fsyncTree fsyncs every regular file and directory under dir.
func fsyncTree(dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() || d.IsDir() {
			return fsyncFile(p)
		}
		return nil
	})
}

// clearDir removes everything inside dir.
func clearDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}
