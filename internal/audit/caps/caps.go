// Package caps decides which Linux capabilities a sandbox keeps and takes
// the rest away from the sandbox's init process for good.
//
// The agent runs as PID 1 of the sandbox and needs full privilege only while
// it sets up its mounts. Before it serves the first request it calls
// Restrict, so every command it later forks inherits a bounding set, a
// permitted/effective/inheritable set, an empty ambient set and the
// no_new_privs bit that no exec can widen again. Capabilities are per-thread
// kernel state and a Go program has many threads, so each step is applied to
// every thread with syscall.AllThreadsSyscall (which requires CGO off: the
// agent is built static with CGO_ENABLED=0).
package caps

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Set is a set of capabilities, bit n standing for capability number n
// (unix.CAP_CHOWN is bit 0). The kernel's capability space fits in 64 bits.
type Set uint64

// Of returns the set holding the given capability numbers (unix.CAP_*).
func Of(caps ...int) Set {
	var s Set
	for _, c := range caps {
		s = s.Add(c)
	}
	return s
}

// Has reports whether c is in s.
func (s Set) Has(c int) bool { return c >= 0 && c < 64 && s&(1<<uint(c)) != 0 }

// Add returns s with c added.
func (s Set) Add(c int) Set {
	if c < 0 || c >= 64 {
		return s
	}
	return s | 1<<uint(c)
}

// Without returns s with c removed.
func (s Set) Without(c int) Set {
	if c < 0 || c >= 64 {
		return s
	}
	return s &^ (1 << uint(c))
}

// Caps lists the capability numbers in s, lowest first.
func (s Set) Caps() []int {
	var out []int
	for c := 0; c < 64; c++ {
		if s.Has(c) {
			out = append(out, c)
		}
	}
	return out
}

// Names lists s as "CAP_..." names, lowest number first: the spelling
// Docker's seccomp profile uses in its capability conditions.
func (s Set) Names() []string {
	caps := s.Caps()
	out := make([]string, len(caps))
	for i, c := range caps {
		out[i] = Name(c)
	}
	return out
}

// String renders s as a comma-separated list of names.
func (s Set) String() string { return strings.Join(s.Names(), ",") }

// Name returns the kernel's name for capability c ("CAP_CHOWN"), or
// "CAP_<n>" for a number this package does not know.
func Name(c int) string {
	if n, ok := names[c]; ok {
		return n
	}
	return "CAP_" + strconv.Itoa(c)
}

// Parse turns names into a Set. Names are case-insensitive and the "CAP_"
// prefix is optional, as in Docker's --cap-add.
func Parse(list []string) (Set, error) {
	var s Set
	for _, n := range list {
		key := strings.ToUpper(strings.TrimSpace(n))
		if !strings.HasPrefix(key, "CAP_") {
			key = "CAP_" + key
		}
		c, ok := byName[key]
		if !ok {
			return 0, fmt.Errorf("caps: unknown capability %q", n)
		}
		s = s.Add(c)
	}
	return s, nil
}

var names = map[int]string{
	unix.CAP_CHOWN:              "CAP_CHOWN",
	unix.CAP_DAC_OVERRIDE:       "CAP_DAC_OVERRIDE",
	unix.CAP_DAC_READ_SEARCH:    "CAP_DAC_READ_SEARCH",
	unix.CAP_FOWNER:             "CAP_FOWNER",
	unix.CAP_FSETID:             "CAP_FSETID",
	unix.CAP_KILL:               "CAP_KILL",
	unix.CAP_SETGID:             "CAP_SETGID",
	unix.CAP_SETUID:             "CAP_SETUID",
	unix.CAP_SETPCAP:            "CAP_SETPCAP",
	unix.CAP_LINUX_IMMUTABLE:    "CAP_LINUX_IMMUTABLE",
	unix.CAP_NET_BIND_SERVICE:   "CAP_NET_BIND_SERVICE",
	unix.CAP_NET_BROADCAST:      "CAP_NET_BROADCAST",
	unix.CAP_NET_ADMIN:          "CAP_NET_ADMIN",
	unix.CAP_NET_RAW:            "CAP_NET_RAW",
	unix.CAP_IPC_LOCK:           "CAP_IPC_LOCK",
	unix.CAP_IPC_OWNER:          "CAP_IPC_OWNER",
	unix.CAP_SYS_MODULE:         "CAP_SYS_MODULE",
	unix.CAP_SYS_RAWIO:          "CAP_SYS_RAWIO",
	unix.CAP_SYS_CHROOT:         "CAP_SYS_CHROOT",
	unix.CAP_SYS_PTRACE:         "CAP_SYS_PTRACE",
	unix.CAP_SYS_PACCT:          "CAP_SYS_PACCT",
	unix.CAP_SYS_ADMIN:          "CAP_SYS_ADMIN",
	unix.CAP_SYS_BOOT:           "CAP_SYS_BOOT",
	unix.CAP_SYS_NICE:           "CAP_SYS_NICE",
	unix.CAP_SYS_RESOURCE:       "CAP_SYS_RESOURCE",
	unix.CAP_SYS_TIME:           "CAP_SYS_TIME",
	unix.CAP_SYS_TTY_CONFIG:     "CAP_SYS_TTY_CONFIG",
	unix.CAP_MKNOD:              "CAP_MKNOD",
	unix.CAP_LEASE:              "CAP_LEASE",
	unix.CAP_AUDIT_WRITE:        "CAP_AUDIT_WRITE",
	unix.CAP_AUDIT_CONTROL:      "CAP_AUDIT_CONTROL",
	unix.CAP_SETFCAP:            "CAP_SETFCAP",
	unix.CAP_MAC_OVERRIDE:       "CAP_MAC_OVERRIDE",
	unix.CAP_MAC_ADMIN:          "CAP_MAC_ADMIN",
	unix.CAP_SYSLOG:             "CAP_SYSLOG",
	unix.CAP_WAKE_ALARM:         "CAP_WAKE_ALARM",
	unix.CAP_BLOCK_SUSPEND:      "CAP_BLOCK_SUSPEND",
	unix.CAP_AUDIT_READ:         "CAP_AUDIT_READ",
	unix.CAP_PERFMON:            "CAP_PERFMON",
	unix.CAP_BPF:                "CAP_BPF",
	unix.CAP_CHECKPOINT_RESTORE: "CAP_CHECKPOINT_RESTORE",
}

var byName = func() map[string]int {
	m := make(map[string]int, len(names))
	for c, n := range names {
		m[n] = c
	}
	return m
}()

// DockerDefault is the set a sandbox keeps: Docker's default capability set
// without CAP_MKNOD. A sandbox's root filesystem is an overlay whose upper
// directory lives on the host disk; a device node created there (say the
// host's disk, major 8) would stay a working device on the host side and
// could be opened by anything that later reads that directory, so sandboxes
// must not create device nodes at all. Everything else matches Docker, so
// images that work under `docker run` work here.
func DockerDefault() Set {
	return Of(
		unix.CAP_CHOWN,
		unix.CAP_DAC_OVERRIDE,
		unix.CAP_FSETID,
		unix.CAP_FOWNER,
		unix.CAP_NET_RAW,
		unix.CAP_SETGID,
		unix.CAP_SETUID,
		unix.CAP_SETFCAP,
		unix.CAP_SETPCAP,
		unix.CAP_NET_BIND_SERVICE,
		unix.CAP_SYS_CHROOT,
		unix.CAP_KILL,
		unix.CAP_AUDIT_WRITE,
	)
}

var lastCap = sync.OnceValues(func() (int, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("caps: read last capability: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 || n > 63 {
		return 0, fmt.Errorf("caps: bad /proc/sys/kernel/cap_last_cap %q", b)
	}
	return n, nil
})

// LastCap returns the highest capability number the running kernel knows.
func LastCap() (int, error) { return lastCap() }

// ErrCgo is returned by Restrict in a binary built with cgo, where the Go
// runtime cannot apply a syscall to every thread (and threads started by C
// code would keep their privileges).
var ErrCgo = errors.New("caps: restricting all threads needs a binary built with CGO_ENABLED=0")

// allThreads runs a syscall on every thread of the process; the runtime
// panics if the threads disagree on the result, so a nil error means every
// thread made the same change.
func allThreads(what string, trap, a1, a2, a3 uintptr) error {
	_, _, e := syscall.AllThreadsSyscall(trap, a1, a2, a3)
	switch e {
	case 0:
		return nil
	case syscall.ENOTSUP:
		return fmt.Errorf("%s: %w", what, ErrCgo)
	default:
		return fmt.Errorf("caps: %s on all threads: %w", what, e)
	}
}

// Restrict leaves the calling process, on every thread, with exactly keep as
// its bounding, permitted, effective and inheritable sets, an empty ambient
// set and no_new_privs set. It must run while the process still holds
// CAP_SETPCAP (the agent calls it as full root, after its mounts). Call it
// before seccomp.Install: no_new_privs is what lets the filter be installed
// once CAP_SYS_ADMIN is gone.
//
// The order is forced by the kernel:
//
//  1. Bounding set first. PR_CAPBSET_DROP needs CAP_SETPCAP in the effective
//     set, which step 3 may take away; and step 3 may only set an inheritable
//     set that lies within the bounding set, which holds once this is done.
//     The bounding set is what caps a root process after exec, so this is the
//     step that keeps commands run as root inside the sandbox from getting
//     the dropped capabilities back.
//  2. Ambient set cleared. Ambient capabilities survive exec for non-root
//     programs; the kernel would drop those not in the new permitted and
//     inheritable sets anyway, but clearing them all says what we mean even
//     when keep would have allowed them.
//  3. capset (v3, both 32-bit halves): permitted = effective = inheritable =
//     keep. Lowering permitted is irreversible, so this comes after every step
//     that needs a capability we might drop.
//  4. no_new_privs last: it needs no privilege, and set-user-ID bits and file
//     capabilities stop granting anything on exec from here on.
func Restrict(keep Set) error {
	if err := dropBounding(keep, func(c int) error {
		return allThreads("drop "+Name(c)+" from bounding set", unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, uintptr(c), 0)
	}); err != nil {
		return err
	}
	return RestrictProcess(keep)
}

// DropBoundingThread drops every capability outside keep from the bounding
// set of the calling OS thread only. The agent calls it on the one locked
// thread every sandbox process is forked from, then RestrictProcess: the
// forked processes inherit exactly keep, and the agent's other threads,
// which never fork, get by with a reduced permitted set and no_new_privs
// (with no_new_privs, exec cannot grant capabilities beyond the permitted
// set, root or not). One prctl per capability on one thread is far cheaper
// than a stop-the-world round per capability on every thread.
func DropBoundingThread(keep Set) error {
	return dropBounding(keep, func(c int) error {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			return fmt.Errorf("caps: drop %s from bounding set: %w", Name(c), err)
		}
		return nil
	})
}

func dropBounding(keep Set, drop func(c int) error) error {
	last, err := LastCap()
	if err != nil {
		return err
	}
	known := Set(1<<uint(last+1) - 1)
	if unknown := keep &^ known; unknown != 0 {
		return fmt.Errorf("caps: keep set has capabilities %v unknown to this kernel (last is %d)", unknown.Caps(), last)
	}

	// Read the bounding set on this thread only: every thread has the same
	// one (they were all created by this process before any change), and
	// skipping caps already gone lets Restrict run twice, for instance after
	// CAP_SETPCAP itself was dropped.
	for c := 0; c <= last; c++ {
		if keep.Has(c) {
			continue
		}
		in, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, uintptr(c), 0, 0, 0)
		if err != nil {
			return fmt.Errorf("caps: read bounding set for %s: %w", Name(c), err)
		}
		if in == 0 {
			continue
		}
		if err := drop(c); err != nil {
			return err
		}
	}
	return nil
}

// RestrictProcess does steps 2-4 of Restrict (ambient set, capset,
// no_new_privs) on every thread, leaving bounding sets as they are.
func RestrictProcess(keep Set) error {
	if _, _, e := syscall.AllThreadsSyscall6(unix.SYS_PRCTL, unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0, 0); e != 0 {
		if e == syscall.ENOTSUP {
			return fmt.Errorf("clear ambient set: %w", ErrCgo)
		}
		return fmt.Errorf("caps: clear ambient set on all threads: %w", e)
	}

	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	lo, hi := uint32(keep), uint32(keep>>32)
	data := [2]unix.CapUserData{
		{Effective: lo, Permitted: lo, Inheritable: lo},
		{Effective: hi, Permitted: hi, Inheritable: hi},
	}
	err := allThreads("capset", unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0)
	runtime.KeepAlive(&hdr)
	runtime.KeepAlive(&data)
	if err != nil {
		return err
	}

	return allThreads("set no_new_privs", unix.SYS_PRCTL, unix.PR_SET_NO_NEW_PRIVS, 1, 0)
}
