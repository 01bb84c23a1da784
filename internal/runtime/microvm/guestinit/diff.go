package guestinit

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// diff writes the overlay's upper directory as a tar stream with OCI
// whiteouts (agent.Options.Diff): an overlayfs whiteout (a 0:0 character
// device) becomes ".wh.NAME", an opaque directory (trusted.overlay.opaque
// "y") gets a ".wh..wh..opq" entry. The workload's cgroup is frozen while
// the walk reads, so the stream is one moment's state; the agent itself
// is outside that cgroup and keeps serving.
func (g *Guest) diff(ctx context.Context, w io.Writer) error {
	if g.upper < 0 {
		return errors.New("diff: no writable layer")
	}
	if err := g.freeze(ctx, true); err != nil {
		return err
	}
	defer g.freeze(context.Background(), false)
	// The upper directory is outside the sandbox's root (it was mounted
	// before the switch); its descriptor, through /proc, names it (the
	// trailing "/." has the walk follow the magic link).
	root := "/proc/self/fd/" + strconv.Itoa(g.upper) + "/."
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil || rel == "." {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		st := info.Sys().(*syscall.Stat_t)
		mode := info.Mode()
		switch {
		case mode&fs.ModeCharDevice != 0 && st.Rdev == 0:
			return tw.WriteHeader(&tar.Header{
				Typeflag: tar.TypeReg, Name: filepath.Join(filepath.Dir(rel), ".wh."+filepath.Base(rel)),
				Mode: 0o644, ModTime: info.ModTime(),
			})
		case mode&(fs.ModeSocket|fs.ModeIrregular) != 0:
			return nil
		}
		link := ""
		if mode&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		hdr.Uname, hdr.Gname = "", ""
		if info.IsDir() {
			hdr.Name += "/"
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.IsDir() {
			buf := make([]byte, 2)
			if n, err := unix.Lgetxattr(p, "trusted.overlay.opaque", buf); err == nil && n == 1 && buf[0] == 'y' {
				return tw.WriteHeader(&tar.Header{
					Typeflag: tar.TypeReg, Name: hdr.Name + ".wh..wh..opq", Mode: 0o644, ModTime: info.ModTime(),
				})
			}
			return nil
		}
		if !mode.IsRegular() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.CopyN(tw, f, hdr.Size)
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		return fmt.Errorf("diff: %w", err)
	}
	return nil
}

// freeze freezes or thaws the workload's cgroup and waits until the
// kernel says it is done.
func (g *Guest) freeze(ctx context.Context, on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	fd, err := unix.Openat(g.cgroup, "cgroup.freeze", unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("freeze: %w", err)
	}
	_, err = unix.Write(fd, []byte(v))
	unix.Close(fd)
	if err != nil || !on {
		return err
	}
	for {
		if g.counter("cgroup.events", "frozen") == 1 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
}
