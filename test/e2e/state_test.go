package e2e

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// mutate changes busybox's tree in every way a diff of the writable layer
// must carry: a new directory with a file, an appended base file, a deleted
// base file, a directory replaced by a file, a file replaced by a directory,
// and a directory emptied and refilled (opaque).
const mutate = `set -e
mkdir -p /work/made/deeper && echo created > /work/made/deeper/file
echo appended >> /etc/nsswitch.conf
rm /etc/group
rmdir /mnt && echo mnt-is-a-file > /mnt
rm /etc/hosts && mkdir /etc/hosts && echo in-a-dir > /etc/hosts/entry
rm -rf /usr/sbin && mkdir /usr/sbin && echo lonely > /usr/sbin/lonely
chmod 0600 /work/made/deeper/file`

// describe prints what mutate touches (and a few paths it does not): type,
// mode and content hash, plus the listings that would show a whiteout or an
// opaque directory gone wrong.
const describe = `for p in /work /work/made /work/made/deeper /work/made/deeper/file /etc/nsswitch.conf /etc/group \
  /etc/passwd /mnt /etc/hosts /etc/hosts/entry /usr/sbin /usr/sbin/lonely /usr/sbin/chroot /root/later /opt; do
  if [ -e "$p" ] || [ -L "$p" ]; then
    echo "$p $(stat -c '%F %a' "$p")"
    if [ -f "$p" ]; then md5sum < "$p"; fi
  else
    echo "$p absent"
  fi
done
ls -1a /etc /usr/sbin /work/made/deeper /root 2>&1
true`

// afterCheckpoint undoes, redoes and adds changes after a checkpoint, and
// starts a process: a rollback must take all of it away.
const afterCheckpoint = `set -e
echo changed > /work/made/deeper/file
rm -rf /work/made
echo 'root:x:0:' > /etc/group
rm /mnt && mkdir /mnt
rm -rf /etc/hosts && echo file-again > /etc/hosts
echo later > /root/later
mkdir /opt && touch /opt/x
rm /etc/nsswitch.conf
sleep 4242 >/dev/null 2>&1 &`

var checkpointID = regexp.MustCompile(`^ck-[0-9a-f]+$`)

// TestSnapshotCheckpointFreeze drives snapshots, checkpoints, rollbacks
// and freeze/thaw through the CLI and the Go SDK against `dsec up`.
func TestSnapshotCheckpointFreeze(t *testing.T) {
	bins := build(t)
	c, _ := startUp(t, bins)
	c.ok(t, "image", "import", "busybox:latest", busyboxRootfs(t))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cl := dsec.New(c.endpoint, c.token)
	sh := func(t *testing.T, id, script string) string {
		t.Helper()
		return c.ok(t, "sandbox", "exec", id, "--", "sh", "-c", script)
	}
	create := func(t *testing.T, args ...string) string {
		t.Helper()
		id := c.ok(t, append([]string{"sandbox", "create"}, args...)...)
		t.Cleanup(func() { cl.Destroy(context.WithoutCancel(ctx), id) })
		return id
	}

	t.Run("cli", func(t *testing.T) {
		id := create(t, "--image", "busybox:latest")
		base := sh(t, id, describe)
		sh(t, id, mutate)
		want := sh(t, id, describe)
		if want == base {
			t.Fatal("the mutation changed nothing")
		}

		// Snapshot, then restore on a fresh sandbox.
		out := c.ok(t, "sandbox", "snapshot", id, "env:step1")
		if !regexp.MustCompile(`^env:step1 sha256:[0-9a-f]{64}$`).MatchString(out) {
			t.Fatalf("sandbox snapshot printed %q, want the ref and the digest", out)
		}
		if got := sh(t, id, describe); got != want {
			t.Fatalf("the source sandbox changed across its snapshot:\n%s\nwant:\n%s", got, want)
		}
		restored := create(t, "--image", "env:step1")
		if got := sh(t, restored, describe); got != want {
			t.Fatalf("sandbox restored from the snapshot:\n%s\nwant:\n%s", got, want)
		}
		// A snapshot of the restored sandbox adds one layer to the chain.
		sh(t, restored, "echo later > /root/later")
		c.ok(t, "sandbox", "snapshot", restored, "env:step2")
		im1, err := cl.Images().Get(ctx, "env:step1")
		if err != nil {
			t.Fatal(err)
		}
		im2, err := cl.Images().Get(ctx, "env:step2")
		if err != nil {
			t.Fatal(err)
		}
		if len(im1.Layers) != 2 || len(im2.Layers) != 3 || im2.Layers[1] != im1.Layers[1] {
			t.Fatalf("snapshot layers %v then %v: want busybox plus one, then one more", im1.Layers, im2.Layers)
		}

		// Checkpoint prints the ID alone, so ck=$(dsec sandbox checkpoint ID) works.
		r := c.run(t, nil, "sandbox", "checkpoint", id)
		ck := strings.TrimSuffix(r.stdout, "\n")
		if r.code != 0 || !checkpointID.MatchString(ck) || r.stderr != "" {
			t.Fatalf("sandbox checkpoint: %+v; want a checkpoint ID alone on stdout", r)
		}
		sh(t, id, afterCheckpoint)
		if got := sh(t, id, describe); got == want {
			t.Fatal("the changes after the checkpoint did not show")
		}
		if ps := sh(t, id, "ps -o args"); !strings.Contains(ps, "sleep 4242") {
			t.Fatalf("the process started after the checkpoint is not running:\n%s", ps)
		}
		if r := c.run(t, nil, "sandbox", "rollback", id, ck); r.code != 0 || r.stdout != "" {
			t.Fatalf("sandbox rollback: %+v", r)
		}
		if got := sh(t, id, describe); got != want {
			t.Fatalf("after rollback:\n%s\nwant:\n%s", got, want)
		}
		if ps := sh(t, id, "ps -o args"); strings.Contains(ps, "sleep 4242") {
			t.Fatalf("a process started after the checkpoint survived the rollback:\n%s", ps)
		}
		if got := c.ok(t, "sandbox", "get", "--json", id); !strings.Contains(got, `"state": "running"`) || !strings.Contains(got, `"id": "`+id+`"`) {
			t.Fatalf("after rollback the sandbox is:\n%s", got)
		}
		// The checkpoint is still there to go back to.
		sh(t, id, "echo scribble > /work/made/deeper/file")
		c.ok(t, "sandbox", "rollback", id, ck)
		if got := sh(t, id, describe); got != want {
			t.Fatalf("after a second rollback:\n%s\nwant:\n%s", got, want)
		}
		if r := c.run(t, nil, "sandbox", "rollback", id, "ck-0000000000000000"); r.code != 1 || !strings.Contains(r.stderr, "not_found") {
			t.Fatalf("rollback to an unknown checkpoint: %+v; want exit 1, not_found", r)
		}
		for _, args := range [][]string{
			{"sandbox", "snapshot", id},
			{"sandbox", "checkpoint"},
			{"sandbox", "rollback", id},
			{"sandbox", "freeze"},
			{"sandbox", "thaw", id, id},
		} {
			if r := c.run(t, nil, args...); r.code != 2 {
				t.Errorf("dsec %s: %+v; want a usage error", strings.Join(args, " "), r)
			}
		}
		if r := c.run(t, nil, "sandbox", "snapshot", id, "Not A Ref"); r.code != 1 || !strings.Contains(r.stderr, "invalid_argument") {
			t.Fatalf("snapshot with a bad ref: %+v", r)
		}
	})

	t.Run("sdk", func(t *testing.T) {
		sb, err := cl.Create(ctx, dsec.Spec{Image: "busybox:latest"})
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Destroy(context.WithoutCancel(ctx))
		run := func(h *dsec.Sandbox, script string) *dsec.ExecResult {
			t.Helper()
			res, err := h.ExecShell(ctx, script)
			if err != nil || res.ExitCode != 0 {
				t.Fatalf("exec %q: %+v, %v", script, res, err)
			}
			return res
		}
		run(sb, mutate)                          // 1
		want := string(run(sb, describe).Stdout) // 2
		im, err := sb.Snapshot(ctx, "sdk-env:1") // 3
		if err != nil || im.Seq != 3 || im.Replayed || len(im.Layers) != 2 || im.Ref != "sdk-env:1" {
			t.Fatalf("Snapshot = %+v, %v; want step 3 with two layers", im, err)
		}
		ck, err := sb.CheckpointWith(ctx, dsec.OpOptions{RequestID: "ck-req"}) // 4
		if err != nil || ck.Seq != 4 || !checkpointID.MatchString(ck.ID) {
			t.Fatalf("Checkpoint = %+v, %v; want step 4", ck, err)
		}
		run(sb, afterCheckpoint)                                 // 5
		rb, err := sb.RollbackWith(ctx, ck.ID, dsec.OpOptions{}) // 6
		if err != nil || rb.Seq != 6 || rb.Replayed {
			t.Fatalf("Rollback = %+v, %v; want step 6", rb, err)
		}
		if got := string(run(sb, describe).Stdout); got != want { // 7
			t.Fatalf("after rollback:\n%s\nwant:\n%s", got, want)
		}
		if ps := string(run(sb, "ps -o args").Stdout); strings.Contains(ps, "sleep 4242") { // 8
			t.Fatalf("a process started after the checkpoint survived the rollback:\n%s", ps)
		}
		restored, err := cl.Create(ctx, dsec.Spec{Image: "sdk-env:1"})
		if err != nil {
			t.Fatal(err)
		}
		defer restored.Destroy(context.WithoutCancel(ctx))
		if got := string(run(restored, describe).Stdout); got != want {
			t.Fatalf("restored from the snapshot:\n%s\nwant:\n%s", got, want)
		}

		// A trainer that restarts and re-issues its steps is fast-forwarded
		// through snapshots, checkpoints and rollbacks too: nothing is
		// taken again, and the checkpoint keeps its ID.
		again := cl.Sandbox(sb.ID)
		if res := run(again, mutate); !res.Replayed {
			t.Fatalf("re-issued step 1 ran again: %+v", res)
		}
		run(again, describe)
		im2, err := again.Snapshot(ctx, "sdk-env:1")
		if err != nil || !im2.Replayed || im2.Digest != im.Digest || im2.Seq != 3 {
			t.Fatalf("re-issued Snapshot = %+v, %v; want step 3 replayed with digest %s", im2, err, im.Digest)
		}
		ck2, err := again.CheckpointWith(ctx, dsec.OpOptions{RequestID: "ck-req"})
		if err != nil || !ck2.Replayed || ck2.ID != ck.ID {
			t.Fatalf("re-issued Checkpoint = %+v, %v; want %s replayed", ck2, err, ck.ID)
		}
		run(again, afterCheckpoint)
		if err := again.Rollback(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		if next := again.NextSeqToSend(); next != 7 {
			t.Fatalf("the re-issuing handle is at step %d, want 7", next)
		}

		if err := sb.DeleteCheckpoint(ctx, ck.ID); err != nil {
			t.Fatal(err)
		}
		if err := sb.Rollback(ctx, ck.ID); !dsec.IsNotFound(err) {
			t.Fatalf("rollback to a deleted checkpoint: %v, want NotFound", err)
		}
		if _, err := sb.Snapshot(ctx, ""); !dsec.IsInvalidArgument(err) {
			t.Fatalf("Snapshot without a ref: %v, want InvalidArgument", err)
		}
		// A refusal the server did not record leaves the handle in step.
		next := sb.NextSeqToSend()
		if _, err := sb.Snapshot(ctx, "Bad Ref"); !dsec.IsInvalidArgument(err) {
			t.Fatalf("Snapshot with a bad ref: %v, want InvalidArgument", err)
		}
		if err := sb.Freeze(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := sb.ExecShell(ctx, "true"); !dsec.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "frozen") {
			t.Fatalf("exec in a frozen sandbox: %v, want FailedPrecondition naming frozen", err)
		}
		if err := sb.Thaw(ctx); err != nil {
			t.Fatal(err)
		}
		if got := sb.NextSeqToSend(); got != next {
			t.Fatalf("after two refusals the handle sends step %d next, want %d", got, next)
		}
		if res := run(sb, "true"); res.Seq != next {
			t.Fatalf("exec after thaw is step %d, want %d", res.Seq, next)
		}
	})

	t.Run("freeze", func(t *testing.T) {
		id := create(t, "--image", "busybox:latest", "--label", "job=state-e2e")
		other := create(t, "--image", "busybox:latest", "--label", "job=state-e2e-other")
		pid := sh(t, id, "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!")
		if _, err := strconv.Atoi(pid); err != nil {
			t.Fatalf("busy loop pid %q", pid)
		}
		probe := cl.Sandbox(id, dsec.Unnumbered())
		cpu := func() int {
			t.Helper()
			// utime + stime, in clock ticks.
			res, err := probe.ExecShell(ctx, "set -- $(cat /proc/"+pid+"/stat); echo $(( ${14} + ${15} ))")
			if err != nil || res.ExitCode != 0 {
				t.Fatalf("read the busy loop's CPU time: %+v, %v", res, err)
			}
			n, err := strconv.Atoi(strings.TrimSpace(string(res.Stdout)))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
		const interval = 1500 * time.Millisecond
		c0 := cpu()
		time.Sleep(interval)
		c1 := cpu()
		c.ok(t, "sandbox", "freeze", id)
		time.Sleep(interval)
		// Exec on a frozen sandbox fails at once, saying why.
		r := c.run(t, nil, "sandbox", "exec", id, "--", "true")
		if r.code != 125 || !strings.Contains(r.stderr, "frozen") || !strings.Contains(r.stderr, "thaw") {
			t.Fatalf("exec in a frozen sandbox: %+v; want exit 125 saying it is frozen", r)
		}
		if got := c.ok(t, "sandbox", "get", "--json", id); !strings.Contains(got, `"state": "frozen"`) {
			t.Fatalf("a frozen sandbox shows as:\n%s", got)
		}
		c.ok(t, "sandbox", "freeze", id) // freezing again does nothing
		if r := c.run(t, nil, "sandbox", "thaw", id); r.code != 0 || r.stdout != "" {
			t.Fatalf("sandbox thaw: %+v", r)
		}
		c2 := cpu()
		time.Sleep(interval)
		c3 := cpu()
		running, frozen, resumed := c1-c0, c2-c1, c3-c2
		t.Logf("busy loop CPU ticks over %v: running %d, frozen %d, after thaw %d", interval, running, frozen, resumed)
		if running <= 0 || resumed <= 0 {
			t.Fatalf("the busy loop did not run: %d ticks before the freeze, %d after the thaw", running, resumed)
		}
		// The frozen interval includes the freeze and thaw calls themselves;
		// it must still be far below an equal running interval.
		if frozen*4 > running || frozen*4 > resumed {
			t.Fatalf("the busy loop used %d ticks while frozen against %d and %d running", frozen, running, resumed)
		}
		if ps := sh(t, id, "ps -o pid,args"); !strings.Contains(ps, "while") {
			t.Fatalf("the busy loop did not survive freeze and thaw:\n%s", ps)
		}
		sh(t, id, "kill "+pid)

		// Job freeze by label: one line per sandbox, the other label untouched.
		if r := c.run(t, nil, "job", "freeze"); r.code != 2 || !strings.Contains(r.stderr, "--label") {
			t.Fatalf("job freeze without a label: %+v; want a usage error", r)
		}
		if got := c.ok(t, "job", "freeze", "--label", "job=state-e2e"); got != id+" ok" {
			t.Fatalf("job freeze printed %q, want %q", got, id+" ok")
		}
		if r := c.run(t, nil, "sandbox", "exec", id, "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "frozen") {
			t.Fatalf("exec after job freeze: %+v", r)
		}
		sh(t, other, "true")
		r = c.run(t, nil, "job", "freeze", "--label", "job=nobody")
		if r.code != 0 || r.stdout != "" || !strings.Contains(r.stderr, "job=nobody") {
			t.Fatalf("job freeze matching nothing: %+v", r)
		}
		if got := c.ok(t, "job", "thaw", "--label", "job=state-e2e"); got != id+" ok" {
			t.Fatalf("job thaw printed %q", got)
		}
		sh(t, id, "true")
	})
}
