package layer

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// node is what a test compares about one file system entry.
type node struct {
	Mode    uint32
	UID     uint32
	GID     uint32
	Size    int64
	Rdev    uint64
	Mtime   int64 // ns
	Content string
	Link    string
	Xattrs  map[string]string
	// LinkGroup is the first path (in walk order) sharing this inode, so
	// hard links compare equal across trees regardless of inode numbers.
	LinkGroup string
}

// snapshot records every entry under root. Directory sizes and nlink are
// left out: they differ between file systems for the same tree.
func snapshot(t *testing.T, root string) map[string]node {
	t.Helper()
	out := map[string]node{}
	inodes := map[uint64]string{}
	err := filepath.WalkDir(root, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		n := node{Mode: st.Mode, UID: st.Uid, GID: st.Gid, Rdev: st.Rdev, Mtime: st.Mtim.Nano(), Xattrs: xattrs(t, p)}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			n.Size = st.Size
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			n.Content = string(b)
			if first, ok := inodes[st.Ino]; ok {
				n.LinkGroup = first
			} else {
				inodes[st.Ino] = rel
				n.LinkGroup = rel
			}
		case unix.S_IFLNK:
			n.Link, err = os.Readlink(p)
			if err != nil {
				return err
			}
		}
		out[rel] = n
		return nil
	})
	require.NoError(t, err)
	return out
}

func xattrs(t *testing.T, p string) map[string]string {
	t.Helper()
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	require.NoError(t, err, p)
	if n == 0 {
		return nil
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		v := make([]byte, 64<<10)
		vn, err := unix.Lgetxattr(p, name, v)
		require.NoError(t, err, "%s %s", p, name)
		out[name] = string(v[:vn])
	}
	return out
}

func keys(m map[string]node) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// env is a blob store, an image store and a mount cache in temp dirs,
// cleaned up (mounts included) at the end of the test.
type env struct {
	repo   *blobstore.Dir
	images *image.Store
	mounts *Mounts
}

func newEnv(t *testing.T) *env {
	t.Helper()
	testutil.RequireRoot(t)
	repo, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	mroot := filepath.Join(t.TempDir(), "layers")
	mounts, err := NewMounts(mroot)
	require.NoError(t, err)
	t.Cleanup(func() {
		// Catch-all: a failed test may leave layers acquired.
		points, _ := mountPointsUnder(mounts.Root())
		for i := len(points) - 1; i >= 0; i-- {
			unix.Unmount(points[i], unix.MNT_DETACH)
		}
		unix.Unmount(mounts.Root(), unix.MNT_DETACH) // the shared root bind
	})
	return &env{repo: repo, images: image.NewStore(repo, repo.Refs()), mounts: mounts}
}

// mount acquires a stored layer and releases it at the end of the test.
func (e *env) mount(t *testing.T, d blobstore.Descriptor) string {
	t.Helper()
	p, err := e.repo.Path(d.Digest)
	require.NoError(t, err)
	dir, err := e.mounts.Acquire(context.Background(), d.Digest, p)
	require.NoError(t, err)
	t.Cleanup(func() { e.mounts.Release(d.Digest) })
	return dir
}

// overlay mounts a read-only overlay of dirs (bottom first) and unmounts it
// at the end of the test.
func overlay(t *testing.T, lowers ...string) string {
	t.Helper()
	target := t.TempDir()
	rev := make([]string, len(lowers))
	for i, l := range lowers {
		rev[len(lowers)-1-i] = l
	}
	require.NoError(t, unix.Mount("overlay", target, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(rev, ":")))
	t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
	return target
}

var testTime = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)

// tarEntry is one entry of a test archive.
type tarEntry struct {
	name     string
	typ      byte
	mode     int64
	body     string
	link     string
	uid, gid int
	major    int64
	minor    int64
	xattrs   map[string]string
}

func makeTar(t *testing.T, entries []tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		mode := e.mode
		if mode == 0 {
			mode = 0o644
			if e.typ == tar.TypeDir {
				mode = 0o755
			}
		}
		h := &tar.Header{
			Name: e.name, Typeflag: e.typ, Mode: mode, Size: int64(len(e.body)),
			Linkname: e.link, Uid: e.uid, Gid: e.gid, Devmajor: e.major, Devminor: e.minor,
			ModTime: testTime, Format: tar.FormatPAX,
		}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		for k, v := range e.xattrs {
			if h.PAXRecords == nil {
				h.PAXRecords = map[string]string{}
			}
			h.PAXRecords[paxXattrPrefix+k] = v
		}
		require.NoError(t, tw.WriteHeader(h), e.name)
		if h.Size > 0 {
			_, err := tw.Write([]byte(e.body))
			require.NoError(t, err)
		}
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

func describe(m map[string]node) string {
	var b strings.Builder
	for _, k := range keys(m) {
		fmt.Fprintf(&b, "%s %+v\n", k, m[k])
	}
	return b.String()
}
