package agent

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/rawfile"
)

// abs resolves a request path: relative paths are taken from the default
// working directory.
func (srv *server) abs(p, field string) (string, error) {
	if p == "" {
		return "", errorf(CodeInvalidArgument, "%s is empty", field)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", errorf(CodeInvalidArgument, "%s contains a NUL byte", field)
	}
	if !filepath.IsAbs(p) {
		p = filepath.Join(srv.opts.Workdir, p)
	}
	return filepath.Clean(p), nil
}

func (srv *server) writeFile(s *stream, r *writeFileRequest) error {
	p, err := srv.abs(r.path, "write file: path")
	if err != nil {
		return err
	}
	mode := fs.FileMode(r.mode) & fs.ModePerm
	if r.mode == 0 {
		mode = 0o644
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("write file %s: %w", p, err)
	}
	// Not truncated until it is known to be a regular file of the
	// sandbox's own: O_NONBLOCK so that a FIFO without a reader fails
	// (ENXIO) instead of blocking, and with one is refused below.
	fd, err := unix.Open(p, unix.O_WRONLY|unix.O_CREAT|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, uint32(mode))
	if err != nil {
		return fmt.Errorf("write file: %w", &os.PathError{Op: "open", Path: p, Err: err})
	}
	f := os.NewFile(uintptr(fd), p)
	err = checkWritable(fd, p, "write file")
	if err == nil {
		err = f.Truncate(0)
	}
	if err == nil {
		_, err = io.Copy(f, &bodyReader{ctx: s.ctx, s: s})
	}
	if err == nil {
		err = f.Chmod(mode) // the umask must not narrow what was asked for
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write file %s: %w", p, err)
	}
	return nil
}

// checkWritable refuses to write anything but a regular file, and any file
// of a kernel file system: /proc/self there is the agent itself (a write
// to its oom_score_adj is the agent's), and nothing in /proc or /sys is
// the sandbox's data.
func checkWritable(fd int, p, op string) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return errorf(CodeFailedPrecondition, "%s %s: is a %s, not a regular file", op, p, rawfile.TypeName(st.Mode))
	}
	return checkFS(fd, p, op)
}

// checkFS refuses a descriptor on a kernel file system.
func checkFS(fd int, p, op string) error {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return err
	}
	if name := pseudoFS(sfs.Type); name != "" {
		return errorf(CodePermissionDenied, "%s %s: is on %s, which the agent does not write to", op, p, name)
	}
	return nil
}

// pseudoFS names the kernel file systems the agent never writes to on a
// request's behalf; "" for any other.
func pseudoFS(magic int64) string {
	switch magic {
	case unix.PROC_SUPER_MAGIC:
		return "procfs"
	case unix.SYSFS_MAGIC:
		return "sysfs"
	case unix.CGROUP_SUPER_MAGIC, unix.CGROUP2_SUPER_MAGIC:
		return "cgroupfs"
	case unix.DEVPTS_SUPER_MAGIC:
		return "devpts"
	case unix.SECURITYFS_MAGIC, unix.SELINUX_MAGIC, unix.SMACK_MAGIC:
		return "securityfs"
	case unix.DEBUGFS_MAGIC, unix.TRACEFS_MAGIC:
		return "debugfs"
	case unix.BPF_FS_MAGIC:
		return "bpffs"
	case unix.EFIVARFS_MAGIC, unix.PSTOREFS_MAGIC:
		return "efivarfs"
	case unix.BINFMTFS_MAGIC:
		return "binfmt_misc"
	case 0x65735543: // fusectl
		return "fusectl"
	case 0x62656570: // configfs
		return "configfs"
	}
	return ""
}

func (srv *server) readFile(s *stream, r *readFileRequest) error {
	p, err := srv.abs(r.path, "read file: path")
	if err != nil {
		return err
	}
	limit := r.maxBytes
	if limit <= 0 {
		limit = DefaultMaxReadBytes
	}
	// O_NONBLOCK: opening a FIFO must not wait for a writer (it is
	// refused below); O_NOCTTY: nor make a terminal the agent's.
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("read file: %w", &os.PathError{Op: "open", Path: p, Err: err})
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("read file: %w", err)
	}
	if fi.IsDir() {
		return errorf(CodeInvalidArgument, "read file %s: is a directory", p)
	}
	if !fi.Mode().IsRegular() {
		// A FIFO or a device (/dev/zero) would block or never end.
		return errorf(CodeFailedPrecondition, "read file %s: is a %s, not a regular file", p, rawfile.TypeName(uint32(fi.Sys().(*syscall.Stat_t).Mode)))
	}
	tooLarge := func(n int64) error {
		return errorf(CodeTooLarge, "read file %s: %d bytes or more, limit is %d", p, n, limit)
	}
	if fi.Size() > limit {
		return tooLarge(fi.Size())
	}
	// The size can lie (/proc files, a file still growing), so count too.
	buf := make([]byte, MaxChunk)
	var total int64
	for {
		n, err := f.Read(buf)
		if n > 0 {
			total += int64(n)
			if total > limit {
				return tooLarge(total)
			}
			if serr := s.sendData(s.ctx, chBody, buf[:n], false); serr != nil {
				return fmt.Errorf("read file %s: %w", p, serr)
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read file: %w", err)
		}
	}
}

// putArchive extracts a tar stream under dir. Every entry goes through an
// os.Root, so neither "../" names nor symlinks (planted earlier in the same
// archive or already in the sandbox) can write outside dir.
func (srv *server) putArchive(s *stream, r *putArchiveRequest) error {
	dir, err := srv.abs(r.dir, "put archive: dir")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("put archive: %w", err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		return fmt.Errorf("put archive: %w", &os.PathError{Op: "statfs", Path: dir, Err: err})
	}
	if name := pseudoFS(sfs.Type); name != "" {
		return errorf(CodePermissionDenied, "put archive into %s: is on %s, which the agent does not write to", dir, name)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("put archive: %w", err)
	}
	defer root.Close()
	tr := tar.NewReader(&bodyReader{ctx: s.ctx, s: s})
	chown := os.Geteuid() == 0
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("put archive into %s: %w", dir, err)
		}
		name := strings.TrimLeft(path.Clean("/"+hdr.Name), "/")
		if name == "" {
			name = "."
		}
		if err := extract(root, name, hdr, tr, chown); err != nil {
			return fmt.Errorf("put archive into %s: entry %q: %w", dir, hdr.Name, err)
		}
	}
}

func extract(root *os.Root, name string, hdr *tar.Header, body io.Reader, chown bool) error {
	mode := fs.FileMode(hdr.Mode) & fs.ModePerm
	if hdr.Mode&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if hdr.Mode&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if hdr.Mode&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	if name != "." {
		if err := root.MkdirAll(path.Dir(name), 0o755); err != nil {
			return err
		}
	}
	// An existing non-directory is replaced, as tar does.
	replace := func() error {
		fi, err := root.Lstat(name)
		if err == nil && !fi.IsDir() {
			return root.Remove(name)
		}
		if err == nil {
			return errorf(CodeAlreadyExists, "a directory is in the way")
		}
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := root.MkdirAll(name, 0o755); err != nil {
			return err
		}
		if err := root.Chmod(name, mode); err != nil {
			return err
		}
	case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old archives still use TypeRegA
		if err := replace(); err != nil {
			return err
		}
		f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, body)
		if err == nil {
			err = f.Chmod(mode)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case tar.TypeSymlink:
		if err := replace(); err != nil {
			return err
		}
		if err := root.Symlink(hdr.Linkname, name); err != nil {
			return err
		}
	case tar.TypeLink:
		target := strings.TrimLeft(path.Clean("/"+hdr.Linkname), "/")
		if err := replace(); err != nil {
			return err
		}
		if err := root.Link(target, name); err != nil {
			return err
		}
	default:
		return nil // devices, fifos: not needed in a workspace, and risky
	}
	if chown {
		if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
			return err
		}
		if hdr.Typeflag != tar.TypeSymlink && mode&(fs.ModeSetuid|fs.ModeSetgid) != 0 {
			// chown clears set-id bits; put them back.
			if err := root.Chmod(name, mode); err != nil {
				return err
			}
		}
	}
	if hdr.Typeflag != tar.TypeSymlink && !hdr.ModTime.IsZero() {
		return root.Chtimes(name, hdr.ModTime, hdr.ModTime)
	}
	return nil
}

// getArchive writes dir as a tar stream. Names are relative to dir.
func (srv *server) getArchive(s *stream, r *getArchiveRequest) error {
	dir, err := srv.abs(r.dir, "get archive: dir")
	if err != nil {
		return err
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("get archive: %w", err)
	}
	if fi.Mode().IsRegular() {
		// One file (a verifier's artifact): its archive holds it alone,
		// under its base name, so that its siblings stay behind.
		tw := tar.NewWriter(bodyWriter{ctx: s.ctx, s: s})
		hdr, err := tar.FileInfoHeader(fi, "")
		if err == nil {
			hdr.Name = filepath.Base(dir)
			err = tw.WriteHeader(hdr)
		}
		if err == nil {
			err = copyRegular(tw, dir, fi, hdr.Size)
		}
		if err == nil {
			err = tw.Close()
		}
		if err != nil {
			return fmt.Errorf("get archive %s: %w", dir, err)
		}
		return nil
	}
	if !fi.IsDir() {
		return errorf(CodeInvalidArgument, "get archive: %s is neither a directory nor a regular file", dir)
	}
	rootDev := fi.Sys().(*syscall.Stat_t).Dev
	tw := tar.NewWriter(bodyWriter{ctx: s.ctx, s: s})
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if info.Mode()&(fs.ModeSocket|fs.ModeIrregular) != 0 {
			return nil
		}
		// Kernel file systems mounted below (/proc, /sys under /) are not
		// the sandbox's files: their sizes lie and some reads never end.
		if info.IsDir() && info.Sys().(*syscall.Stat_t).Dev != rootDev {
			var sfs unix.Statfs_t
			if unix.Statfs(p, &sfs) == nil && pseudoFS(sfs.Type) != "" {
				return filepath.SkipDir
			}
		}
		link := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if info.IsDir() {
			hdr.Name += "/"
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if !info.Mode().IsRegular() {
			return nil
		}
		return copyRegular(tw, p, info, hdr.Size)
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		return fmt.Errorf("get archive %s: %w", dir, err)
	}
	return nil
}

// copyRegular writes the regular file p, as the walk saw it (info), to tw:
// exactly size bytes. The workload may replace it meanwhile: it is opened
// without following a link and without blocking (a FIFO in its place would
// wait for a writer), and must still be the same regular file.
func copyRegular(tw io.Writer, p string, info fs.FileInfo, size int64) error {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: p, Err: err}
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return &os.PathError{Op: "fstat", Path: p, Err: err}
	}
	was := info.Sys().(*syscall.Stat_t)
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Dev != was.Dev || st.Ino != was.Ino {
		return errorf(CodeFailedPrecondition, "%s changed while it was archived (now a %s)", p, rawfile.TypeName(st.Mode))
	}
	// A file that grew is cut at the size in its header; one that shrank
	// fails the archive (the tar writer counts).
	_, err = io.CopyN(tw, f, size)
	if err == io.EOF {
		err = errorf(CodeFailedPrecondition, "%s shrank while it was archived", p)
	}
	return err
}
