package agent

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWriteReadFile(t *testing.T) {
	dir := t.TempDir()
	c := startAgent(t, Options{Workdir: dir})
	ctx := context.Background()

	big := bytes.Repeat([]byte("0123456789"), 300_000) // 3 MB: many chunks, several windows
	tests := []struct {
		name string
		path string
		data []byte
		mode uint32
		want fs.FileMode
	}{
		{"parents created", filepath.Join(dir, "a/b/c.txt"), []byte("hello"), 0o600, 0o600},
		{"default mode", filepath.Join(dir, "plain"), []byte("x"), 0, 0o644},
		{"mode not narrowed by umask", filepath.Join(dir, "exe"), []byte("#!/bin/sh\n"), 0o777, 0o777},
		{"empty", filepath.Join(dir, "empty"), nil, 0o640, 0o640},
		{"large", filepath.Join(dir, "big"), big, 0o644, 0o644},
		{"relative to workdir", "rel/file", []byte("rel"), 0o644, 0o644},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			require.NoError(t, c.WriteFile(ctx, tc.path, tc.data, tc.mode))
			p := tc.path
			if !filepath.IsAbs(p) {
				p = filepath.Join(dir, p)
			}
			fi, err := os.Stat(p)
			require.NoError(t, err)
			assert.Equal(t, tc.want, fi.Mode().Perm())
			got, err := os.ReadFile(p)
			require.NoError(t, err)
			assert.Equal(t, len(tc.data), len(got))
			assert.True(t, bytes.Equal(tc.data, got))

			back, err := c.ReadFile(ctx, tc.path, 0)
			require.NoError(t, err)
			assert.True(t, bytes.Equal(tc.data, back))
		})
	}

	t.Run("overwrite truncates", func(t *testing.T) {
		p := filepath.Join(dir, "over")
		require.NoError(t, c.WriteFile(ctx, p, []byte("long long content"), 0o644))
		require.NoError(t, c.WriteFile(ctx, p, []byte("short"), 0o644))
		got, err := c.ReadFile(ctx, p, 0)
		require.NoError(t, err)
		assert.Equal(t, "short", string(got))
	})
	t.Run("too large", func(t *testing.T) {
		_, err := c.ReadFile(ctx, filepath.Join(dir, "big"), 1000)
		var ae *Error
		require.ErrorAs(t, err, &ae)
		assert.Equal(t, CodeTooLarge, ae.Code)
		assert.Contains(t, err.Error(), filepath.Join(dir, "big"))
	})
	t.Run("size unknown until read", func(t *testing.T) {
		b, err := c.ReadFile(ctx, "/proc/self/status", 0)
		require.NoError(t, err)
		assert.Contains(t, string(b), "NSpid:")
		_, err = c.ReadFile(ctx, "/proc/self/status", 10)
		var ae *Error
		require.ErrorAs(t, err, &ae)
		assert.Equal(t, CodeTooLarge, ae.Code)
	})
	t.Run("missing", func(t *testing.T) {
		p := filepath.Join(dir, "nope")
		_, err := c.ReadFile(ctx, p, 0)
		assert.ErrorIs(t, err, fs.ErrNotExist)
		assert.Contains(t, err.Error(), p)
	})
	t.Run("directory", func(t *testing.T) {
		_, err := c.ReadFile(ctx, dir, 0)
		assert.ErrorIs(t, err, fs.ErrInvalid)
	})
	t.Run("parent is a file", func(t *testing.T) {
		err := c.WriteFile(ctx, filepath.Join(dir, "plain", "x"), big, 0o644)
		require.Error(t, err)
		assert.Contains(t, err.Error(), filepath.Join(dir, "plain"))
		require.NoError(t, c.Ping(ctx))
	})
	t.Run("empty path", func(t *testing.T) {
		err := c.WriteFile(ctx, "", nil, 0)
		assert.ErrorIs(t, err, fs.ErrInvalid)
	})
}

type tarEntry struct {
	hdr  tar.Header
	body string
}

func makeTar(t *testing.T, entries []tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		h.Size = int64(len(e.body))
		if h.ModTime.IsZero() {
			h.ModTime = time.Unix(1700000000, 0)
		}
		require.NoError(t, tw.WriteHeader(&h))
		_, err := tw.Write([]byte(e.body))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

func TestArchiveRoundTrip(t *testing.T) {
	base := t.TempDir()
	c := startAgent(t, Options{})
	ctx := context.Background()
	dst := filepath.Join(base, "new", "dir")
	bigBody := string(bytes.Repeat([]byte("z"), 1<<20))
	in := makeTar(t, []tarEntry{
		{hdr: tar.Header{Name: "src/", Typeflag: tar.TypeDir, Mode: 0o750}},
		{hdr: tar.Header{Name: "src/main.py", Typeflag: tar.TypeReg, Mode: 0o644}, body: "print(1)\n"},
		{hdr: tar.Header{Name: "./bin/run", Typeflag: tar.TypeReg, Mode: 0o755}, body: "#!/bin/sh\n"},
		{hdr: tar.Header{Name: "data/big", Typeflag: tar.TypeReg, Mode: 0o600}, body: bigBody},
		{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "src/main.py"}},
		{hdr: tar.Header{Name: "hard", Typeflag: tar.TypeLink, Linkname: "src/main.py"}},
		{hdr: tar.Header{Name: "../escape", Typeflag: tar.TypeReg, Mode: 0o644}, body: "stays inside"},
	})
	require.NoError(t, c.PutArchive(ctx, dst, bytes.NewReader(in)))

	check := func(name, body string, mode fs.FileMode) {
		t.Helper()
		p := filepath.Join(dst, name)
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		assert.Equal(t, body, string(b))
		fi, err := os.Lstat(p)
		require.NoError(t, err)
		assert.Equal(t, mode, fi.Mode().Perm(), name)
	}
	check("src/main.py", "print(1)\n", 0o644)
	check("bin/run", "#!/bin/sh\n", 0o755)
	check("data/big", bigBody, 0o600)
	check("escape", "stays inside", 0o644)
	_, err := os.Stat(filepath.Join(base, "new", "escape"))
	assert.ErrorIs(t, err, fs.ErrNotExist)
	fi, err := os.Stat(filepath.Join(dst, "src"))
	require.NoError(t, err)
	assert.Equal(t, fs.FileMode(0o750), fi.Mode().Perm())
	target, err := os.Readlink(filepath.Join(dst, "link"))
	require.NoError(t, err)
	assert.Equal(t, "src/main.py", target)
	a, _ := os.Stat(filepath.Join(dst, "hard"))
	b, _ := os.Stat(filepath.Join(dst, "src/main.py"))
	assert.True(t, os.SameFile(a, b), "hard link is a link")
	mt, _ := os.Stat(filepath.Join(dst, "bin/run"))
	assert.Equal(t, int64(1700000000), mt.ModTime().Unix())

	var out bytes.Buffer
	require.NoError(t, c.GetArchive(ctx, dst, &out))
	got := map[string]string{}
	types := map[string]byte{}
	tr := tar.NewReader(&out)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		b, err := io.ReadAll(tr)
		require.NoError(t, err)
		got[h.Name] = string(b)
		types[h.Name] = h.Typeflag
		if h.Typeflag == tar.TypeSymlink {
			got[h.Name] = "-> " + h.Linkname
		}
	}
	assert.Equal(t, map[string]string{
		"bin/": "", "bin/run": "#!/bin/sh\n", "data/": "", "data/big": bigBody,
		"escape": "stays inside", "hard": "print(1)\n", "link": "-> src/main.py",
		"src/": "", "src/main.py": "print(1)\n",
	}, got)
	assert.Equal(t, byte(tar.TypeDir), types["src/"])

	// A regular file's archive holds it alone, under its base name, with
	// its mode: what a verifier copies as one artifact.
	out.Reset()
	require.NoError(t, c.GetArchive(ctx, filepath.Join(dst, "bin/run"), &out))
	tr = tar.NewReader(&out)
	h, err := tr.Next()
	require.NoError(t, err)
	assert.Equal(t, "run", h.Name)
	assert.Equal(t, int64(0o755), h.Mode&0o777)
	body, err := io.ReadAll(tr)
	require.NoError(t, err)
	assert.Equal(t, "#!/bin/sh\n", string(body))
	_, err = tr.Next()
	assert.Equal(t, io.EOF, err, "one entry only")
	// Anything else that is not a directory is refused.
	// A symlink in the file's place is not followed (the workload could
	// point it anywhere in its sandbox, /proc included).
	assert.Error(t, c.GetArchive(ctx, filepath.Join(dst, "link"), io.Discard))
}

func TestPutArchiveCannotEscape(t *testing.T) {
	base := t.TempDir()
	c := startAgent(t, Options{})
	ctx := context.Background()
	dst := filepath.Join(base, "dst")
	outside := filepath.Join(base, "outside")
	require.NoError(t, os.Mkdir(outside, 0o755))

	// A symlink to outside, then a file through it.
	in := makeTar(t, []tarEntry{
		{hdr: tar.Header{Name: "up", Typeflag: tar.TypeSymlink, Linkname: outside}},
		{hdr: tar.Header{Name: "up/pwned", Typeflag: tar.TypeReg, Mode: 0o644}, body: "x"},
	})
	err := c.PutArchive(ctx, dst, bytes.NewReader(in))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "up/pwned")
	_, err = os.Stat(filepath.Join(outside, "pwned"))
	assert.ErrorIs(t, err, fs.ErrNotExist)

	// A relative symlink climbing out, and a hard link to a file outside.
	require.NoError(t, os.WriteFile(filepath.Join(outside, "secret"), []byte("s"), 0o600))
	for _, entries := range [][]tarEntry{
		{
			{hdr: tar.Header{Name: "rel", Typeflag: tar.TypeSymlink, Linkname: "../outside"}},
			{hdr: tar.Header{Name: "rel/pwned2", Typeflag: tar.TypeReg, Mode: 0o644}, body: "x"},
		},
		{
			{hdr: tar.Header{Name: "hl", Typeflag: tar.TypeLink, Linkname: "../outside/secret"}},
		},
	} {
		_ = c.PutArchive(ctx, dst, bytes.NewReader(makeTar(t, entries)))
	}
	_, err = os.Stat(filepath.Join(outside, "pwned2"))
	assert.ErrorIs(t, err, fs.ErrNotExist)
	if fi, err := os.Stat(filepath.Join(dst, "hl")); err == nil {
		sec, _ := os.Stat(filepath.Join(outside, "secret"))
		assert.False(t, os.SameFile(fi, sec), "hard link reached a file outside the dir")
	}

	t.Run("corrupt stream", func(t *testing.T) {
		err := c.PutArchive(ctx, dst, bytes.NewReader(bytes.Repeat([]byte("garbage!"), 200)))
		require.Error(t, err)
		assert.Contains(t, err.Error(), dst)
		require.NoError(t, c.Ping(ctx))
	})
	t.Run("get missing dir", func(t *testing.T) {
		err := c.GetArchive(ctx, filepath.Join(base, "nope"), io.Discard)
		assert.ErrorIs(t, err, fs.ErrNotExist)
	})
}

// TestDiff: the diff request streams what Options.Diff writes; an agent
// without it refuses the request.
func TestDiff(t *testing.T) {
	ctx := context.Background()
	c := startAgent(t, Options{})
	var buf bytes.Buffer
	err := c.Diff(ctx, &buf)
	require.Error(t, err)
	require.ErrorIs(t, err, fs.ErrInvalid)

	want := bytes.Repeat([]byte("diff"), 100000) // several chunks
	c = startAgent(t, Options{Diff: func(ctx context.Context, w io.Writer) error {
		_, err := w.Write(want)
		return err
	}})
	buf.Reset()
	require.NoError(t, c.Diff(ctx, &buf))
	require.Equal(t, want, buf.Bytes())
}
