package image

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// qemuImg creates a disk with qemu-img (the real tool writes the real
// headers these checks read), skipping when it is not installed
// (scripts/deps.sh installs it).
func qemuImg(t *testing.T, args ...string) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed (scripts/deps.sh)")
	}
	out, err := exec.Command("qemu-img", args...).CombinedOutput()
	require.NoError(t, err, "qemu-img %q: %s", args, out)
}

func TestImportDisk(t *testing.T) {
	dir := t.TempDir()
	plain := filepath.Join(dir, "plain.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", plain, "64M")
	raw := filepath.Join(dir, "disk.raw")
	require.NoError(t, os.WriteFile(raw, make([]byte, 1<<20), 0o644))
	backed := filepath.Join(dir, "backed.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", plain, backed)
	external := filepath.Join(dir, "external.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", "-o", "data_file="+filepath.Join(dir, "data.bin"), external, "64M")
	compat := filepath.Join(dir, "v2.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", "-o", "compat=0.10", "-F", "qcow2", "-b", plain, compat)
	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.WriteFile(empty, nil, 0o644))

	for _, tc := range []struct {
		name, path, format, err string
	}{
		{name: "qcow2", path: plain, format: DiskQCOW2},
		{name: "raw", path: raw, format: DiskRaw},
		{name: "backing file", path: backed, err: "backing file"},
		{name: "backing file, qcow2 version 2", path: compat, err: "backing file"},
		{name: "external data file", path: external, err: "external data file"},
		{name: "empty", path: empty, err: "empty"},
		{name: "directory", path: dir, err: "not a regular file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			ctx := context.Background()
			m, err := ImportDisk(ctx, f.blobs, f.store, "disk:v1", tc.path, 0)
			if tc.err != "" {
				require.ErrorIs(t, err, ErrBadDisk)
				assert.ErrorContains(t, err, tc.err)
				_, _, err := f.store.Get(ctx, "disk:v1")
				assert.ErrorIs(t, err, ErrNotFound, "a refused disk is not tagged")
				return
			}
			require.NoError(t, err)
			require.NotNil(t, m.Disk)
			assert.Equal(t, tc.format, m.Disk.Format)
			got, _, err := f.store.Get(ctx, "disk:v1")
			require.NoError(t, err)
			require.Len(t, got.Layers, 1)
			assert.Equal(t, &Disk{Format: tc.format}, got.Disk)
			// The blob is the file, byte for byte (QEMU boots it as is).
			want, err := os.ReadFile(tc.path)
			require.NoError(t, err)
			st, err := f.blobs.Stat(ctx, got.Layers[0].Digest)
			require.NoError(t, err)
			assert.Equal(t, int64(len(want)), st.Size)
		})
	}

	t.Run("too large", func(t *testing.T) {
		f := newFixture(t)
		_, err := ImportDisk(context.Background(), f.blobs, f.store, "disk:v1", raw, 1000)
		assert.ErrorIs(t, err, ErrDiskTooLarge)
	})
	t.Run("bad ref", func(t *testing.T) {
		f := newFixture(t)
		_, err := ImportDisk(context.Background(), f.blobs, f.store, "Disk", raw, 0)
		assert.ErrorIs(t, err, ErrInvalidRef)
	})
}

func TestCheckBackend(t *testing.T) {
	disk := Manifest{Disk: &Disk{Format: DiskQCOW2}}
	layered := Manifest{}
	for _, tc := range []struct {
		name     string
		kind     string
		ms       []Manifest
		toolkits int
		ws       bool
		err      string
	}{
		{name: "fullvm boots a disk", kind: "fullvm", ms: []Manifest{disk}},
		{name: "container takes layers", kind: "container", ms: []Manifest{layered, layered, layered}, ws: true, toolkits: 1},
		{name: "fullvm refuses a layered image", kind: "fullvm", ms: []Manifest{layered}, err: "spec.image: "},
		{name: "fullvm refuses a workspace", kind: "fullvm", ms: []Manifest{disk, disk}, ws: true, err: "spec.workspace: "},
		{name: "fullvm refuses toolkits", kind: "fullvm", ms: []Manifest{disk, layered}, toolkits: 1, err: "spec.toolkits[0]: "},
		{name: "container refuses a disk", kind: "container", ms: []Manifest{disk}, err: "spec.image: "},
		{name: "microvm refuses a disk", kind: "microvm", ms: []Manifest{layered, disk}, ws: true, err: "spec.workspace: "},
		{name: "fncall refuses a disk toolkit", kind: "fncall", ms: []Manifest{layered, layered, disk}, toolkits: 2, err: "spec.toolkits[1]: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckBackend(tc.kind, tc.ms, SpecFields(tc.ws, tc.toolkits))
			if tc.err == "" {
				assert.NoError(t, err)
				return
			}
			assert.ErrorIs(t, err, ErrBackend)
			assert.ErrorContains(t, err, tc.err)
		})
	}
}

func TestResolveForChecksTheBackend(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.put(t, "base:v1", Config{}, "a")
	d := f.layer(t, "a disk")
	_, err := f.store.Put(ctx, "vm:v1", Manifest{Layers: []blobstore.Descriptor{d}, Disk: &Disk{Format: DiskRaw}})
	require.NoError(t, err)

	res, err := f.store.ResolveFor(ctx, "fullvm", "vm:v1", "")
	require.NoError(t, err)
	assert.Equal(t, []blobstore.Descriptor{d}, res.Layers)

	_, err = f.store.ResolveFor(ctx, "container", "vm:v1", "")
	assert.ErrorIs(t, err, ErrBackend)
	assert.ErrorContains(t, err, "spec.image")
	_, err = f.store.ResolveFor(ctx, "fullvm", "vm:v1", "", "base:v1")
	assert.ErrorIs(t, err, ErrBackend)
	assert.ErrorContains(t, err, "spec.toolkits[0]")
}
