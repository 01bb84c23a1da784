package agent

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestLookupUser(t *testing.T) {
	etc := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(etc, "passwd"), []byte(
		"# comment\n"+
			"root:x:0:0:root:/root:/bin/sh\n"+
			"alice:x:1234:1235:Alice:/home/alice:/bin/sh\n"+
			"short:x:77:78\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(etc, "group"), []byte(
		"alicegrp:x:1235:alice\n"+
			"dev:x:2000:bob, alice\n"+
			"ops:x:2001:alice\n"), 0o644))
	tests := []struct {
		spec    string
		want    identity
		wantErr string
	}{
		{spec: "alice", want: identity{uid: 1234, gid: 1235, groups: []uint32{2000, 2001}, home: "/home/alice"}},
		{spec: "1234", want: identity{uid: 1234, gid: 1235, groups: []uint32{2000, 2001}, home: "/home/alice"}},
		{spec: "alice:dev", want: identity{uid: 1234, gid: 2000, groups: []uint32{1235, 2001}, home: "/home/alice"}},
		{spec: "5:6", want: identity{uid: 5, gid: 6, groups: []uint32{}, home: "/"}},
		{spec: "short", want: identity{uid: 77, gid: 78, groups: []uint32{}, home: "/"}},
		{spec: "nobody-here", wantErr: `user "nobody-here" not found`},
		{spec: "alice:nogroup", wantErr: `group "nogroup" not found`},
		{spec: ":5", wantErr: "want name, uid"},
	}
	for _, tc := range tests {
		t.Run(tc.spec, func(t *testing.T) {
			id, err := lookupUser(etc, tc.spec)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, *id)
		})
	}
}

func TestMergeEnv(t *testing.T) {
	got := mergeEnv([]string{"A=1", "B=2", "PATH=/x"}, []string{"B=3", "C=4", "A=5"})
	assert.Equal(t, []string{"A=5", "B=3", "PATH=/x", "C=4"}, got)
	assert.Equal(t, "/x", envGet(got, "PATH"))
}

func TestHomeCache(t *testing.T) {
	etc := t.TempDir()
	passwd := filepath.Join(etc, "passwd")
	write := func(content string) {
		require.NoError(t, os.WriteFile(passwd, []byte(content), 0o644))
	}
	// settle makes the file's times more than a second old, so that its
	// answer is kept.
	settle := func() {
		old := time.Now().Add(-time.Minute)
		require.NoError(t, os.Chtimes(passwd, old, old))
		// Chtimes sets ctime to now: wait until it is old enough.
		time.Sleep(1100 * time.Millisecond)
	}
	var c homeCache
	write("root:x:0:0:root:/root:/bin/sh\nbob:x:7:7::/home/bob:/bin/sh\n")
	assert.Equal(t, "/root", c.get(etc, 0))
	assert.Equal(t, "/home/bob", c.get(etc, 7))
	assert.Equal(t, "/", c.get(etc, 8))

	// Kept while the file is unchanged and old enough...
	settle()
	assert.Equal(t, "/root", c.get(etc, 0))
	assert.True(t, c.ok)
	// ...and never trusted across a change: same size, in place...
	write("root:x:0:0:root:/ROOT:/bin/sh\nbob:x:7:7::/home/bob:/bin/sh\n")
	assert.Equal(t, "/ROOT", c.get(etc, 0))
	assert.False(t, c.ok, "an answer from a file changed within the last second was kept")
	// ...again within the same second (no answer was kept to go stale)...
	write("root:x:0:0:root:/RooT:/bin/sh\nbob:x:7:7::/home/bob:/bin/sh\n")
	assert.Equal(t, "/RooT", c.get(etc, 0))
	// ...or a new file renamed over it.
	settle()
	assert.Equal(t, "/RooT", c.get(etc, 0))
	tmp := filepath.Join(etc, "passwd.new")
	require.NoError(t, os.WriteFile(tmp, []byte("root:x:0:0:root:/r2:/bin/sh\n"), 0o644))
	require.NoError(t, os.Rename(tmp, passwd))
	assert.Equal(t, "/r2", c.get(etc, 0))
	// No file: "/" as homeOf says.
	require.NoError(t, os.Remove(passwd))
	assert.Equal(t, "/", c.get(etc, 0))
}
