package container_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/testsuite"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// The probes are part of the image, so a test can run them without
// writing anything into the sandbox.
const (
	ipcProbe = "/probe/ipcprobe"
	fsProbe  = "/probe/fsprobe"
)

// newProbeEnv is newEnv whose layer also holds ipcprobe and fsprobe.
func newProbeEnv(t *testing.T) *env {
	t.Helper()
	testutil.RequireRoot(t)
	rootfs := testsuite.BusyboxRootfs(t)
	if err := os.Mkdir(filepath.Join(rootfs, "probe"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct{ pkg, dst string }{
		{"./internal/runtime/testsuite/internal/ipcprobe", ipcProbe},
		{"./internal/runtime/container/internal/fsprobe", fsProbe},
	} {
		b, err := os.ReadFile(testutil.BuildBinary(t, p.pkg))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(rootfs, p.dst), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return newEnvRootfs(t, 0, rootfs)
}

// stateScript fingerprints what a user of the sandbox can see of its
// writable state: every entry of the root file system and of /dev (with
// /dev/pts and /dev/shm) with name, link target, mode, type, owner, size,
// link count and device number; every regular file's content; user
// extended attributes of the entries the tests set them on; the mounts.
// Times are left out: a new root has new ones.
const stateScript = `set -e
find / -xdev \( -path /proc -o -path /sys -o -path /dev \) -prune -o -exec stat -c '%N %a %F %u %g %s %h' {} + | sort
find / -xdev \( -path /proc -o -path /sys -o -path /dev \) -prune -o -type f -exec md5sum {} + | sort
find /dev -exec stat -c '%N %a %F %u %g %s %h %t:%T' {} + | sort
` + fsProbe + ` getxattrs / /etc/passwd /dev /dev/shm /tmp
awk '{for(i=7;i<=NF;i++) if($i=="-"){print $5, $(i+1), $6; break}}' /proc/self/mountinfo | sort`

func sh(t *testing.T, sb rt.Sandbox, script string) string {
	t.Helper()
	res, err := sb.Exec(context.Background(), rt.ExecRequest{Shell: script}, nil)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec %q: %v, exit %d, stderr %q", script, err, res.ExitCode, res.Stderr)
	}
	return string(res.Stdout)
}

func reset(t *testing.T, sb rt.Sandbox) {
	t.Helper()
	if err := sb.(rt.Resetter).Reset(context.Background()); err != nil {
		t.Fatalf("Reset: %v", err)
	}
}

// settle waits until every entry of sb's pristine state last changed in
// a second before the current one (of the coarse clock file times come
// from), then resets sb. That Reset finds nothing changed and starts in a
// later second than any entry's ctime, so the next one reads no attribute
// and no directory but /dev/pts's (devpts, whose times tell nothing) and
// compares the rest by stat alone: the path Resets take once a sandbox has
// sat unchanged for a second, which the tests would otherwise only reach
// by chance. The wait is for the clock, the property under test, not for
// another component.
func settle(t *testing.T, sb rt.Sandbox) {
	t.Helper()
	newest, ok := container.PristineNewest(sb)
	if !ok {
		t.Fatal("the sandbox has no pristine state")
	}
	for {
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_REALTIME_COARSE, &ts); err != nil {
			t.Fatal(err)
		}
		if ts.Sec > newest {
			break
		}
		time.Sleep(time.Duration(1e9-ts.Nsec) + time.Millisecond) // into the next second
	}
	kept, rebuilt := container.ResetCounts(sb)
	reset(t, sb)
	if k, r := container.ResetCounts(sb); k != kept+1 || r != rebuilt {
		t.Fatalf("settling: a Reset with nothing changed built a new root (kept %d rebuilt %d, before %d and %d)", k, r, kept, rebuilt)
	}
	if got, want := container.PristineRecent(sb), []string{"pts", "pts/ptmx"}; !slices.Equal(got, want) {
		t.Fatalf("settled pristine state still reads %q in full; want only %q", got, want)
	}
}

// pristineModes are the two ways Reset compares a sandbox with its
// pristine state: with every entry read in full (attributes and directory
// names too, as a Reset within a second of the entries' last change does),
// and settled (see settle).
var pristineModes = []struct {
	name    string
	settled bool
}{{"recent", false}, {"settled", true}}

// prepare puts sb's pristine state in the mode's way of comparing.
func prepare(t *testing.T, sb rt.Sandbox, settled bool) {
	t.Helper()
	if settled {
		settle(t, sb)
	} else {
		container.PristineReadAll(sb)
	}
}

// TestResetKeepsUnchanged checks that a Reset after users who wrote
// nothing keeps the sandbox's root (same upper directory, no new root
// built), and that what it must still do it does: processes killed, IPC
// objects removed.
func TestResetKeepsUnchanged(t *testing.T) {
	e := newProbeEnv(t)
	for _, m := range pristineModes {
		t.Run(m.name, func(t *testing.T) { testResetKeepsUnchanged(t, e, m.settled) })
	}
}

func testResetKeepsUnchanged(t *testing.T, e *env, settled bool) {
	ctx := context.Background()
	sb := e.create(t)
	fresh := sh(t, sb, stateScript)
	upper := sb.(rt.Differ).UpperDir()
	var settling int64
	if settled {
		settle(t, sb)
		settling = 1
	}
	const none = "shm 0 sem 0 msg 0 mqueue 0\n"
	for i := 1; i <= 3; i++ {
		if !settled {
			container.PristineReadAll(sb)
		}
		// Reading, listing, running programs, processes left behind and
		// IPC objects write nothing to the file systems.
		sh(t, sb, `set -e
true
cat /etc/passwd /dev/null > /dev/null
ls -la / /dev /dev/shm /dev/pts /tmp /etc > /dev/null
echo discard > /dev/null
head -c 100 /dev/zero > /dev/null
setsid sleep 3801 >/dev/null 2>&1 &
sleep 3802 >/dev/null 2>&1 &
`+ipcProbe+` make`)
		if got := sh(t, sb, ipcProbe+" count"); got != "shm 1 sem 1 msg 1 mqueue 1\n" {
			t.Fatalf("IPC objects made: %q", got)
		}
		if _, err := sb.ReadFile(ctx, "/etc/passwd", 1<<20); err != nil {
			t.Fatal(err)
		}

		reset(t, sb)

		kept, rebuilt := container.ResetCounts(sb)
		if kept != int64(i)+settling || rebuilt != 0 {
			t.Fatalf("after %d unchanged cycles: %d resets kept the root, %d built a new one; want %d and 0", i, kept, rebuilt, int64(i)+settling)
		}
		if got := sb.(rt.Differ).UpperDir(); got != upper {
			t.Errorf("UpperDir changed from %s to %s across a Reset that kept the root", upper, got)
		}
		if got := sh(t, sb, `ps -o pid,args | grep -c 'sleep 380[1]' || true`); got != "0\n" {
			t.Errorf("processes survive a Reset that kept the root: %q", got)
		}
		if got := sh(t, sb, ipcProbe+" count"); got != none {
			t.Errorf("IPC objects survive a Reset that kept the root: %q", got)
		}
		if got := sh(t, sb, stateScript); got != fresh {
			t.Fatalf("state after a Reset that kept the root differs from the fresh sandbox's:\n%s", diff(fresh, got))
		}
	}
}

// TestResetRebuildsChanged checks that every kind of change a user can make
// to the sandbox's writable state makes Reset build a new root, and that
// the next user then sees the fresh sandbox's state; and that after a new
// root, a Reset with nothing changed keeps it again.
func TestResetRebuildsChanged(t *testing.T) {
	e := newProbeEnv(t)
	for _, m := range pristineModes {
		t.Run(m.name, func(t *testing.T) { testResetRebuildsChanged(t, e, m.settled) })
	}
}

func testResetRebuildsChanged(t *testing.T, e *env, settled bool) {
	ctx := context.Background()
	sb := e.create(t)
	fresh := sh(t, sb, stateScript)
	cases := []struct {
		name   string
		script string
		// api, if set, makes the change through the agent instead.
		api func() error
	}{
		{name: "file written and deleted in /tmp", script: `echo x > /tmp/f && rm /tmp/f`},
		{name: "directory made and removed in /", script: `mkdir /d && rmdir /d`},
		{name: "chmod of a lower file", script: `chmod 600 /etc/passwd`},
		{name: "chown of a lower file", script: `chown 65534:65534 /etc/group`},
		{name: "lower file deleted", script: `rm /etc/group`},
		{name: "hard link to a lower file", script: `ln /etc/passwd /tmp/pw`},
		{name: "xattr on a lower file", script: fsProbe + ` setxattr /etc/passwd user.dsec x`},
		{name: "xattr on /", script: fsProbe + ` setxattr / user.dsec y`},
		{name: "times of / set to what they were", script: fsProbe + ` touch-same /`},
		{name: "times of a lower file set to what they were", script: fsProbe + ` touch-same /etc/hosts`},
		{name: "utimes of /tmp", script: `touch -d '2001-02-03 04:05:06' /tmp`},
		{name: "file in /dev/shm", script: `echo x > /dev/shm/x`},
		{name: "file made and deleted in /dev/shm", script: `echo x > /dev/shm/y && rm /dev/shm/y`},
		{name: "xattr on /dev/shm", script: fsProbe + ` setxattr /dev/shm user.dsec z`},
		{name: "new file in /dev", script: `echo z > /dev/newfile`},
		{name: "symlink in /dev", script: `ln -s /etc /dev/etc`},
		{name: "device mode", script: `chmod 600 /dev/zero`},
		{name: "device deleted", script: `rm /dev/full`},
		{name: "times of /dev set to what they were", script: fsProbe + ` touch-same /dev`},
		{name: "ptmx mode", script: `chmod 600 /dev/pts/ptmx`},
		{name: "WriteFile", api: func() error { return sb.WriteFile(ctx, "/tmp/w", []byte("w"), 0o644) }},
	}
	var kept, rebuilt int64
	for _, c := range cases {
		prepare(t, sb, settled)
		if settled {
			kept++
		}
		before := sb.(rt.Differ).UpperDir()
		if c.api != nil {
			if err := c.api(); err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
		} else {
			sh(t, sb, c.script)
		}

		reset(t, sb)

		k, r := container.ResetCounts(sb)
		if k != kept || r != rebuilt+1 {
			t.Errorf("%s: Reset kept the root (counts kept %d rebuilt %d, before %d and %d)", c.name, k, r, kept, rebuilt)
		}
		kept, rebuilt = k, r
		if sb.(rt.Differ).UpperDir() == before {
			t.Errorf("%s: UpperDir is still %s after Reset", c.name, before)
		}
		if got := sh(t, sb, stateScript); got != fresh {
			t.Errorf("%s: state after Reset differs from the fresh sandbox's:\n%s", c.name, diff(fresh, got))
		}
		// The new root is pristine again: nothing written, root kept.
		reset(t, sb)
		k, r = container.ResetCounts(sb)
		if k != kept+1 || r != rebuilt {
			t.Errorf("%s: the Reset after the new root did not keep it (kept %d rebuilt %d, before %d and %d)", c.name, k, r, kept, rebuilt)
		}
		kept, rebuilt = k, r
	}
}

// diff shows the lines only in want (-) and only in got (+).
func diff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	in := func(l string, s []string) bool {
		for _, x := range s {
			if x == l {
				return true
			}
		}
		return false
	}
	var b strings.Builder
	for _, l := range w {
		if !in(l, g) {
			b.WriteString("  - " + l + "\n")
		}
	}
	for _, l := range g {
		if !in(l, w) {
			b.WriteString("  + " + l + "\n")
		}
	}
	return b.String()
}
