package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/spec"
)

// run executes dsecd's root command in-process and returns its stdout, its
// stderr and the exit code main would use.
func run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	root := newRoot()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err := root.ExecuteContext(t.Context())
	code := cli.Report(&errOut, cli.DaemonBinary, err)
	return out.String(), errOut.String(), code
}

// TestDaemonsListed checks that dsecd has every command dsec forwards, so
// that `dsec NAME` never reaches a dsecd without NAME.
func TestDaemonsListed(t *testing.T) {
	cmds := map[string]string{}
	for _, c := range newRoot().Commands() {
		cmds[c.Name()] = c.Short
	}
	for _, d := range cli.Daemons {
		short, ok := cmds[d.Name]
		if !ok {
			t.Errorf("dsecd has no %q command, but dsec hands %q to it", d.Name, d.Name)
			continue
		}
		if short != d.Short {
			t.Errorf("dsecd %s: Short %q, want cli.Daemons' %q", d.Name, short, d.Short)
		}
	}
}

func TestAutoPoolFlag(t *testing.T) {
	root := newRoot()
	for _, name := range []string{"up", "edge"} {
		c, _, err := root.Find([]string{name})
		if err != nil {
			t.Fatal(err)
		}
		f := c.Flags().Lookup("auto-pool")
		if f == nil {
			t.Errorf("dsecd %s has no --auto-pool", name)
			continue
		}
		if want := strconv.Itoa(edge.DefaultAutoPool); f.DefValue != want {
			t.Errorf("dsecd %s --auto-pool default %s, want edge.DefaultAutoPool (%s)", name, f.DefValue, want)
		}
		if !strings.Contains(f.Usage, "per hot spec") || !strings.Contains(f.Usage, "0 disables") {
			t.Errorf("dsecd %s --auto-pool help %q", name, f.Usage)
		}
	}
	if c, _, _ := root.Find([]string{"server"}); c.Flags().Lookup("auto-pool") != nil {
		t.Error("dsecd server has --auto-pool, but a server keeps no sandboxes")
	}
}

// TestBadEdgeFlagsRefusedFirst: a bad node flag is a usage error (exit 2)
// before the daemon makes its data dir or binds its port; client flags,
// which dsec hands over with the command, are accepted.
func TestBadEdgeFlagsRefusedFirst(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"up", "--auto-pool", "-1"}, "--auto-pool -1: must not be negative"},
		{[]string{"--token", "x", "up", "--auto-pool", "-2"}, "--auto-pool -2: must not be negative"},
		{[]string{"edge", "--server", "http://127.0.0.1:1", "--auto-pool", "-1"}, "--auto-pool -1"},
		{[]string{"up", "--fn-warm", "5", "--fn-max", "2"}, "want 0 <= fn-warm <= fn-max"},
		{[]string{"edge", "--server", "http://127.0.0.1:1", "--memory", "lots"}, "--memory \"lots\""},
		{[]string{"up", "--node-id", "Bad_ID"}, "--node-id"},
		{[]string{"up", "--default-cpu", "lots"}, "--default-cpu \"lots\""},
		{[]string{"edge", "--server", "http://127.0.0.1:1", "--default-pids", "-1"}, "--default-pids -1: must not be negative"},
		{[]string{"up", "--default-memory", "-1g"}, "--default-memory \"-1g\": must not be negative"},
		{[]string{"up", "--default-disk", "2048t"}, "defaults.disk_bytes"},
		{[]string{"up", "--max-import-size", "0"}, "--max-import-size 0: must be positive"},
		{[]string{"server", "--max-import-size", "big"}, "--max-import-size \"big\""},
		{[]string{"up", "--scratch-size", "10m"}, "--scratch-size 10m: at least 256 MiB, or off"},
		{[]string{"edge", "--server", "http://127.0.0.1:1", "--scratch-size", "big"}, "scratch-size"},
		{[]string{"up", "--swap", "1m"}, "--swap 1m: at least 16 MiB, or 0 for none"},
		{[]string{"edge", "--server", "http://127.0.0.1:1", "--swap", "big"}, "--swap \"big\""},
		{[]string{"up", "--store", "s3://bucket/prefix"}, "--s3-endpoint http[s]://HOST[:PORT]"},
		{[]string{"server", "--store", "s3://bucket", "--s3-endpoint", "bucket.example.com"}, "--s3-endpoint \"bucket.example.com\""},
		{[]string{"edge", "--server", "http://127.0.0.1:1", "--store", "s3:///nobucket", "--s3-endpoint", "http://127.0.0.1:1"}, "no bucket"},
		{[]string{"up", "--s3-endpoint", "http://127.0.0.1:1"}, "--s3-endpoint is for an s3:// --store"},
	} {
		data := filepath.Join(t.TempDir(), "data")
		args := append(tc.args, "--data-dir", data, "--listen", "127.0.0.1:0")
		_, errOut, code := run(t, args...)
		if code != cli.ExitUsage || !strings.Contains(errOut, "dsecd: ") || !strings.Contains(errOut, tc.want) {
			t.Errorf("dsecd %s: exit %d, stderr %q; want exit %d saying %q", strings.Join(tc.args, " "), code, errOut, cli.ExitUsage, tc.want)
		}
		if _, err := os.Stat(data); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("dsecd %s made its data dir (%v)", strings.Join(tc.args, " "), err)
		}
	}
}

// TestDefaultFlags: the node's --default-* flags parse as --cpu and
// --memory do and fill what they leave with the built-in defaults, which
// their help states.
func TestDefaultFlags(t *testing.T) {
	var f edgeFlags
	cmd := &cobra.Command{Use: "x"}
	f.register(cmd)
	if err := cmd.Flags().Parse([]string{"--default-cpu", "0.5", "--default-disk", "2g"}); err != nil {
		t.Fatal(err)
	}
	if err := f.validate(); err != nil {
		t.Fatal(err)
	}
	want := spec.Resources{MilliCPU: 500, MemoryBytes: spec.Builtin.MemoryBytes, Pids: spec.Builtin.Pids, DiskBytes: 2 << 30}
	if f.defaults != want {
		t.Fatalf("defaults %+v, want %+v", f.defaults, want)
	}
	for flag, def := range map[string]string{"default-cpu": "default 1)", "default-memory": "default 1GiB)", "default-pids": "default 1024)", "default-disk": "default 10GiB)"} {
		if u := cmd.Flags().Lookup(flag).Usage; !strings.Contains(u, def) {
			t.Errorf("--%s help %q does not say %q", flag, u, def)
		}
	}
}

// TestCloseOnExec: a descriptor dsecd inherited without close-on-exec (a
// supervisor's pipe) gets the flag at start, so no process dsecd starts,
// sandbox agents included, inherits it.
func TestCloseOnExec(t *testing.T) {
	var p [2]int
	if err := unix.Pipe2(p[:], 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	closeOnExec()
	for _, fd := range p {
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Errorf("fd %d: flags %#x, %v; want FD_CLOEXEC", fd, flags, err)
		}
	}
}
