package blobstore_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/blobstoretest"
)

// The test binary re-executes itself in a child mode to write a batch
// under a seccomp filter that makes link(2) fail with a given errno, as a
// file system without hard links does (a filter cannot be removed, so
// never in the test process).
const (
	linkErrnoEnv = "DSEC_BLOBSTORE_TEST_LINK_ERRNO"
	linkDirEnv   = "DSEC_BLOBSTORE_TEST_DIR"
)

func TestMain(m *testing.M) {
	if e := os.Getenv(linkErrnoEnv); e != "" {
		os.Exit(writeWithoutLinks(e, os.Getenv(linkDirEnv)))
	}
	os.Exit(m.Run())
}

// sharedBatch is a pack and n refs naming it, and one ref to a blob of
// its own.
func sharedBatch(n int) blobstore.Batch {
	pack := []byte(`{"sandbox":"sb-0","seq":0}` + "\n" + `{"sandbox":"sb-1","seq":0}` + "\n")
	alone := []byte(`{"sandbox":"big","seq":0}` + "\n")
	b := blobstore.Batch{Blobs: [][]byte{pack, alone}}
	for i := range n {
		b.Refs = append(b.Refs, blobstore.Ref{Name: fmt.Sprintf("trajectories/sb-%d", i), Digest: blobstore.Digest(pack)})
	}
	b.Refs = append(b.Refs, blobstore.Ref{Name: "trajectories/big", Digest: blobstore.Digest(alone)})
	return b
}

// writeWithoutLinks is the child: it writes sharedBatch(5) to the store
// at dir with link(2) failing with errno e, and prints the outcome.
func writeWithoutLinks(e, dir string) int {
	errno, err := strconv.Atoi(e)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	d, err := blobstore.NewDir(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if err := denyLinks(syscall.Errno(errno)); err != nil {
		fmt.Fprintln(os.Stderr, "seccomp:", err)
		return 2
	}
	if err := d.WriteBatch(context.Background(), sharedBatch(5)); err != nil {
		fmt.Println(err)
	} else {
		fmt.Println("ok")
	}
	return 0
}

// denyLinks makes every linkat(2) of every thread of the process fail with
// errno (os.Link is linkat on Linux).
func denyLinks(errno syscall.Errno) error {
	prog := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}, // seccomp_data.nr
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: unix.SYS_LINKAT},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(errno)},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return err
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog))); e != 0 {
		return e
	}
	return nil
}

func stat(t *testing.T, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Stat(p, &st))
	return st
}

// Refs of one batch naming one digest share one ref file (one inode,
// linked once per ref), and each is still its own ref: Set and Delete of
// one, or a later batch moving some, leave the others as they are.
func TestDirBatchSharesRefInode(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	const n = 30
	b := sharedBatch(n)
	require.NoError(t, d.WriteBatch(ctx, b))
	assertNoTemps(t, d)
	path := func(i int) string { return filepath.Join(d.Root(), "refs", "trajectories", fmt.Sprintf("sb-%d", i)) }
	first := stat(t, path(0))
	assert.Equal(t, uint64(n), uint64(first.Nlink), "links of the shared ref file")
	for i := range n {
		st := stat(t, path(i))
		require.Equal(t, first.Ino, st.Ino, "ref %d has a file of its own", i)
		raw, err := os.ReadFile(path(i))
		require.NoError(t, err)
		require.Equal(t, b.Refs[0].Digest+"\n", string(raw))
		require.Equal(t, os.FileMode(0o644), os.FileMode(st.Mode).Perm())
	}
	big := stat(t, filepath.Join(d.Root(), "refs", "trajectories", "big"))
	assert.NotEqual(t, first.Ino, big.Ino, "a ref to another digest shares the file")
	assert.Equal(t, uint64(1), uint64(big.Nlink))

	// Set replaces one name only.
	other := blobstore.Digest(b.Blobs[1])
	require.NoError(t, d.Refs().Set(ctx, "trajectories/sb-3", other))
	assert.NotEqual(t, first.Ino, stat(t, path(3)).Ino)
	assert.Equal(t, uint64(n-1), uint64(stat(t, path(0)).Nlink))
	// Delete too.
	require.NoError(t, d.Refs().Delete(ctx, "trajectories/sb-4"))
	assert.NoFileExists(t, path(4))
	assert.Equal(t, uint64(n-2), uint64(stat(t, path(0)).Nlink))
	// A later batch moving five of them to a new pack gives those five a
	// new shared file.
	next := []byte("next pack\n")
	moved := blobstore.Batch{Blobs: [][]byte{next}}
	for i := 10; i < 15; i++ {
		moved.Refs = append(moved.Refs, blobstore.Ref{Name: fmt.Sprintf("trajectories/sb-%d", i), Digest: blobstore.Digest(next)})
	}
	require.NoError(t, d.WriteBatch(ctx, moved))
	movedIno := stat(t, path(10)).Ino
	assert.NotEqual(t, first.Ino, movedIno)
	assert.Equal(t, uint64(5), uint64(stat(t, path(10)).Nlink))
	assert.Equal(t, uint64(n-7), uint64(stat(t, path(0)).Nlink))
	for i := range n {
		want := b.Refs[0].Digest
		switch {
		case i == 3:
			want = other
		case i == 4:
			continue
		case i >= 10 && i < 15:
			want = blobstore.Digest(next)
			require.Equal(t, movedIno, stat(t, path(i)).Ino)
		}
		got, err := d.Refs().Get(ctx, fmt.Sprintf("trajectories/sb-%d", i))
		require.NoError(t, err)
		require.Equal(t, want, got, "ref %d", i)
	}
	assertNoTemps(t, d)
}

// Where link(2) fails as on a file system without hard links (or on a file
// with all the links it may have), every ref gets a file of its own and the
// batch succeeds; any other failure of link(2) fails the batch, leaving no
// ref set, no blob stored and nothing in tmp/.
func TestDirBatchWithoutLinks(t *testing.T) {
	for _, tc := range []struct {
		errno syscall.Errno
		ok    bool
	}{
		{syscall.EPERM, true},
		{syscall.EMLINK, true},
		{syscall.EXDEV, true},
		{syscall.ENOTSUP, true},
		{syscall.EIO, false},
	} {
		t.Run(tc.errno.Error(), func(t *testing.T) {
			root := t.TempDir()
			cmd := exec.Command(os.Args[0], "-test.run=^$", "-test.bench=^$")
			cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", linkErrnoEnv, tc.errno), linkDirEnv+"="+root)
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			require.NoError(t, err, "child: %s", stderr.Bytes())
			d, err := blobstore.NewDir(root)
			require.NoError(t, err)
			assertNoTemps(t, d)
			b := sharedBatch(5)
			if !tc.ok {
				assert.Contains(t, string(out), `write batch: set ref "trajectories/sb-1"`)
				assert.Contains(t, string(out), tc.errno.Error())
				list, err := d.Refs().List(context.Background(), "")
				require.NoError(t, err)
				assert.Empty(t, list, "refs set by a failed batch")
				assert.Empty(t, blobstoretest.WalkAll(t, d), "blobs stored by a failed batch")
				return
			}
			require.Equal(t, "ok\n", string(out))
			checkRefs(t, d, b)
			inodes := map[uint64]bool{}
			for _, ref := range b.Refs {
				st := stat(t, filepath.Join(root, "refs", filepath.FromSlash(ref.Name)))
				assert.Equal(t, uint64(1), uint64(st.Nlink), ref.Name)
				inodes[st.Ino] = true
			}
			assert.Len(t, inodes, len(b.Refs), "a file per ref")
		})
	}
}

func checkRefs(t *testing.T, d *blobstore.Dir, b blobstore.Batch) {
	t.Helper()
	for _, ref := range b.Refs {
		got, err := d.Refs().Get(context.Background(), ref.Name)
		require.NoError(t, err, ref.Name)
		require.Equal(t, ref.Digest, got, ref.Name)
	}
}
