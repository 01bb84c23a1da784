package e2e

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/trajectory"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// TestTrajectory checks the trajectory log end to end through the CLI:
// fast-forward of a non-idempotent command, export and verify (and an
// edited export failing verify at the edited record), deterministic replay
// and its divergence report, and `sandbox log`.
func TestTrajectory(t *testing.T) {
	bins := build(t)
	c, _ := startUp(t, bins)
	c.ok(t, "image", "import", "busybox:latest", busyboxRootfs(t))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cl := dsec.New(c.endpoint, c.token)
	spec := dsec.Spec{Image: "busybox:latest"}

	t.Run("fast-forward", func(t *testing.T) {
		id := c.ok(t, "sandbox", "create", "--image", "busybox:latest")
		defer cl.Destroy(context.WithoutCancel(ctx), id)
		// Not idempotent: every run appends a line.
		appendAndCount := []string{"sandbox", "exec", "--seq", "1", id, "--", "sh", "-c", "echo x >> /tmp/f; wc -l < /tmp/f"}
		for i := 1; i <= 3; i++ {
			r := c.run(t, nil, appendAndCount...)
			if r.code != 0 || strings.TrimSpace(r.stdout) != "1" {
				t.Fatalf("exec --seq 1, sent %d time(s): %+v; want exit 0 and output 1", i, r)
			}
			replayed := strings.Contains(r.stderr, "dsec: seq 1 replayed from the trajectory")
			if replayed != (i > 1) {
				t.Fatalf("exec --seq 1, sent %d time(s): stderr %q; want the replayed note exactly on re-sends", i, r.stderr)
			}
		}
		// The append ran once.
		if got := c.ok(t, "sandbox", "exec", id, "--", "sh", "-c", "wc -l < /tmp/f"); got != "1" {
			t.Fatalf("lines in /tmp/f after three sends of seq 1: %s, want 1", got)
		}
		tr, err := cl.Trajectory(ctx, id, false)
		if err != nil {
			t.Fatal(err)
		}
		if n := countKind(t, tr.Records, trajectory.KindExec); n != 2 || tr.NextSeq != 3 {
			t.Fatalf("trajectory has %d exec records and expects seq %d next; want 2 and 3:\n%s", n, tr.NextSeq, strings.Join(tr.Records, "\n"))
		}
		// A recorded number re-sent with another command is refused, and so
		// is a number beyond the next expected one (at once, naming it).
		if r := c.run(t, nil, "sandbox", "exec", "--seq", "1", id, "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "different request") {
			t.Fatalf("exec --seq 1 with another command: %+v; want exit 125 naming the mismatch", r)
		}
		if r := c.run(t, nil, "sandbox", "exec", "--seq", "9", id, "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "expects step 3") {
			t.Fatalf("exec --seq 9 with seq 3 expected: %+v; want exit 125 naming step 3", r)
		}
		if r := c.run(t, nil, "sandbox", "exec", "--seq", "0", id, "--", "true"); r.code != 2 {
			t.Fatalf("exec --seq 0: %+v; want a usage error", r)
		}
	})

	t.Run("export-verify", func(t *testing.T) {
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Destroy(context.WithoutCancel(ctx))
		for _, script := range []string{"echo hello", "echo failing; exit 3", "echo world"} {
			if _, err := sb.Exec(ctx, "sh", "-c", script); err != nil {
				t.Fatal(err)
			}
		}
		export := c.ok(t, "trajectory", "export", sb.ID) + "\n"
		lines := strings.Split(strings.TrimSuffix(export, "\n"), "\n")
		if len(lines) != 4 {
			t.Fatalf("export has %d lines, want 4 (create and 3 execs):\n%s", len(lines), export)
		}
		dir := t.TempDir()
		file := filepath.Join(dir, "traj.jsonl")
		writeFile(t, file, export)
		if got := c.ok(t, "trajectory", "verify", file); got != "ok: 4 records" {
			t.Fatalf("verify FILE printed %q", got)
		}
		if got := c.ok(t, "trajectory", "verify", sb.ID); got != "ok: 4 records" {
			t.Fatalf("verify ID printed %q", got)
		}

		// Each edit must fail verify naming the record (its line and seq).
		failed := lineOfSeq(t, lines, 2)
		world := lineOfSeq(t, lines, 3)
		edits := []struct {
			name     string
			line     int // 0-based index of the record to change
			edit     func(string) string
			wantLine int
			wantSeq  uint64
			reason   string
		}{
			{"exit code", failed, func(l string) string { return mustReplace(t, l, `"exit_code":3`, `"exit_code":0`) },
				failed + 1, 2, "does not match its content"},
			{"stdout bytes", world, func(l string) string {
				return mustReplace(t, l, b64("world\n"), b64("WORLD\n"))
			}, world + 1, 3, "inline data does not match"},
			// A forger who also fixes the edited record's hash breaks the
			// chain at the next record.
			{"exit code with its hash recomputed", failed, func(l string) string {
				rec, err := trajectory.Parse([]byte(mustReplace(t, l, `"exit_code":3`, `"exit_code":0`)))
				if err != nil {
					t.Fatal(err)
				}
				if rec.Hash, err = rec.ComputeHash(); err != nil {
					t.Fatal(err)
				}
				b, err := rec.Marshal()
				if err != nil {
					t.Fatal(err)
				}
				return string(b)
			}, world + 1, 3, "hash chain broken"},
			{"record deleted", failed, func(string) string { return "" }, failed + 1, 3, "hash chain broken"},
		}
		for i, e := range edits {
			edited := append([]string(nil), lines...)
			if s := e.edit(edited[e.line]); s == "" {
				edited = append(edited[:e.line], edited[e.line+1:]...)
			} else {
				edited[e.line] = s
			}
			f := filepath.Join(dir, fmt.Sprintf("edited-%d.jsonl", i))
			writeFile(t, f, strings.Join(edited, "\n")+"\n")
			r := c.run(t, nil, "trajectory", "verify", f)
			want := fmt.Sprintf("line %d (sandbox %s, seq %d)", e.wantLine, sb.ID, e.wantSeq)
			if r.code != 1 || !strings.Contains(r.stderr, want) || !strings.Contains(r.stderr, e.reason) {
				t.Errorf("verify after editing the %s: %+v; want exit 1 naming %q (%s)", e.name, r, want, e.reason)
			}
			if r.stdout != "" {
				t.Errorf("verify of a broken trajectory printed %q on stdout", r.stdout)
			}
		}
		// A replay refuses a broken trajectory, naming the record.
		if r := c.run(t, nil, "replay", filepath.Join(dir, "edited-0.jsonl")); r.code != 1 || !strings.Contains(r.stderr, "refusing to replay") || !strings.Contains(r.stderr, "seq 2") {
			t.Errorf("replay of an edited trajectory: %+v; want a refusal naming seq 2", r)
		}
		if r := c.run(t, nil, "trajectory", "verify", filepath.Join(dir, "nosuch.jsonl")); r.code != 2 {
			t.Errorf("verify of a missing file: %+v; want a usage error", r)
		}
	})

	t.Run("replay", func(t *testing.T) {
		// A deterministic script touching every replayed kind of record:
		// writes (one too large to keep inline), reads (one failing),
		// execs with argv, shell, stdin and a non-zero exit, and a reward.
		det, err := cl.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		big := bytes.Repeat([]byte("0123456789abcdef"), 1024)
		steps := []func() error{
			func() error { return det.WriteFile(ctx, "/tmp/a.txt", []byte("hello file\n"), 0o600) },
			func() error { _, err := det.Exec(ctx, "cat", "/tmp/a.txt"); return err },
			func() error { _, err := det.ExecShell(ctx, "echo hello"); return err },
			func() error { _, err := det.Exec(ctx, "ls", "/"); return err },
			func() error { return det.WriteFile(ctx, "/tmp/big", big, 0) },
			func() error { _, err := det.Exec(ctx, "md5sum", "/tmp/big"); return err },
			func() error { _, err := det.ReadFile(ctx, "/tmp/a.txt", 0); return err },
			func() error {
				if _, err := det.ReadFile(ctx, "/nonexistent", 0); err == nil {
					return fmt.Errorf("read of a missing file succeeded")
				}
				return nil
			},
			func() error {
				res, err := det.ExecWith(ctx, dsec.ExecOptions{Shell: "cat; echo to-stderr >&2; exit 2", Stdin: []byte("from stdin\n"), Cwd: "/tmp"})
				if err == nil && (res.ExitCode != 2 || string(res.Stdout) != "from stdin\n") {
					return fmt.Errorf("exec with stdin: %+v", res)
				}
				return err
			},
			func() error { _, err := det.SubmitReward(ctx, 1, map[string]string{"pass": "yes"}); return err },
		}
		for i, step := range steps {
			if err := step(); err != nil {
				t.Fatalf("step %d: %v", i+1, err)
			}
		}
		if err := det.Destroy(ctx); err != nil {
			t.Fatal(err)
		}
		r := c.run(t, nil, "replay", det.ID)
		t.Logf("dsec replay %s (deterministic):\n%s%s", det.ID, r.stdout, r.stderr)
		if r.code != 0 || strings.Contains(r.stdout, "DIVERGED") {
			t.Fatalf("replay of a deterministic script: exit %d\n%s%s", r.code, r.stdout, r.stderr)
		}
		for _, want := range []string{
			"step 0 create busybox:latest: same",
			"step 2 exec `cat /tmp/a.txt`: same",
			"step 8 read_file /nonexistent: same",
			"step 9 exec `cat; echo to-stderr >&2; exit 2`: same",
			"10 steps: 10 same, 0 diverged, 0 skipped",
		} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("replay report lacks %q:\n%s", want, r.stdout)
			}
		}
		if strings.Contains(r.stdout, "reward") {
			t.Errorf("replay re-ran the reward:\n%s", r.stdout)
		}

		// From an exported file (the large write's data inlined) too.
		dir := t.TempDir()
		file := filepath.Join(dir, "det.jsonl")
		writeFile(t, file, c.ok(t, "trajectory", "export", det.ID)+"\n")
		if r := c.run(t, nil, "replay", file); r.code != 0 || !strings.Contains(r.stdout, "10 same, 0 diverged") {
			t.Fatalf("replay of the exported file: %+v", r)
		}
		// Records without their data (as `sandbox log --json` prints them)
		// cannot be replayed: the large write's data is not inline.
		bare := filepath.Join(dir, "bare.jsonl")
		writeFile(t, bare, c.ok(t, "sandbox", "log", "--json", det.ID)+"\n")
		if got := c.ok(t, "trajectory", "verify", bare); got != "ok: 12 records" {
			t.Fatalf("verify of records without data printed %q", got)
		}
		if r := c.run(t, nil, "replay", bare); r.code != 1 || !strings.Contains(r.stderr, "seq 5") || !strings.Contains(r.stderr, "lacks its data") {
			t.Fatalf("replay of records without data: %+v; want a refusal naming seq 5", r)
		}

		// A script that reads random bytes diverges at that step only.
		rnd, err := cl.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		defer rnd.Destroy(context.WithoutCancel(ctx))
		for _, script := range []string{"echo start", "head -c 16 /dev/urandom | od -x", "echo end"} {
			if _, err := rnd.ExecShell(ctx, script); err != nil {
				t.Fatal(err)
			}
		}
		r = c.run(t, nil, "replay", rnd.ID)
		t.Logf("dsec replay %s (random):\n%s%s", rnd.ID, r.stdout, r.stderr)
		if r.code != 1 {
			t.Fatalf("replay of a random script: exit %d, want 1\n%s%s", r.code, r.stdout, r.stderr)
		}
		for _, want := range []string{
			"step 1 exec `echo start`: same",
			"step 2 exec `head -c 16 /dev/urandom | od -x`: DIVERGED: stdout differs (recorded sha256:",
			"step 3 exec `echo end`: same",
			"4 steps: 3 same, 1 diverged, 0 skipped",
		} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("replay report lacks %q:\n%s", want, r.stdout)
			}
		}
		if !strings.Contains(r.stderr, "diverged at seq 2") {
			t.Errorf("replay's error does not name seq 2: %q", r.stderr)
		}

		// Every replay sandbox is gone.
		list, err := cl.List(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, sb := range list {
			if _, ok := sb.Spec.Labels["dsec.replay-of"]; ok {
				t.Errorf("replay sandbox %s left %s", sb.ID, sb.State)
			}
		}
	})

	t.Run("log", func(t *testing.T) {
		sb, err := cl.Create(ctx, dsec.Spec{Image: "busybox:latest", Resources: dsec.Resources{MilliCPU: 500, MemoryBytes: 128 << 20}})
		if err != nil {
			t.Fatal(err)
		}
		if len(sb.Layers) == 0 {
			t.Fatal("the sandbox has no layers")
		}
		if err := sb.WriteFile(ctx, "/tmp/notes", []byte("step one\n"), 0); err != nil {
			t.Fatal(err)
		}
		if _, err := sb.ExecShell(ctx, "cat /tmp/notes; exit 4"); err != nil {
			t.Fatal(err)
		}
		if _, err := sb.SubmitReward(ctx, 0.25, nil); err != nil {
			t.Fatal(err)
		}
		if err := sb.Destroy(ctx); err != nil {
			t.Fatal(err)
		}

		table := c.ok(t, "sandbox", "log", sb.ID)
		t.Logf("dsec sandbox log %s:\n%s", sb.ID, table)
		rows := strings.Split(table, "\n")
		if len(rows) != 6 || !strings.HasPrefix(rows[0], "SEQ") {
			t.Fatalf("sandbox log printed %d lines, want a header and 5 records:\n%s", len(rows), table)
		}
		for i, want := range [][]string{
			{"0", "create", "busybox:latest", "(container, 1 layer)"},
			{"1", "write_file", "/tmp/notes", "9B"},
			{"2", "exec", "`cat /tmp/notes; exit 4`", "exit 4", "stdout 9B"},
			{"3", "reward", "0.25"},
			{"3", "destroy"}, // an event: the seq of the step it follows
		} {
			fields := strings.Fields(rows[i+1])
			if len(fields) < 2 || fields[0] != want[0] || fields[1] != want[1] {
				t.Errorf("log row %d = %q, want seq %s kind %s", i+1, rows[i+1], want[0], want[1])
			}
			for _, w := range want[2:] {
				if !strings.Contains(rows[i+1], w) {
					t.Errorf("log row %d = %q, want %q in it", i+1, rows[i+1], w)
				}
			}
		}

		jsonl := c.ok(t, "sandbox", "log", "--json", sb.ID)
		var kinds []string
		for i, line := range strings.Split(jsonl, "\n") {
			rec, err := trajectory.Parse([]byte(line))
			if err != nil || rec.Sandbox != sb.ID {
				t.Fatalf("log --json line %d: %v (%q)", i+1, err, line)
			}
			kinds = append(kinds, rec.Kind)
		}
		if got := strings.Join(kinds, " "); got != "create write_file exec reward destroy" {
			t.Fatalf("log --json kinds: %s", got)
		}

		step := c.ok(t, "sandbox", "log", sb.ID, "--step", "2")
		t.Logf("dsec sandbox log %s --step 2:\n%s", sb.ID, step)
		tr, err := cl.Trajectory(ctx, sb.ID, false)
		if err != nil {
			t.Fatal(err)
		}
		rec, err := trajectory.Parse([]byte(tr.Records[2]))
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range append([]string{
			`"seq": 2`, `"kind": "exec"`, `"exit_code": 4`, "stdout:\n  step one",
			"provenance:", "sandbox:", sb.ID, "hash:", rec.Hash, "prev:", rec.Prev,
			"chain:", "verified (5 records)", "image:", "busybox:latest", "backend:", "container",
			"resources:", "cpu 0.5", "memory 128.0MiB", "layers:",
		}, sb.Layers...) {
			if !strings.Contains(step, want) {
				t.Errorf("log --step 2 lacks %q:\n%s", want, step)
			}
		}
		if got := c.ok(t, "sandbox", "log", "--json", "--step", "2", sb.ID); got != tr.Records[2] {
			t.Errorf("log --json --step 2 = %s\nwant %s", got, tr.Records[2])
		}
		if r := c.run(t, nil, "sandbox", "log", sb.ID, "--step", "99"); r.code != 1 || !strings.Contains(r.stderr, "seq 99") {
			t.Errorf("log --step 99: %+v; want exit 1 naming seq 99", r)
		}
		// A FILE argument works the same.
		file := filepath.Join(t.TempDir(), "log.jsonl")
		writeFile(t, file, c.ok(t, "trajectory", "export", sb.ID)+"\n")
		if got := c.ok(t, "sandbox", "log", file, "--step", "2"); !strings.Contains(got, sb.Layers[0]) || !strings.Contains(got, rec.Hash) {
			t.Errorf("log FILE --step 2:\n%s", got)
		}
		if r := c.run(t, nil, "sandbox", "log", "solo-0123456789abcdef"); r.code != 1 || !strings.Contains(r.stderr, "not_found") {
			t.Errorf("log of an unknown sandbox: %+v", r)
		}
	})
}

// TestTrajectorySurvivesKill9 SIGKILLs `dsec up` in the middle of a
// sandbox's life, starts it again on the same data dir and address, and
// checks that every acknowledged record is still there, the sandbox is
// lost, recorded numbers still fast-forward, the chain verifies, and the
// killed process's sandbox is cleaned up.
func TestTrajectorySurvivesKill9(t *testing.T) {
	bins := build(t)
	data := t.TempDir()
	addr := freeAddr(t)
	endpoint := "http://" + addr
	args := []string{"up", "--data-dir", data, "--listen", addr, "--agent", bins.agent, "--node-id", "solo", "--log-level", "warn"}
	var pids []int
	// Registered first, so it runs after both daemons have stopped.
	t.Cleanup(func() { checkNoLeftovers(t, data, pids) })

	d := startDaemon(t, "dsec up", bins.dsec, args...)
	d.waitHealthy(t, endpoint)
	pids = append(pids, d.cmd.Process.Pid)
	c := cli{bin: bins.dsec, endpoint: endpoint, token: readToken(t, filepath.Join(data, "admin.token"))}
	c.ok(t, "image", "import", "busybox:latest", busyboxRootfs(t))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl := dsec.New(endpoint, c.token)

	sb, err := cl.Create(ctx, dsec.Spec{Image: "busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	const script = "echo x >> /tmp/f; wc -l < /tmp/f"
	if err := sb.WriteFile(ctx, "/tmp/f", []byte("first\n"), 0); err != nil {
		t.Fatal(err)
	}
	for i := 2; i <= 4; i++ {
		res, err := sb.Exec(ctx, "sh", "-c", script)
		if err != nil || res.Seq != uint64(i) || string(res.Stdout) != strconv.Itoa(i)+"\n" {
			t.Fatalf("exec %d: %+v, %v", i, res, err)
		}
	}
	before, err := cl.Trajectory(ctx, sb.ID, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(before.Records) != 5 {
		t.Fatalf("trajectory before the kill has %d records, want 5", len(before.Records))
	}
	if stale, _ := filepath.Glob(filepath.Join(data, "sandboxes", fmt.Sprintf("s%d-*", pids[0]))); len(stale) == 0 {
		t.Fatalf("no sandbox state dir named after pid %d: the leftover check below would check nothing", pids[0])
	}

	if err := d.stop(syscall.SIGKILL, time.Minute); err != nil {
		t.Fatal(err)
	}
	d2 := startDaemon(t, "dsec up (restarted)", bins.dsec, args...)
	d2.waitHealthy(t, endpoint)
	pids = append(pids, d2.cmd.Process.Pid)
	poll(t, 30*time.Second, "the sandbox reported lost", func() (bool, error) {
		got, err := cl.Get(ctx, sb.ID)
		if dsec.IsNotFound(err) || dsec.IsUnavailable(err) {
			return false, nil // the restarted edge has not heartbeaten yet
		}
		if err != nil {
			return false, err
		}
		return got.State == dsec.StateLost, nil
	})

	// Every acknowledged record, byte for byte, then the lost record.
	after, err := cl.Trajectory(ctx, sb.ID, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(after.Records) != len(before.Records)+1 {
		t.Fatalf("trajectory after the restart has %d records, want %d and a lost record:\n%s",
			len(after.Records), len(before.Records), strings.Join(after.Records, "\n"))
	}
	for i, line := range before.Records {
		if after.Records[i] != line {
			t.Fatalf("record %d changed across the restart:\nbefore %s\nafter  %s", i, line, after.Records[i])
		}
	}
	last, err := trajectory.Parse([]byte(after.Records[len(after.Records)-1]))
	if err != nil || last.Kind != trajectory.KindLost || last.Seq != 4 {
		t.Fatalf("last record after the restart: %+v, %v; want a lost record following seq 4", last, err)
	}

	// A client that restarts too re-sends its numbers: recorded results come
	// back without running anything (the sandbox is gone anyway).
	resumed := cl.Sandbox(sb.ID) // numbers from 1, like the original handle
	if err := resumed.WriteFile(ctx, "/tmp/f", []byte("first\n"), 0); err != nil {
		t.Fatalf("re-sent write (seq 1): %v", err)
	}
	for i := 2; i <= 4; i++ {
		res, err := resumed.Exec(ctx, "sh", "-c", script)
		if err != nil || !res.Replayed || res.Seq != uint64(i) || string(res.Stdout) != strconv.Itoa(i)+"\n" {
			t.Fatalf("re-sent exec (seq %d) after the restart: %+v, %v; want the recorded output, replayed", i, res, err)
		}
	}
	// New work on the lost sandbox is an infra_error, not a silent re-run.
	if res, err := resumed.Exec(ctx, "sh", "-c", script); err == nil && res.Outcome != dsec.OutcomeInfraError {
		t.Fatalf("new exec on the lost sandbox: %+v; want an infra_error outcome or an error", res)
	}
	r := c.run(t, nil, "sandbox", "exec", "--seq", "3", sb.ID, "--", "sh", "-c", script)
	if r.code != 0 || r.stdout != "3\n" || !strings.Contains(r.stderr, "seq 3 replayed") {
		t.Fatalf("CLI exec --seq 3 after the restart: %+v", r)
	}
	if got := c.ok(t, "trajectory", "verify", sb.ID); got != "ok: 6 records" {
		t.Fatalf("verify after the restart printed %q", got)
	}
	// The recorded steps replay without divergence; the lost record is not
	// an operation.
	if r := c.run(t, nil, "replay", sb.ID); r.code != 0 || !strings.Contains(r.stdout, "5 steps: 5 same, 0 diverged") {
		t.Fatalf("replay of the lost sandbox: %+v", r)
	}
	// The restarted process removed what the killed one left.
	if stale, _ := filepath.Glob(filepath.Join(data, "sandboxes", fmt.Sprintf("s%d-*", pids[0]))); len(stale) != 0 {
		t.Errorf("state of the killed process left after the restart: %v", stale)
	}
	if cgs := cgroupsOf(pids[0]); len(cgs) != 0 {
		t.Errorf("cgroups of the killed process left after the restart: %v", cgs)
	}
}

// checkNoLeftovers fails the test if sandbox state, cgroups or mounts of the
// dsec processes pids are left once they have stopped.
func checkNoLeftovers(t *testing.T, data string, pids []int) {
	t.Helper()
	for _, pid := range pids {
		if stale, _ := filepath.Glob(filepath.Join(data, "sandboxes", fmt.Sprintf("s%d-*", pid))); len(stale) != 0 {
			t.Errorf("sandbox state of dsec process %d left: %v", pid, stale)
		}
		if cgs := cgroupsOf(pid); len(cgs) != 0 {
			t.Errorf("cgroups of dsec process %d left: %v", pid, cgs)
		}
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], data+"/") {
			t.Errorf("mount left under the data dir: %s", line)
		}
	}
}

// cgroupsOf lists the sandbox cgroups of the dsec process pid (named by
// its slots, s<pid>-<n>) in every hierarchy.
func cgroupsOf(pid int) []string {
	var out []string
	for _, pattern := range []string{"/sys/fs/cgroup/*/dsec/s%d-*", "/sys/fs/cgroup/dsec/s%d-*"} {
		m, _ := filepath.Glob(fmt.Sprintf(pattern, pid))
		out = append(out, m...)
	}
	return out
}

func countKind(t *testing.T, lines []string, kind string) int {
	t.Helper()
	n := 0
	for _, l := range lines {
		rec, err := trajectory.Parse([]byte(l))
		if err != nil {
			t.Fatal(err)
		}
		if rec.Kind == kind {
			n++
		}
	}
	return n
}

// lineOfSeq returns the index of the record with seq in lines.
func lineOfSeq(t *testing.T, lines []string, seq uint64) int {
	t.Helper()
	for i, l := range lines {
		rec, err := trajectory.Parse([]byte(l))
		if err != nil {
			t.Fatal(err)
		}
		if rec.Seq == seq {
			return i
		}
	}
	t.Fatalf("no record with seq %d", seq)
	return -1
}

func mustReplace(t *testing.T, s, old, new string) string {
	t.Helper()
	if !strings.Contains(s, old) {
		t.Fatalf("%q not in %s", old, s)
	}
	return strings.Replace(s, old, new, 1)
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
