package container_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/pool"
	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
)

// maxFDsPerSandbox is what a sandbox may hold open in the edge's process
// while it is idle, whatever state it waits in (the edge's capacity bound,
// internal/edge fdsPerSandbox, counts on it), and fdsShared what the
// backend may hold for all of them together (opened once, on first use).
const (
	maxFDsPerSandbox = 4
	fdsShared        = 4
)

// TestDescriptorsPerSandbox brings sandboxes into every state one can
// wait in and checks how many descriptors each adds to this process: the
// edge's open-file limit bounds how many sandboxes a node holds. The
// census of each state (what the descriptors name) is logged.
func TestDescriptorsPerSandbox(t *testing.T) {
	e := newProbeEnv(t)
	ctx := context.Background()
	const n = 6
	// What the backend opens once for all (its IPC thread, the runtime's
	// poller, ...) is open before the baseline.
	warmUp := e.create(t)
	sh(t, warmUp, "echo x > /tmp/x")
	if err := warmUp.(rt.Resetter).Reset(ctx); err != nil {
		t.Fatal(err)
	}
	container.WaitBackground(warmUp)
	if err := warmUp.Destroy(ctx); err != nil {
		t.Fatal(err)
	}

	// Each state: sandboxes made and brought into it by enter.
	for _, st := range []struct {
		name  string
		enter func(t *testing.T, sbs []rt.Sandbox)
	}{
		{"fresh", nil},
		{"idle after execs", func(t *testing.T, sbs []rt.Sandbox) {
			for _, sb := range sbs {
				sh(t, sb, "echo hi > /tmp/f && cat /tmp/f >/dev/null")
				sh(t, sb, "true")
			}
		}},
		{"reset, kept", func(t *testing.T, sbs []rt.Sandbox) {
			for _, sb := range sbs {
				sh(t, sb, "true")
				resetSettled(t, sb)
			}
		}},
		{"reset, new root", func(t *testing.T, sbs []rt.Sandbox) {
			for _, sb := range sbs {
				sh(t, sb, "echo x > /tmp/x && echo y > /dev/shm/y")
				resetSettled(t, sb)
				// Twice: the second Reset finds it unchanged and keeps it.
				resetSettled(t, sb)
			}
		}},
		{"reset after IPC objects", func(t *testing.T, sbs []rt.Sandbox) {
			for _, sb := range sbs {
				sh(t, sb, ipcProbe+" make")
				resetSettled(t, sb)
				if got := sh(t, sb, ipcProbe+" count"); got != "shm 0 sem 0 msg 0 mqueue 0\n" {
					t.Fatalf("IPC objects after Reset: %q", got)
				}
			}
		}},
		{"quiesced", func(t *testing.T, sbs []rt.Sandbox) {
			for _, sb := range sbs {
				sh(t, sb, "echo x > /tmp/x")
				if err := sb.(rt.Rebaser).Quiesce(ctx); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{"rebased", func(t *testing.T, sbs []rt.Sandbox) {
			for _, sb := range sbs {
				sh(t, sb, "echo x > /tmp/x")
				if err := sb.(rt.Rebaser).Quiesce(ctx); err != nil {
					t.Fatal(err)
				}
				if err := sb.(rt.Rebaser).Rebase(ctx, e.newSpec()); err != nil {
					t.Fatal(err)
				}
				container.WaitBackground(sb)
			}
		}},
		{"frozen", func(t *testing.T, sbs []rt.Sandbox) {
			for _, sb := range sbs {
				sh(t, sb, "true")
				resetSettled(t, sb)
				if err := sb.Freeze(ctx); err != nil {
					t.Fatal(err)
				}
			}
		}},
	} {
		t.Run(st.name, func(t *testing.T) {
			before := openFDs(t)
			sbs := make([]rt.Sandbox, n)
			for i := range sbs {
				sbs[i] = e.create(t)
			}
			if st.enter != nil {
				st.enter(t, sbs)
			}
			checkFDs(t, before, n)
			for _, sb := range sbs {
				if err := sb.Destroy(ctx); err != nil {
					t.Fatal(err)
				}
			}
			checkFDs(t, before, 0)
		})
	}

	t.Run("pooled", func(t *testing.T) {
		before := openFDs(t)
		p := pool.New(pool.Options{New: func(ctx context.Context) (rt.Sandbox, error) {
			return e.backend.Create(ctx, e.newSpec())
		}, Size: n})
		var sbs []rt.Sandbox
		for range n {
			sb, err := p.Take(ctx)
			if err != nil {
				t.Fatal(err)
			}
			sh(t, sb, "echo x > /tmp/x")
			sbs = append(sbs, sb)
		}
		for _, sb := range sbs {
			p.Put(sb)
		}
		waitFor(t, "the pool's resets", time.Minute, func() bool {
			s := p.Stats()
			return s.Ready == n && s.Resetting == 0 && s.Creating == 0
		})
		for _, sb := range sbs {
			container.WaitBackground(sb)
		}
		checkFDs(t, before, n)
		if err := p.Close(ctx); err != nil {
			t.Fatal(err)
		}
		checkFDs(t, before, 0)
	})

	t.Run("warm agents", func(t *testing.T) {
		before := openFDs(t)
		w := newEnv(t, n)
		waitFor(t, "the warm pool", time.Minute, func() bool { return container.WarmReady(w.backend) == n })
		// The second env's own (its scratch file system, layer cache).
		checkFDs(t, before, n)
		// A sandbox made from a warm agent and destroyed gives its
		// descriptors back.
		sb := w.create(t)
		sh(t, sb, "true")
		if err := sb.Destroy(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// resetSettled resets sb and waits for the background work its Reset
// left (the next root prepared, the old one removed).
func resetSettled(t *testing.T, sb rt.Sandbox) {
	t.Helper()
	reset(t, sb)
	container.WaitBackground(sb)
}

// checkFDs fails when this process holds more than maxFDsPerSandbox
// descriptors for each of n sandboxes (plus fdsShared) beyond those open
// before, and logs what the new ones name.
func checkFDs(t *testing.T, before map[int]string, n int) {
	t.Helper()
	now := openFDs(t)
	var added []string
	for fd, what := range now {
		if old, ok := before[fd]; !ok || old != what {
			added = append(added, what)
		}
	}
	grew := len(now) - len(before)
	census := map[string]int{}
	for _, a := range added {
		census[a]++
	}
	var lines []string
	for what, c := range census {
		lines = append(lines, fmt.Sprintf("%4d %s", c, what))
	}
	slices.Sort(lines)
	msg := fmt.Sprintf("%d sandboxes: %d descriptors more (%.1f each)\n%s", n, grew, float64(grew)/float64(max(n, 1)), strings.Join(lines, "\n"))
	if limit := maxFDsPerSandbox*n + fdsShared; grew > limit {
		t.Errorf("%s\nwant at most %d", msg, limit)
		return
	}
	t.Log(msg)
}

var (
	digits  = regexp.MustCompile(`[0-9]+`)
	slotDir = regexp.MustCompile(`/s[0-9]+-[0-9]+(/|$)`)
)

// openFDs lists this process's descriptors and what each names: readlink
// of /proc/self/fd/N with numbers blurred (PIDs, slots, inodes), and the
// file system type where the name alone does not say (a detached mount's
// is "/").
func openFDs(t *testing.T) map[int]string {
	t.Helper()
	d, err := os.Open("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		t.Fatal(err)
	}
	m := map[int]string{}
	for _, name := range names {
		fd, _ := strconv.Atoi(name)
		target, err := os.Readlink("/proc/self/fd/" + name)
		if err != nil {
			continue // the directory listing's own descriptor
		}
		what := slotDir.ReplaceAllString(target, "/SLOT$1")
		if strings.HasPrefix(what, "/proc/") || strings.Contains(what, ":[") || strings.Contains(what, "/SLOT") {
			what = digits.ReplaceAllString(what, "N")
		}
		var st unix.Statfs_t
		if unix.Statfs("/proc/self/fd/"+name, &st) == nil && !strings.HasPrefix(what, "/proc") && !strings.Contains(what, ":") {
			what += fmt.Sprintf(" (fs %#x)", st.Type)
		}
		m[fd] = what
	}
	return m
}
