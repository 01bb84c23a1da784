package layer

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// requireSameTree asserts that got holds exactly what want holds, root
// included.
func requireSameTree(t *testing.T, want, got string) {
	t.Helper()
	w, g := snapshot(t, want), snapshot(t, got)
	require.Equal(t, keys(w), keys(g))
	for _, k := range keys(w) {
		assert.Equal(t, w[k], g[k], "entry %q", k)
	}
}

func TestCopyTreeKeepsEverything(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	src := makeTree(t)
	p := func(s string) string { return filepath.Join(src, s) }
	// More than makeTree has: a socket, a block device, a hard link in
	// another directory, a hard-linked whiteout (overlayfs shares one
	// whiteout inode this way), a read-only directory with content and
	// the root's own metadata.
	sock, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	require.NoError(t, err)
	defer unix.Close(sock)
	require.NoError(t, unix.Bind(sock, &unix.SockaddrUnix{Name: p("sock")}))
	require.NoError(t, unix.Mknod(p("blk"), unix.S_IFBLK|0o640, int(unix.Mkdev(7, 0))))
	require.NoError(t, os.Link(p("usr/bin/tool"), p("opaque/tool-link")))
	require.NoError(t, os.Link(p("whiteout"), p("usr/whiteout2")))
	require.NoError(t, os.MkdirAll(p("ro/sub"), 0o755))
	require.NoError(t, os.WriteFile(p("ro/sub/f"), []byte("in a read-only dir"), 0o444))
	require.NoError(t, os.Chmod(p("ro"), 0o555))
	require.NoError(t, os.WriteFile(p("big"), bigContent(0), 0o644)) // hashed while the next chunk is copied
	require.NoError(t, os.Chmod(src, 0o711))
	require.NoError(t, unix.Lchown(src, 7, 8))
	require.NoError(t, unix.Setxattr(src, "trusted.overlay.impure", []byte("y"), 0))
	old := time.Date(1999, 1, 2, 3, 4, 5, 6, time.UTC)
	require.NoError(t, os.Chtimes(p("ro"), old, old))
	require.NoError(t, os.Chtimes(src, old, old))

	dst := filepath.Join(t.TempDir(), "copy")
	digest, err := CopyTree(ctx, src, dst)
	require.NoError(t, err)
	require.NoError(t, blobstore.ValidateDigest(digest))
	requireSameTree(t, src, dst)
	got := snapshot(t, dst)
	assert.Equal(t, "etc-file", got["hardlink"].LinkGroup, "hard link kept")
	assert.Equal(t, "opaque/tool-link", got["usr/bin/tool"].LinkGroup, "hard link across directories kept")
	assert.Equal(t, map[string]string{opaqueXattr: "y"}, got["opaque"].Xattrs)
	assert.Equal(t, uint32(unix.S_IFCHR), got["usr/whiteout2"].Mode, "whiteout: a 0:0 character device, mode 0")
	assert.Equal(t, uint32(unix.S_IFSOCK), got["sock"].Mode&unix.S_IFMT)
	var a, b unix.Stat_t
	require.NoError(t, unix.Lstat(filepath.Join(dst, "whiteout"), &a))
	require.NoError(t, unix.Lstat(filepath.Join(dst, "usr/whiteout2"), &b))
	assert.Equal(t, a.Ino, b.Ino, "hard-linked whiteouts stay one inode")
	var sst, dstt unix.Stat_t
	require.NoError(t, unix.Lstat(p("etc-file"), &sst))
	require.NoError(t, unix.Lstat(filepath.Join(dst, "etc-file"), &dstt))
	assert.NotEqual(t, sst.Ino, dstt.Ino, "a copy, not a link to the source")

	// The digest names the tree, not where it is: a copy of the copy has
	// the same one.
	again, err := CopyTree(ctx, dst, filepath.Join(t.TempDir(), "again"))
	require.NoError(t, err)
	assert.Equal(t, digest, again)
}

// bigContent is a file large enough for CopyTree to hash it on a second
// goroutine, not a whole number of chunks, with byte i changed to 'X' when
// i > 0.
func bigContent(i int) []byte {
	b := bytes.Repeat([]byte("0123456789abcdef"), (3*pipelineMin+17)/16)
	if i > 0 {
		b[i] = 'X'
	}
	return b
}

func TestCopyTreeDigestCoversContentAndMetadata(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	src := makeTree(t)
	big := filepath.Join(src, "big")
	require.NoError(t, os.WriteFile(big, bigContent(0), 0o644))
	require.NoError(t, os.Chtimes(big, testTime, testTime))
	digest := func() string {
		t.Helper()
		d, err := CopyTree(ctx, src, filepath.Join(t.TempDir(), "c"))
		require.NoError(t, err)
		return d
	}
	base := digest()
	require.Equal(t, base, digest(), "same tree, same digest")
	f := filepath.Join(src, "etc-file")
	var st unix.Stat_t
	require.NoError(t, unix.Lstat(f, &st))
	restore := func() {
		require.NoError(t, unix.UtimesNanoAt(unix.AT_FDCWD, f, []unix.Timespec{st.Atim, st.Mtim}, 0))
	}
	changes := []struct {
		name   string
		change func()
		undo   func()
	}{
		{"content, same size and mtime", func() {
			require.NoError(t, os.WriteFile(f, bytes.Repeat([]byte("DATA"), 5000), 0o640))
			restore()
		}, func() {
			require.NoError(t, os.WriteFile(f, bytes.Repeat([]byte("data"), 5000), 0o640))
			restore()
		}},
		{"a byte of a big file, same size and mtime", func() {
			require.NoError(t, os.WriteFile(big, bigContent(2*pipelineMin+5), 0o644))
			require.NoError(t, os.Chtimes(big, testTime, testTime))
		}, func() {
			require.NoError(t, os.WriteFile(big, bigContent(0), 0o644))
			require.NoError(t, os.Chtimes(big, testTime, testTime))
		}},
		{"mode", func() { require.NoError(t, os.Chmod(f, 0o600)) }, func() { require.NoError(t, os.Chmod(f, 0o640)) }},
		{"owner", func() { require.NoError(t, os.Lchown(f, 1, 5678)) }, func() { require.NoError(t, os.Lchown(f, 1234, 5678)) }},
		{"mtime", func() { require.NoError(t, os.Chtimes(f, time.Now(), time.Now())) }, restore},
		{"xattr", func() { require.NoError(t, unix.Setxattr(f, "user.note", []byte("kepT"), 0)) },
			func() { require.NoError(t, unix.Setxattr(f, "user.note", []byte("kept"), 0)) }},
		{"opaque", func() { require.NoError(t, unix.Removexattr(filepath.Join(src, "opaque"), opaqueXattr)) },
			func() { require.NoError(t, unix.Setxattr(filepath.Join(src, "opaque"), opaqueXattr, []byte("y"), 0)) }},
		{"symlink target", func() {
			require.NoError(t, os.Remove(filepath.Join(src, "rel-link")))
			require.NoError(t, os.Symlink("usr/bin/toot", filepath.Join(src, "rel-link")))
		}, nil},
		{"a whiteout added", func() { require.NoError(t, unix.Mknod(filepath.Join(src, "usr/wh"), unix.S_IFCHR, 0)) }, nil},
	}
	seen := map[string]string{base: "base"}
	for _, c := range changes {
		c.change()
		d := digest()
		if prev, ok := seen[d]; ok {
			t.Errorf("after %s the digest is that of %s", c.name, prev)
		}
		seen[d] = c.name
		if c.undo != nil {
			c.undo()
			assert.Equal(t, base, digest(), "undoing %s", c.name)
		}
	}
}

func TestCopyTreeErrors(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	_, err := CopyTree(ctx, filepath.Join(dir, "missing"), filepath.Join(dir, "out1"))
	assert.ErrorContains(t, err, "missing")
	_, err = CopyTree(ctx, file, filepath.Join(dir, "out2"))
	assert.ErrorContains(t, err, "not a directory")
	src := makeTree(t)
	_, err = CopyTree(ctx, src, dir) // dst exists
	assert.ErrorContains(t, err, "exists")
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = CopyTree(cancelled, src, filepath.Join(dir, "out3"))
	assert.ErrorIs(t, err, context.Canceled)
}

// TestDirLayerStacksLikeTheUpper is what a checkpoint relies on: the copy
// of an overlay's upper directory, stacked as a plain lower directory on
// the same layers, shows exactly what the overlay showed; through Mounts
// it is handed over as is; and merged with the layers under it, it packs
// into one EROFS layer that shows the same.
func TestDirLayerStacksLikeTheUpper(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	base, err := buildFromTar(ctx, e.repo, bytes.NewReader(makeTar(t, lowerLayer)), nil)
	require.NoError(t, err)
	baseDir := e.mount(t, base)

	// A writable overlay as a sandbox has, changed in every way a diff
	// must capture.
	scratch := t.TempDir()
	upper, work, merged := filepath.Join(scratch, "upper"), filepath.Join(scratch, "work"), filepath.Join(scratch, "merged")
	for _, d := range []string{upper, work, merged} {
		require.NoError(t, os.Mkdir(d, 0o755))
	}
	require.NoError(t, unix.Mount("overlay", merged, "overlay", 0,
		"lowerdir="+baseDir+",upperdir="+upper+",workdir="+work+",index=off,redirect_dir=off,metacopy=off"))
	t.Cleanup(func() { unix.Unmount(merged, unix.MNT_DETACH) })
	m := func(s string) string { return filepath.Join(merged, s) }
	require.NoError(t, os.WriteFile(m("added"), []byte("new"), 0o600))          // created
	require.NoError(t, os.WriteFile(m("keep"), []byte("modified"), 0o644))      // modified
	require.NoError(t, os.Remove(m("gone")))                                    // deleted base file
	require.NoError(t, os.RemoveAll(m("dir")))                                  // directory replaced
	require.NoError(t, os.WriteFile(m("dir"), []byte("now a file"), 0o644))     // ... by a file
	require.NoError(t, os.Remove(m("other/x")))                                 // emptied
	require.NoError(t, os.Remove(m("other")))                                   // directory deleted
	require.NoError(t, os.Mkdir(m("other"), 0o700))                             // and made again: opaque
	require.NoError(t, os.WriteFile(m("other/y"), []byte("y"), 0o644))          // with new content
	require.NoError(t, os.Symlink("keep", m("link")))                           // symlink
	require.NoError(t, os.Link(m("added"), m("added-link")))                    // hard link
	require.NoError(t, os.MkdirAll(m("deep/er/est"), 0o750))                    // new tree
	require.NoError(t, os.WriteFile(m("deep/er/est/f"), []byte("deep"), 0o640)) // ...
	want := snapshot(t, merged)

	dl, err := NewDirLayers(filepath.Join(t.TempDir(), "ck"))
	require.NoError(t, err)
	st, err := dl.Stage(ctx, upper)
	require.NoError(t, err)
	dir, err := st.Commit()
	require.NoError(t, err)
	require.NoError(t, st.Discard())
	assert.True(t, dl.Contains(dir))
	p, err := dl.Path(st.Digest())
	require.NoError(t, err)
	assert.Equal(t, p, dir)

	// The upper goes on changing; the checkpoint does not.
	require.NoError(t, os.WriteFile(m("added"), []byte("after"), 0o600))
	require.NoError(t, os.Remove(m("keep")))
	require.NoError(t, os.WriteFile(m("later"), nil, 0o644))

	got, err := e.mounts.Acquire(ctx, st.Digest(), dir)
	require.NoError(t, err)
	assert.Equal(t, dir, got, "a directory layer is handed over as is")
	assert.Equal(t, 1, e.mounts.Refs(st.Digest()))
	points, err := mountPointsUnder(e.mounts.Root())
	require.NoError(t, err)
	for _, pt := range points {
		assert.NotContains(t, pt, strings.TrimPrefix(st.Digest(), "sha256:"), "nothing mounted for a directory layer")
	}
	view := overlay(t, baseDir, got)
	assertSameView(t, want, snapshot(t, view))
	require.NoError(t, e.mounts.Release(st.Digest()))
	assert.Equal(t, 0, e.mounts.Refs(st.Digest()))
	assert.ErrorContains(t, e.mounts.Release(st.Digest()), "not acquired")

	baseFile, err := e.repo.Path(base.Digest)
	require.NoError(t, err)
	flat, err := Merge(ctx, e.repo, []string{baseFile, dir})
	require.NoError(t, err)
	assertSameView(t, want, snapshot(t, e.mount(t, flat)))
}

// assertSameView compares two views of a file system; the root's times
// and xattrs belong to the mount point, and inode-sharing only matters
// within a view.
func assertSameView(t *testing.T, want, got map[string]node) {
	t.Helper()
	require.Equal(t, keys(want), keys(got), describe(got))
	for _, k := range keys(want) {
		w, g := want[k], got[k]
		if k == "." {
			continue
		}
		w.Xattrs, g.Xattrs = nil, nil // trusted.overlay.* of the upper
		assert.Equal(t, w, g, "entry %q", k)
	}
}

func TestDirLayersShareAndRetire(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	root := filepath.Join(t.TempDir(), "ck")
	require.NoError(t, os.MkdirAll(filepath.Join(root, "layers", "leftover"), 0o755))
	dl, err := NewDirLayers(root)
	require.NoError(t, err)
	assert.NoDirExists(t, filepath.Join(root, "layers", "leftover"), "opening empties the store")
	src := makeTree(t)

	s1, err := dl.Stage(ctx, src)
	require.NoError(t, err)
	s2, err := dl.Stage(ctx, src)
	require.NoError(t, err)
	assert.Equal(t, s1.Digest(), s2.Digest())
	d1, err := s1.Commit()
	require.NoError(t, err)
	d2, err := s2.Commit()
	require.NoError(t, err, "the same tree again is not an error")
	assert.Equal(t, d1, d2, "identical trees share one directory")
	require.NoError(t, s1.Discard())
	require.NoError(t, s2.Discard())
	requireSameTree(t, src, d1)
	all, err := dl.Layers()
	require.NoError(t, err)
	assert.Equal(t, []string{s1.Digest()}, all)
	tmp, err := os.ReadDir(filepath.Join(root, "tmp"))
	require.NoError(t, err)
	assert.Empty(t, tmp, "the duplicate copy is gone")

	// Retired, the directory is out of place at once; a new commit of the
	// same tree is not removed with it.
	s3, err := dl.Stage(ctx, src)
	require.NoError(t, err)
	remove, err := dl.Retire(s1.Digest())
	require.NoError(t, err)
	assert.NoDirExists(t, d1)
	d3, err := s3.Commit()
	require.NoError(t, err)
	require.NoError(t, remove())
	requireSameTree(t, src, d3)
	remove, err = dl.Retire(s3.Digest())
	require.NoError(t, err)
	require.NoError(t, remove())
	remove, err = dl.Retire(s3.Digest())
	require.NoError(t, err, "retiring what is not there")
	require.NoError(t, remove())
	all, err = dl.Layers()
	require.NoError(t, err)
	assert.Empty(t, all)
	tmp, err = os.ReadDir(filepath.Join(root, "tmp"))
	require.NoError(t, err)
	assert.Empty(t, tmp)

	// A failed copy leaves nothing behind.
	_, err = dl.Stage(ctx, filepath.Join(src, "etc-file"))
	assert.ErrorContains(t, err, "not a directory")
	tmp, err = os.ReadDir(filepath.Join(root, "tmp"))
	require.NoError(t, err)
	assert.Empty(t, tmp)
	_, err = dl.Retire("sha256:nope")
	assert.Error(t, err)
}
