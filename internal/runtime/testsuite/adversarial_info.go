package testsuite

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/testutil"
)

// Information a workload must not get about the host: firmware, kernel
// memory and its layout, the host's kernel command line, where the host
// keeps the sandbox (its layer and writable-layer paths, the platform's
// PID in them), the physical placement of its files on the host's disk.

func init() {
	adversarialCases = append(adversarialCases,
		advCase{"info/masked-paths", (*suite).testInfoMasked},
		advCase{"info/block-maps-denied", (*suite).testInfoBlockMaps},
		advCase{"info/mounts-show-no-host-paths", (*suite).testInfoMounts},
		advCase{"info/no-host-identity", (*suite).testInfoIdentity},
	)
}

// Masked paths: at least Docker's (moby's oci.DefaultSpec), and what else
// shows the host's kernel memory, physical addresses, firmware or command
// line to a sandbox's root. A path the kernel lacks passes.
var (
	maskedFiles = []string{
		"/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
		"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
		"/proc/cmdline", "/proc/slabinfo", "/proc/vmallocinfo",
		"/proc/kpagecount", "/proc/kpageflags", "/proc/kpagecgroup",
		"/sys/kernel/vmcoreinfo",
	}
	maskedDirs = []string{
		"/proc/acpi", "/proc/asound", "/proc/scsi",
		"/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/boot_params",
		"/sys/fs/btrfs",
	}
)

func (s *suite) testInfoMasked(t *testing.T) {
	s.need(t, HostKernel)
	sb := s.create(t, nil)
	// Each line: "PATH BYTES" for a file (what a read returns; -1 when it
	// cannot be read at all), "PATH ENTRIES" for a directory.
	var script strings.Builder
	for _, f := range maskedFiles {
		script.WriteString(`p=` + f + `; if [ -e $p ]; then n=$(head -c 4096 $p 2>/dev/null | wc -c) || n=-1; echo "$p $n"; fi` + "\n")
	}
	for _, d := range maskedDirs {
		script.WriteString(`p=` + d + `; if [ -e $p ]; then echo "$p $(ls -A $p 2>/dev/null | wc -l)"; fi` + "\n")
	}
	for _, line := range strings.Split(strings.TrimSpace(s.sh(t, sb, script.String())), "\n") {
		path, n, ok := strings.Cut(line, " ")
		if !ok {
			continue // nothing of the list exists
		}
		if n != "0" && n != "-1" {
			t.Errorf("%s is readable inside the sandbox (%s bytes or entries); it must be masked", path, n)
		}
	}
	// The kernel log is the host's: syslog(2) needs CAP_SYSLOG.
	res := s.exec(t, sb, runtime.ExecRequest{Shell: `dmesg 2>/dev/null | head -c 1000`})
	if len(res.Stdout) > 0 {
		t.Errorf("dmesg reads the host's kernel log inside the sandbox: %q", clip(res.Stdout))
	}
}

// infoProbe copies infoprobe into sb (at /tmp/infoprobe) and returns its
// path there.
func (s *suite) infoProbe(t *testing.T, sb runtime.Sandbox) string {
	t.Helper()
	bin, err := os.ReadFile(testutil.BuildBinary(t, "./internal/runtime/testsuite/internal/infoprobe"))
	if err != nil {
		t.Fatal(err)
	}
	const probe = "/tmp/infoprobe"
	if err := sb.WriteFile(s.ctx(t), probe, bin, 0o755); err != nil {
		t.Fatalf("WriteFile(%s): %v", probe, err)
	}
	return probe
}

// testInfoBlockMaps: FS_IOC_FIEMAP and its kin give a file's physical
// offsets on the device below it, the host's disk for a file the sandbox
// wrote; every one is refused with EPERM, for written and image files.
func (s *suite) testInfoBlockMaps(t *testing.T) {
	s.need(t, HostKernel)
	sb := s.create(t, nil)
	probe := s.infoProbe(t, sb)
	s.sh(t, sb, `head -c 65536 /dev/urandom > /tmp/blockmap-data && mkdir -p /root && cp /tmp/blockmap-data /root/data && sync`)
	out := s.sh(t, sb, probe+` blockmaps /tmp/blockmap-data /root/data /bin/busybox /etc/passwd`)
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		n++
		if !strings.HasSuffix(line, " EPERM") {
			t.Errorf("block-mapping ioctl not refused with EPERM: %s", line)
		}
	}
	if n == 0 {
		t.Fatal("infoprobe blockmaps printed nothing")
	}
}

// testInfoMounts: /proc/mounts and mountinfo show what each mount was made
// from, overlay's lower, upper and work directories included, as given.
// Those must not be host paths: no layer file or directory, no writable
// layer directory, no PID of the platform's (the test process stands for
// it), in a new sandbox and in one that Reset or Rebase gave a new root.
func (s *suite) testInfoMounts(t *testing.T) {
	s.need(t, HostKernel)
	spec := s.h.NewSpec(t)
	sb := s.createSpec(t, spec)
	host := hostStrings(t, sb, spec)
	check := func(when string) {
		t.Helper()
		// /proc/1's: what the agent (or a VM's init) sees, which a
		// workload may read too.
		res := s.exec(t, sb, runtime.ExecRequest{Shell: `cat /proc/mounts /proc/self/mountinfo; cat /proc/1/mountinfo 2>/dev/null; true`})
		requireExit(t, res, 0, "cat mounts")
		text := string(res.Stdout)
		if !strings.Contains(text, " / ") {
			t.Fatalf("%s: the mount listing has no root mount: %q", when, clip(res.Stdout))
		}
		for _, h := range host {
			if h.re.MatchString(text) {
				t.Errorf("%s: the sandbox's mount table names %s (%s):\n%s", when, h.what, h.re, linesMatching(text, h.re))
			}
		}
	}
	check("fresh sandbox")
	if _, ok := sb.(runtime.Resetter); ok {
		// A write makes Reset build a new root.
		s.sh(t, sb, `echo x > /etc/written`)
		s.reset(t, sb)
		check("after Reset")
	}
	if r, ok := sb.(runtime.Rebaser); ok {
		next := s.h.NewSpec(t)
		if err := r.Rebase(s.ctx(t), next); err != nil {
			t.Fatalf("Rebase: %v", err)
		}
		host = append(host, hostStrings(t, sb, next)...)
		check("after Rebase")
	}
}

type hostString struct {
	what string
	re   *regexp.Regexp
}

// hostStrings lists what of the host a sandbox of spec must not see: the
// platform's PID (as a whole number), its layer files, their directories
// and digests (layer caches name mount points after them), and the
// writable layer's directory and its parent (runtime.Differ).
func hostStrings(t *testing.T, sb runtime.Sandbox, spec runtime.Spec) []hostString {
	t.Helper()
	out := []hostString{{"the platform's PID", pidPattern()}}
	lit := func(what, s string) {
		if len(s) > 1 {
			out = append(out, hostString{what, regexp.MustCompile(regexp.QuoteMeta(s))})
		}
	}
	for _, l := range spec.Layers {
		lit("a layer file", l.Path)
		lit("a layer's directory", filepath.Dir(l.Path))
		if _, hex, ok := strings.Cut(l.Digest, ":"); ok {
			lit("a layer digest", hex)
		}
	}
	if d, ok := sb.(runtime.Differ); ok {
		lit("the writable layer", d.UpperDir())
		lit("the sandbox's state directory", filepath.Dir(d.UpperDir()))
	}
	return out
}

// pidPattern matches the test process's PID, which stands for the
// platform's, as a whole number.
func pidPattern() *regexp.Regexp {
	return regexp.MustCompile(`(^|[^0-9])` + strconv.Itoa(os.Getpid()) + `($|[^0-9])`)
}

func linesMatching(text string, re *regexp.Regexp) string {
	var b strings.Builder
	for _, l := range strings.Split(text, "\n") {
		if re.MatchString(l) {
			b.WriteString("  " + l + "\n")
		}
	}
	return b.String()
}

// testInfoIdentity: what a sandbox reads about its place on the host.
// /proc/self/cgroup shows the cgroup namespace's view, not the host's
// cgroup paths (which name the sandbox or the platform's PID); PID 1's
// environment is not the platform's.
func (s *suite) testInfoIdentity(t *testing.T) {
	s.need(t, HostKernel)
	sb := s.create(t, nil)
	pid := pidPattern()
	cg := s.sh(t, sb, `cat /proc/self/cgroup`)
	for _, line := range strings.Split(strings.TrimSpace(cg), "\n") {
		// "ID:controllers:path"
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			t.Fatalf("/proc/self/cgroup: bad line %q", line)
		}
		if strings.Contains(f[2], sb.ID()) || pid.MatchString(f[2]) {
			t.Errorf("/proc/self/cgroup shows a host cgroup path: %q", line)
		}
	}
	res := s.exec(t, sb, runtime.ExecRequest{Shell: `cat /proc/1/environ`})
	if res.ExitCode != 0 {
		return // unreadable: a non-dumpable PID 1
	}
	host := map[string]bool{}
	for _, kv := range os.Environ() {
		host[kv] = true
	}
	for _, kv := range strings.Split(string(res.Stdout), "\x00") {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "", "PATH", "HOME", "TERM", "LANG", "GOMAXPROCS":
			continue
		}
		if host[kv] {
			t.Errorf("PID 1's environment holds the platform's %s", k)
		}
	}
}
