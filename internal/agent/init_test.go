package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dsec-dev/dsec/internal/testutil"
)

// sampleInit has every field set, a layer of each kind of source.
func sampleInit() *Init {
	return &Init{
		Hostname:  "sb-1",
		Env:       []string{"A=1", "PATH=/bin"},
		Workdir:   "/work",
		User:      "1000:1000",
		Resources: &Resources{MilliCPU: 2000, MemoryBytes: 4 << 30, Pids: 512, DiskBytes: 10 << 30},
		Layers: []Source{
			{Path: "/var/lib/dsec/layers/aa"},
			{Block: &BlockDevice{Serial: "layer-bb"}, FSType: "erofs"},
			{Pmem: &PmemDevice{Index: 2, DAX: true}, FSType: "erofs"},
		},
		Writable: &Writable{Source: &Source{Block: &BlockDevice{Serial: "rw"}, FSType: "ext4"}, Upper: "upper", Work: "work"},
		Container: &ContainerInit{Rootfs: "/r", UserNS: true, Seccomp: []byte{1, 2, 3, 4, 5, 6, 7, 8}, Caps: 1<<21 | 1,
			NoLockdown: true, UserTasks: "/t", UserCgroupDir: "/d", UserMoreTasks: []string{"/m1", "/m2"}, CgroupFiles: []string{"/c"}},
	}
}

// acceptInit runs AcceptInit on the agent's end of a socket pair, then
// Serve on the same end, as dsec-agent does; it returns the client and a
// channel with AcceptInit's error and the Init setup saw.
func acceptInit(t *testing.T, setup func(*Init) (*InitResult, error)) (*Client, <-chan error, *Init) {
	t.Helper()
	a, e := socketPair(t)
	got := new(Init)
	initErr := make(chan error, 1)
	served := make(chan struct{})
	go func() {
		defer close(served)
		err := AcceptInit(a, func(in *Init) (*InitResult, error) {
			*got = *in
			return setup(in)
		})
		initErr <- err
		if err != nil {
			a.Close()
			return
		}
		Serve(context.Background(), a, Options{})
	}()
	c := NewClient(e)
	t.Cleanup(func() { c.Close(); <-served })
	return c, initErr, got
}

func TestInit(t *testing.T) {
	want := &InitResult{Container: &ContainerInitResult{MqueueFD: 7, CgroupFDs: []int32{9, 0, 11}}}
	c, initErr, got := acceptInit(t, func(*Init) (*InitResult, error) { return want, nil })
	sent := sampleInit()
	res, err := c.Init(context.Background(), sent)
	require.NoError(t, err)
	require.NoError(t, <-initErr)
	assert.Equal(t, sent, got, "the agent's setup saw another Init than the one sent")
	assert.Equal(t, want, res)
	// AcceptInit read exactly the one frame: the agent serves on.
	require.NoError(t, c.Ping(context.Background()))
	// A second Init is refused by the serving agent.
	_, err = c.Init(context.Background(), sent)
	var ae *Error
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, CodeFailedPrecondition, ae.Code)
}

func TestInitSetupFails(t *testing.T) {
	c, initErr, _ := acceptInit(t, func(in *Init) (*InitResult, error) {
		return nil, &fs.PathError{Op: "mount", Path: in.Container.Rootfs, Err: fs.ErrNotExist}
	})
	_, err := c.Init(context.Background(), sampleInit())
	var ae *Error
	require.ErrorAs(t, err, &ae, "the agent's reason reaches the backend")
	assert.Equal(t, CodeNotFound, ae.Code)
	assert.Contains(t, ae.Message, "mount /r")
	require.ErrorIs(t, <-initErr, fs.ErrNotExist, "AcceptInit returns setup's error for the agent to exit on")
	// The agent exits after a failed init: the connection ends.
	require.ErrorIs(t, c.Ping(context.Background()), ErrDisconnected)
}

func TestInitMustComeFirst(t *testing.T) {
	called := false
	c, initErr, _ := acceptInit(t, func(*Init) (*InitResult, error) { called = true; return nil, nil })
	err := c.Ping(context.Background())
	var ae *Error
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, CodeInvalidArgument, ae.Code)
	assert.Contains(t, ae.Message, "not init")
	require.Error(t, <-initErr)
	assert.False(t, called, "setup ran without an Init")
}

func TestInitValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Init)
		want string // "" for valid
	}{
		{"sample", func(*Init) {}, ""},
		{"paths only", func(in *Init) {
			in.Layers = []Source{{Path: "/l"}}
			in.Writable = &Writable{Source: &Source{Path: "/w"}, Upper: "u", Work: "w"}
		}, ""},
		{"no writable", func(in *Init) { in.Writable = nil }, ""},
		{"no layers", func(in *Init) { in.Layers = nil }, "layers: none"},
		{"empty source", func(in *Init) { in.Layers[1] = Source{FSType: "erofs"} }, "layers[1]: names no path"},
		{"two kinds", func(in *Init) { in.Layers[0].Pmem = &PmemDevice{} }, "layers[0]: names more than one"},
		{"device without fstype", func(in *Init) { in.Layers[2].FSType = "" }, "layers[2]: fstype"},
		{"block without serial", func(in *Init) { in.Layers[1].Block.Serial = "" }, "layers[1]: block.serial"},
		{"writable without source", func(in *Init) { in.Writable.Source = nil }, "writable.source: none"},
		{"writable bad source", func(in *Init) { in.Writable.Source = &Source{} }, "writable.source: names no path"},
		{"upper absolute", func(in *Init) { in.Writable.Upper = "/upper" }, "writable.upper"},
		{"work escapes", func(in *Init) { in.Writable.Work = "a/../../w" }, "writable.work"},
		{"upper empty", func(in *Init) { in.Writable.Upper = "" }, "writable.upper"},
		{"NUL in env", func(in *Init) { in.Env[1] = "A=\x00" }, "env[1]: contains a NUL"},
		{"NUL in user", func(in *Init) { in.User = "a\x00" }, "user: contains a NUL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := sampleInit()
			tc.edit(in)
			err := in.Validate()
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
			assert.True(t, errors.Is(err, fs.ErrInvalid), "%v is not an invalid argument", err)
		})
	}
}

// TestExecDefaultUser: Options.User (Init's user) applies to an exec that
// names none, and a request's own user overrides it.
func TestExecDefaultUser(t *testing.T) {
	testutil.RequireRoot(t)
	etc := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(etc, "passwd"), []byte(
		"root:x:0:0:root:/root:/bin/sh\nalice:x:1234:1235:Alice:/home/alice:/bin/sh\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(etc, "group"), []byte("root:x:0:\n"), 0o644))
	c := startAgent(t, Options{EtcDir: etc, User: "alice", Env: []string{"X=default"}, Workdir: "/tmp"})
	for _, tc := range []struct{ user, want string }{{"", "1234 default /tmp"}, {"root", "0 default /tmp"}} {
		res, err := c.Exec(context.Background(), ExecRequest{Shell: `echo $(id -u) $X $(pwd)`, User: tc.user}, nil)
		require.NoError(t, err)
		require.Equal(t, 0, res.ExitCode, "stderr: %s", res.Stderr)
		assert.Equal(t, tc.want, strings.TrimSpace(string(res.Stdout)), "user %q", tc.user)
	}
}

// BenchmarkInitCodec is the configuration exchange of a container create
// in isolation: encode the Init frame on the edge, decode it in the agent.
// "json" is what the exchange cost when the configuration went as JSON
// (the same fields, sandboxinit's former message), for comparison.
func BenchmarkInitCodec(b *testing.B) {
	in := sampleInit()
	in.Container.Seccomp = make([]byte, 8*400) // a compiled filter's size
	in.Layers = []Source{{Path: "/var/lib/dsec/layers/sha256-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}}
	in.Writable = &Writable{Source: &Source{Path: "/var/lib/dsec/state/s123-45"}, Upper: "upper", Work: "work"}
	f := &frame{stream: 1, request: &request{init: in}}
	b.Run("proto", func(b *testing.B) {
		var buf []byte
		for b.Loop() {
			buf = appendFrame(buf[:0], f)
			if _, err := unmarshalFrame(buf); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(len(buf)), "bytes")
	})
	b.Run("json", func(b *testing.B) {
		type config struct {
			Lower         []string `json:"lower"`
			Upper         string   `json:"upper"`
			Work          string   `json:"work"`
			Rootfs        string   `json:"rootfs"`
			Hostname      string   `json:"hostname"`
			UserNS        bool     `json:"userns,omitempty"`
			Seccomp       []byte   `json:"seccomp,omitempty"`
			Caps          []int    `json:"caps,omitempty"`
			NoLockdown    bool     `json:"no_lockdown,omitempty"`
			UserTasks     string   `json:"user_tasks,omitempty"`
			UserCgroupDir string   `json:"user_cgroup_dir,omitempty"`
			UserMoreTasks []string `json:"user_more_tasks,omitempty"`
			CgroupFiles   []string `json:"cgroup_files,omitempty"`
		}
		c := config{Lower: []string{in.Layers[0].Path}, Upper: "/var/lib/dsec/state/s123-45/upper", Work: "/var/lib/dsec/state/s123-45/work",
			Rootfs: in.Container.Rootfs, Hostname: in.Hostname, Seccomp: in.Container.Seccomp, Caps: make([]int, 14),
			UserTasks: in.Container.UserTasks, UserMoreTasks: in.Container.UserMoreTasks, CgroupFiles: in.Container.CgroupFiles}
		var n int
		for b.Loop() {
			buf, err := json.Marshal(c)
			if err != nil {
				b.Fatal(err)
			}
			var back config
			if err := json.Unmarshal(buf, &back); err != nil {
				b.Fatal(err)
			}
			n = len(buf)
		}
		b.ReportMetric(float64(n), "bytes")
	})
}
