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
)

// abs resolves a request path: relative paths are taken from the default
// working directory.
func (srv *server) abs(p, field string) (string, error) {
	if p == "" {
		return "", errorf(CodeInvalidArgument, "%s is empty", field)
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
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return fmt.Errorf("write file: %w", err)
	}
	_, err = io.Copy(f, &bodyReader{ctx: s.ctx, s: s})
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

func (srv *server) readFile(s *stream, r *readFileRequest) error {
	p, err := srv.abs(r.path, "read file: path")
	if err != nil {
		return err
	}
	limit := r.maxBytes
	if limit <= 0 {
		limit = DefaultMaxReadBytes
	}
	f, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("read file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("read file: %w", err)
	}
	if fi.IsDir() {
		return errorf(CodeInvalidArgument, "read file %s: is a directory", p)
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
	if !fi.IsDir() {
		return errorf(CodeInvalidArgument, "get archive: %s is not a directory", dir)
	}
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
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(tw, f)
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		return fmt.Errorf("get archive %s: %w", dir, err)
	}
	return nil
}
