package testsuite

import (
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func (s *suite) testRootfs(t *testing.T) {
	t.Run("base-layer-visible", s.testBaseLayer)
	t.Run("writes-stay-in-sandbox", s.testWritesPrivate)
	t.Run("scratch-dirs-writable", s.testScratchDirs)
	t.Run("devices", s.testDevices)
	t.Run("inode-numbers", s.testInodeNumbers)
}

func (s *suite) testBaseLayer(t *testing.T) {
	s.need(t, LayerRootfs)
	sb := s.create(t, nil)
	if got := s.sh(t, sb, "cat "+BaseMarkerPath); got != BaseMarkerContent {
		t.Errorf("%s inside the sandbox: %q, want %q (is the base layer from BusyboxRootfs?)", BaseMarkerPath, got, BaseMarkerContent)
	}
	data, err := sb.ReadFile(s.ctx(t), BaseMarkerPath, 1<<20)
	if err != nil || string(data) != BaseMarkerContent {
		t.Errorf("ReadFile(%s) = %q, %v; want %q", BaseMarkerPath, data, err, BaseMarkerContent)
	}
	s.sh(t, sb, `test -x /bin/busybox && test -x /bin/sh && test -x /bin/cat && grep -q '^nobody:' /etc/passwd`)
}

func (s *suite) testWritesPrivate(t *testing.T) {
	s.need(t, LayerRootfs)
	a := s.create(t, nil)
	// Modify a base file (copy-up), delete one (whiteout), add one.
	s.sh(t, a, `echo changed > `+BaseMarkerPath+` && rm /bin/true && echo new > /etc/dsec-new && mkdir /newdir`)
	if got := s.sh(t, a, `cat `+BaseMarkerPath+`; test -e /bin/true || echo true-gone; cat /etc/dsec-new; test -d /newdir && echo newdir`); got != "changed\ntrue-gone\nnew\nnewdir\n" {
		t.Fatalf("sandbox A does not see its own writes: %q", got)
	}
	// A second sandbox over the same layers sees the pristine image.
	b := s.create(t, nil)
	got := s.sh(t, b, `cat `+BaseMarkerPath+`; test -e /bin/true && echo true-here; test -e /etc/dsec-new && echo new-leaked; test -e /newdir && echo newdir-leaked; true`)
	if got != BaseMarkerContent+"true-here\n" {
		t.Errorf("sandbox B over the same layers sees A's changes: %q", got)
	}
}

func (s *suite) testScratchDirs(t *testing.T) {
	sb := s.create(t, nil)
	for _, dir := range []string{"/tmp", "/dev/shm"} {
		script := `d=` + dir + `; echo data > $d/probe && test "$(cat $d/probe)" = data && rm $d/probe`
		res := s.exec(t, sb, runtime.ExecRequest{Shell: script})
		if res.ExitCode != 0 {
			t.Errorf("%s is not writable: %s %s", dir, resultSummary(res), res.Stderr)
		}
	}
	// Sticky, world-writable /tmp, as programs expect.
	if got := strings.TrimSpace(s.sh(t, sb, `stat -c %a /tmp`)); got != "1777" {
		t.Errorf("/tmp mode inside the sandbox is %s, want 1777", got)
	}
}

func (s *suite) testDevices(t *testing.T) {
	sb := s.create(t, nil)
	script := `set -e
for d in null zero urandom; do test -c /dev/$d || { echo "/dev/$d is not a char device" >&2; exit 1; }; done
echo discard > /dev/null
test -z "$(cat /dev/null)"
head -c 4096 /dev/zero | od -An -v -tx1 | tr -d ' \n' | tr -d 0 | wc -c
head -c 64 /dev/urandom | od -An -v -tx1 | tr -d ' \n'; echo
head -c 64 /dev/urandom | od -An -v -tx1 | tr -d ' \n'; echo
test -d /dev/pts
echo devices-ok`
	out := strings.Split(strings.TrimSpace(s.sh(t, sb, script)), "\n")
	if len(out) != 4 || out[3] != "devices-ok" {
		t.Fatalf("device checks printed %q", out)
	}
	if strings.TrimSpace(out[0]) != "0" {
		t.Errorf("/dev/zero returned %s non-zero hex digits in 4096 bytes", out[0])
	}
	if len(out[1]) != 128 || len(out[2]) != 128 || out[1] == out[2] {
		t.Errorf("/dev/urandom reads: %q and %q; want two different 64-byte reads", out[1], out[2])
	}
}
