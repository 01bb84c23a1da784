package testsuite

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/testutil"
)

func TestBusyboxRootfs(t *testing.T) {
	root := BusyboxRootfs(t)
	for _, p := range []string{"bin/busybox", "bin/sh", "bin/cat", "usr/bin/awk", "bin/sleep", "usr/bin/nc"} {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Errorf("rootfs lacks %s: %v", p, err)
		}
	}
	if target, err := os.Readlink(filepath.Join(root, "bin/sh")); err != nil || target != "/bin/busybox" {
		t.Errorf("bin/sh -> %q, %v; want /bin/busybox", target, err)
	}
	st, err := os.Stat(filepath.Join(root, "tmp"))
	if err != nil || st.Mode()&os.ModeSticky == 0 || st.Mode().Perm() != 0o777 {
		t.Errorf("tmp mode %v, %v; want sticky 0777", st.Mode(), err)
	}

	// The rootfs really runs the suite's tools: a chrooted shell finds its
	// applets, the marker and the users.
	testutil.RequireRoot(t)
	out, err := exec.Command("chroot", root, "/bin/sh", "-c",
		`echo $((6*7)); cat `+BaseMarkerPath+`; grep -c . /etc/passwd; awk 'BEGIN{print "awk"}'`).CombinedOutput()
	if err != nil {
		t.Fatalf("chroot %s: %v\n%s", root, err, out)
	}
	if want := "42\n" + BaseMarkerContent + "2\nawk\n"; string(out) != want {
		t.Errorf("chrooted shell printed %q, want %q", out, want)
	}
}

func TestParseStat(t *testing.T) {
	// A comm with spaces and a parenthesis must not shift the fields.
	line := "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 5 0 0 20 0 1 0 12345 1000 10 0 0 0"
	cpu, start, err := parseStat(line)
	if err != nil || cpu != 12 || start != 12345 {
		t.Errorf("parseStat = %d, %d, %v; want 12, 12345", cpu, start, err)
	}
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	if _, start, err := parseStat(string(b)); err != nil || start == 0 {
		t.Errorf("parseStat(/proc/self/stat) start %d, %v", start, err)
	}
	if _, _, err := parseStat("12 (x) S 1"); err == nil {
		t.Error("parseStat of a short line succeeded")
	}
}

func TestSeqOutputMatchesBusybox(t *testing.T) {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox not installed")
	}
	out, err := exec.Command(bb, "seq", "1", "12345").Output()
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != string(seqOutput(12345)) {
		t.Error("seqOutput differs from busybox seq")
	}
}

func TestExtraIsMultisetDifference(t *testing.T) {
	got := extra([]string{"a", "b", "b", "c", "d"}, []string{"b", "a", "c", "x"})
	if !slices.Equal(got, []string{"b", "d"}) {
		t.Errorf("extra = %v, want [b d]", got)
	}
	s := Snapshot{Mounts: []string{"m1", "m1"}, FDs: []string{"3 -> x"}}
	leaked := s.Leaked(Snapshot{Mounts: []string{"m1"}})
	if !slices.Equal(leaked, []string{"mount: m1", "fd: 3 -> x"}) {
		t.Errorf("Leaked = %v", leaked)
	}
}

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{
		`/a\040b`:  "/a b",
		`/plain`:   "/plain",
		`/tab\011`: "/tab\t",
		`/end\04`:  `/end\04`,
	} {
		if got := unescapeMount(in); got != want {
			t.Errorf("unescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestHostSnapshotSeesEachKind leaks one of each resource for real and
// checks that the snapshot reports it, then that undoing it clears the report.
func TestHostSnapshotSeesEachKind(t *testing.T) {
	testutil.RequireRoot(t)
	state := t.TempDir()
	cgRoot := filepath.Join("/sys/fs/cgroup/pids", "dsec-testsuite-"+filepath.Base(state))
	if err := os.Mkdir(cgRoot, 0o755); err != nil {
		t.Skipf("no writable pids cgroup hierarchy: %v", err)
	}
	t.Cleanup(func() { os.Remove(cgRoot) })

	before, err := HostSnapshot([]string{cgRoot}, []string{state})
	if err != nil {
		t.Fatal(err)
	}

	// One of each.
	mnt := filepath.Join(state, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("dsec-suite", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	mounted := true
	t.Cleanup(func() {
		if mounted {
			unix.Unmount(mnt, unix.MNT_DETACH)
		}
	})
	// A file inside the mount is on another file system and not listed.
	if err := os.WriteFile(filepath.Join(mnt, "inside"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	child := filepath.Join(cgRoot, "sandbox")
	if err := os.Mkdir(child, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(child) })
	sleep := exec.Command("sleep", "3700")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	waited := false
	t.Cleanup(func() {
		if !waited {
			sleep.Process.Kill()
			sleep.Wait()
		}
	})
	f, err := os.Open(state)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })

	after, err := HostSnapshot([]string{cgRoot}, []string{state})
	if err != nil {
		t.Fatal(err)
	}
	leaked := strings.Join(after.Leaked(before), "\n")
	for _, want := range []string{
		"mount: " + mnt + " tmpfs dsec-suite",
		"cgroup: " + child,
		"file: " + mnt,
		"process: sleep pid=",
		"fd: ",
	} {
		if !strings.Contains(leaked, want) {
			t.Errorf("leak report lacks %q:\n%s", want, leaked)
		}
	}
	if strings.Contains(leaked, "inside") {
		t.Errorf("leak report descends into another file system:\n%s", leaked)
	}

	// Undo everything: the report is empty again.
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	mounted = false
	os.Remove(mnt)
	os.Remove(child)
	sleep.Process.Kill()
	sleep.Wait()
	waited = true
	f.Close()
	again, err := HostSnapshot([]string{cgRoot}, []string{state})
	if err != nil {
		t.Fatal(err)
	}
	if l := again.Leaked(before); len(l) > 0 {
		t.Errorf("after undoing everything, still reported: %v", l)
	}
}
