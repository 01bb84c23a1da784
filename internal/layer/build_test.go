package layer

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// makeTree builds a directory with every kind of entry a rootfs has.
func makeTree(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	p := func(s string) string { return filepath.Join(root, s) }
	require.NoError(t, os.MkdirAll(p("usr/bin"), 0o755))
	require.NoError(t, os.MkdirAll(p("opaque"), 0o700))
	require.NoError(t, os.WriteFile(p("usr/bin/tool"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	require.NoError(t, os.WriteFile(p("etc-file"), bytes.Repeat([]byte("data"), 5000), 0o640))
	require.NoError(t, os.WriteFile(p("empty"), nil, 0o600))
	require.NoError(t, os.WriteFile(p("fresh"), []byte("mtime is now"), 0o644))
	require.NoError(t, os.Chmod(p("usr/bin/tool"), 0o4755)) // setuid survives
	require.NoError(t, os.Link(p("etc-file"), p("hardlink")))
	require.NoError(t, os.Symlink("usr/bin/tool", p("rel-link")))
	require.NoError(t, os.Symlink("/usr/bin/tool", p("abs-link")))
	require.NoError(t, unix.Mknod(p("null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	require.NoError(t, unix.Mknod(p("whiteout"), unix.S_IFCHR, 0))
	require.NoError(t, unix.Mkfifo(p("fifo"), 0o600))
	require.NoError(t, unix.Lchown(p("etc-file"), 1234, 5678))
	require.NoError(t, unix.Lchown(p("abs-link"), 42, 43))
	require.NoError(t, unix.Setxattr(p("etc-file"), "user.note", []byte("kept"), 0))
	require.NoError(t, unix.Setxattr(p("usr/bin/tool"), "security.capability",
		[]byte{0, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 0)) // cap_net_bind_service
	require.NoError(t, unix.Setxattr(p("opaque"), opaqueXattr, []byte("y"), 0))
	old := time.Date(2001, 2, 3, 4, 5, 6, 789, time.UTC)
	for _, f := range []string{"etc-file", "usr/bin/tool", "usr/bin", "usr", "opaque"} {
		require.NoError(t, os.Chtimes(p(f), old, old))
	}
	ts := []unix.Timespec{unix.NsecToTimespec(old.UnixNano()), unix.NsecToTimespec(old.UnixNano())}
	require.NoError(t, unix.UtimesNanoAt(unix.AT_FDCWD, p("abs-link"), ts, unix.AT_SYMLINK_NOFOLLOW))
	return root
}

func TestBuildFromDirMountsIdenticalTree(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	src := makeTree(t)
	desc, err := Build(ctx, e.repo, src)
	require.NoError(t, err)

	file, err := e.repo.Path(desc.Digest)
	require.NoError(t, err)
	out, err := exec.Command("fsck.erofs", file).CombinedOutput()
	require.NoError(t, err, "fsck.erofs: %s", out)

	mnt := e.mount(t, desc)
	want, got := snapshot(t, src), snapshot(t, mnt)
	require.Equal(t, keys(want), keys(got))
	for _, k := range keys(want) {
		w, g := want[k], got[k]
		if k == "." {
			// The mount point root takes the source dir's metadata too.
			w.Xattrs, g.Xattrs = nil, nil
		}
		assert.Equal(t, w, g, "entry %q", k)
	}
	assert.Equal(t, "etc-file", got["hardlink"].LinkGroup, "hard link kept")
	assert.Equal(t, map[string]string{opaqueXattr: "y"}, got["opaque"].Xattrs)

	// Nothing left behind in the store's temp dir.
	left, err := os.ReadDir(e.repo.TempDir())
	require.NoError(t, err)
	assert.Empty(t, left)
}

func TestBuildIsReproducible(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	repo, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	src := makeTree(t)
	d1, err := Build(ctx, repo, src)
	require.NoError(t, err)
	d2, err := Build(ctx, repo, src)
	require.NoError(t, err)
	assert.Equal(t, d1, d2, "same tree, same digest")

	// A different tree gives a different layer.
	require.NoError(t, os.WriteFile(filepath.Join(src, "new"), []byte("x"), 0o644))
	d3, err := Build(ctx, repo, src)
	require.NoError(t, err)
	assert.NotEqual(t, d1.Digest, d3.Digest)
}

// TestSuperblockChecksumMatchesMkfs checks our checksum against the one
// mkfs.erofs itself writes, on an image we have not touched.
func TestSuperblockChecksumMatchesMkfs(t *testing.T) {
	src := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o644))
	img := filepath.Join(t.TempDir(), "img")
	require.NoError(t, mkfs(context.Background(), img, src))
	b, err := os.ReadFile(img)
	require.NoError(t, err)
	sb := b[sbOffset:]
	require.NotZero(t, binary.LittleEndian.Uint32(sb[sbOffFeatCompat:])&featSBChecksum, "mkfs enables the superblock checksum")
	region := bytes.Clone(b[sbOffset : 1<<sb[sbOffBlkSzBits]])
	want := binary.LittleEndian.Uint32(region[sbOffChecksum:])
	clear(region[sbOffChecksum : sbOffChecksum+4])
	assert.Equal(t, want, ^crc32.Checksum(region, castagnoli))

	require.NoError(t, normalizeSuperblock(img))
	b2, err := os.ReadFile(img)
	require.NoError(t, err)
	assert.Zero(t, binary.LittleEndian.Uint64(b2[sbOffset+sbOffBuildTime:]))
	out, err := exec.Command("fsck.erofs", img).CombinedOutput()
	require.NoError(t, err, "fsck.erofs after normalizing: %s", out)
}

func TestBuildErrors(t *testing.T) {
	repo, err := blobstore.NewDir(t.TempDir())
	require.NoError(t, err)
	_, err = Build(context.Background(), repo, filepath.Join(t.TempDir(), "missing"))
	assert.ErrorContains(t, err, "missing")
	f := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(f, nil, 0o644))
	_, err = Build(context.Background(), repo, f)
	assert.ErrorContains(t, err, "not a directory")
}

// rootfsEntries is a small rootfs archive exercising every entry type.
func rootfsEntries() []tarEntry {
	return []tarEntry{
		{name: "./", typ: tar.TypeDir, mode: 0o755},
		{name: "bin/", typ: tar.TypeDir},
		{name: "bin/sh", typ: tar.TypeReg, mode: 0o755, body: "#!shell"},
		{name: "bin/sh-link", typ: tar.TypeLink, link: "bin/sh"},
		{name: "etc/os-release", typ: tar.TypeReg, body: "ID=test\n", uid: 7, gid: 8,
			xattrs: map[string]string{"user.origin": "tar", "trusted.x": "t"}},
		{name: "usr/lib/deep/file", typ: tar.TypeReg, body: "implicit parents"},
		{name: "lib", typ: tar.TypeSymlink, link: "/usr/lib"},
		{name: "dev/", typ: tar.TypeDir},
		{name: "dev/null", typ: tar.TypeChar, mode: 0o666, major: 1, minor: 3},
		{name: "dev/sda", typ: tar.TypeBlock, mode: 0o660, major: 8, minor: 0},
		{name: "run/fifo", typ: tar.TypeFifo, mode: 0o600},
		{name: "tmp/", typ: tar.TypeDir, mode: 0o1777},
		{name: "etc/replaced", typ: tar.TypeReg, body: "first"},
		{name: "etc/replaced", typ: tar.TypeReg, body: "second"},
	}
}

func checkRootfs(t *testing.T, got map[string]node) {
	t.Helper()
	tm := testTime.UnixNano()
	assert.Equal(t, node{Mode: unix.S_IFREG | 0o755, Size: 7, Mtime: tm, Content: "#!shell", LinkGroup: "bin/sh"}, got["bin/sh"])
	assert.Equal(t, "bin/sh", got["bin/sh-link"].LinkGroup)
	assert.Equal(t, node{Mode: unix.S_IFREG | 0o644, UID: 7, GID: 8, Size: 8, Mtime: tm, Content: "ID=test\n",
		Xattrs: map[string]string{"user.origin": "tar", "trusted.x": "t"}, LinkGroup: "etc/os-release"}, got["etc/os-release"])
	assert.Equal(t, "implicit parents", got["usr/lib/deep/file"].Content)
	assert.Equal(t, unix.S_IFDIR|uint32(0o755), got["usr/lib"].Mode, "implicit parents are 0755")
	assert.Equal(t, node{Mode: unix.S_IFLNK | 0o777, Mtime: tm, Link: "/usr/lib"}, got["lib"])
	assert.Equal(t, node{Mode: unix.S_IFCHR | 0o666, Rdev: unix.Mkdev(1, 3), Mtime: tm}, got["dev/null"])
	assert.Equal(t, node{Mode: unix.S_IFBLK | 0o660, Rdev: unix.Mkdev(8, 0), Mtime: tm}, got["dev/sda"])
	assert.Equal(t, node{Mode: unix.S_IFIFO | 0o600, Mtime: tm}, got["run/fifo"])
	assert.Equal(t, node{Mode: unix.S_IFDIR | 0o1777, Mtime: tm}, got["tmp"])
	assert.Equal(t, tm, got["dev"].Mtime, "directory mtimes survive entries created inside")
	assert.Equal(t, tm, got["."].Mtime)
	assert.Equal(t, "second", got["etc/replaced"].Content)
}

func TestImportRootfsTarballs(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	raw := makeTar(t, rootfsEntries())
	var gz, zst bytes.Buffer
	gzipInto(t, &gz, raw)
	zstdInto(t, &zst, raw)

	var digests []string
	for _, tc := range []struct {
		name string
		data []byte
	}{
		// Misleading extensions: the kind comes from the bytes.
		{"plain.tar.gz", raw},
		{"gzip.tar", gz.Bytes()},
		{"zstd.bin", zst.Bytes()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), tc.name)
			require.NoError(t, os.WriteFile(path, tc.data, 0o644))
			kind, err := Detect(path)
			require.NoError(t, err)
			assert.Equal(t, KindTarball, kind)

			var last, total int64
			ref := "rootfs:" + strings.ReplaceAll(tc.name, ".", "-")
			m, err := Import(ctx, e.repo, e.images, ref, path, func(d, tot int64) { last, total = d, tot })
			require.NoError(t, err)
			assert.Equal(t, total, last, "progress reaches the end")
			assert.Equal(t, int64(len(tc.data)), total)
			require.Len(t, m.Layers, 1)
			got, _, err := e.images.Get(ctx, ref)
			require.NoError(t, err)
			assert.Equal(t, m.Layers, got.Layers)
			checkRootfs(t, snapshot(t, e.mount(t, m.Layers[0])))
			digests = append(digests, m.Layers[0].Digest)
		})
	}
	require.Len(t, digests, 3)
	assert.Equal(t, digests[0], digests[1], "same tree from any compression gives the same layer")
	assert.Equal(t, digests[0], digests[2])
	left, err := os.ReadDir(e.repo.TempDir())
	require.NoError(t, err)
	assert.Empty(t, left, "no temp files left")
}

func TestExtractStaysInsideRoot(t *testing.T) {
	testutil.RequireRoot(t)
	parent := t.TempDir()
	root := filepath.Join(parent, "root")
	require.NoError(t, os.Mkdir(root, 0o755))
	outside := filepath.Join(parent, "outside")
	require.NoError(t, os.WriteFile(outside, []byte("precious"), 0o644))

	raw := makeTar(t, []tarEntry{
		{name: "../../escape-dotdot", typ: tar.TypeReg, body: "a"},
		{name: "up", typ: tar.TypeSymlink, link: "../.."},
		{name: "up/escape-via-symlink", typ: tar.TypeReg, body: "b"},
		{name: "abs", typ: tar.TypeSymlink, link: "/"},
		{name: "abs/via-abs", typ: tar.TypeReg, body: "c"},
		{name: "hl", typ: tar.TypeLink, link: "../outside"},
	})
	err := Extract(context.Background(), bytes.NewReader(raw), root)
	// The hard link to "../outside" resolves to "/outside" inside the root,
	// which does not exist: refused rather than linked to the host file.
	require.ErrorContains(t, err, "hard link")

	b, err := os.ReadFile(outside)
	require.NoError(t, err)
	assert.Equal(t, "precious", string(b))
	entries, err := os.ReadDir(parent)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	assert.ElementsMatch(t, []string{"root", "outside"}, names, "nothing written next to the root")
	// What the archive meant went inside the root instead.
	for _, p := range []string{"escape-dotdot", "escape-via-symlink", "via-abs"} {
		assert.FileExists(t, filepath.Join(root, p))
	}
}

func TestExtractBadInput(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"xz", append([]byte{0xfd, '7', 'z', 'X', 'Z', 0}, make([]byte, 100)...), "xz compression is not supported"},
		{"truncated gzip", func() []byte {
			var b bytes.Buffer
			gzipInto(t, &b, makeTar(t, rootfsEntries()))
			return b.Bytes()[:b.Len()/2]
		}(), "unexpected EOF"},
	} {
		err := Extract(ctx, bytes.NewReader(tc.data), t.TempDir())
		assert.ErrorContains(t, err, tc.want, tc.name)
	}
}

func gzipInto(t *testing.T, w *bytes.Buffer, data []byte) {
	t.Helper()
	zw := gzip.NewWriter(w)
	_, err := zw.Write(data)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
}

func zstdInto(t *testing.T, w *bytes.Buffer, data []byte) {
	t.Helper()
	zw, err := zstd.NewWriter(w)
	require.NoError(t, err)
	_, err = zw.Write(data)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
}
