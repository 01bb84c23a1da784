package trajectory

import (
	"bufio"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Deterministic replay rebuilds a sandbox from its creation record's
// environment and re-runs its operations in seq order. This file holds the
// server-free half: which records are re-run, and how a re-run's outcome is
// compared with the recorded one. The other half (creating the sandbox,
// sending the requests) lives with the client that drives the replay.

// ReadAll parses a JSONL trajectory, one record per line. It does not check
// the hash chain (Verify does).
func ReadAll(r io.Reader) ([]*Record, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<30)
	var out []*Record
	for n := 1; sc.Scan(); n++ {
		rec, err := Parse(sc.Bytes())
		if err != nil {
			return nil, fmt.Errorf("line %d: not a trajectory record: %w", n, err)
		}
		out = append(out, rec)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read trajectory: %w", err)
	}
	return out, nil
}

// Replayable reports whether a replay re-runs the record's operation: execs
// and file operations. Creation (the replay builds its own sandbox),
// rewards (the trainer's, not the sandbox's) and endings are not re-run.
func Replayable(r *Record) bool {
	switch r.Kind {
	case KindExec, KindWriteFile, KindReadFile:
		return true
	}
	return false
}

// SkipReason says why a step ReplayOrder returns is not re-run, "" when it
// is. An exec whose outcome was infra_error records a failure of the
// sandbox or its node, not a result of the command: there is nothing to
// compare with. Operations a replay cannot perform yet (snapshots,
// checkpoints, rollbacks) are reported rather than silently left out.
func SkipReason(r *Record) string {
	if !Replayable(r) {
		return r.Kind + " is not replayed"
	}
	if r.Exec != nil && r.Exec.Outcome == "infra_error" {
		return "infra_error recorded"
	}
	return ""
}

// Missing lists the data a replay of the record needs but the record does
// not carry inline (stdin, the data of a write): a trajectory read without
// its data (GetTrajectory without include_data) cannot be replayed.
func Missing(r *Record) []string {
	var out []string
	if r.Exec != nil && !r.Exec.Stdin.Complete() {
		out = append(out, "stdin "+r.Exec.Stdin.Digest)
	}
	if r.Kind == KindWriteFile && r.File != nil && !r.File.Data.Complete() {
		out = append(out, "data "+r.File.Data.Digest)
	}
	return out
}

// ReplayOrder returns the steps of a replay in seq order (the log holds
// them in completion order, which concurrent operations interleave): every
// operation but the creation (the replay builds its own sandbox) and
// rewards (the trainer's judgement, not the sandbox's doing). Events
// (destroy, lost, freeze, ...) happen to a sandbox and are not steps.
// SkipReason says which of the steps are not re-run.
func ReplayOrder(recs []*Record) []*Record {
	var out []*Record
	for _, r := range recs {
		if r.Kind != KindCreate && r.Kind != KindReward && !IsEvent(r.Kind) {
			out = append(out, r)
		}
	}
	slices.SortStableFunc(out, func(a, b *Record) int {
		switch {
		case a.Seq < b.Seq:
			return -1
		case a.Seq > b.Seq:
			return 1
		}
		return 0
	})
	return out
}

// Title names the record's operation for reports and listings:
// "exec `echo hi`", "write_file /tmp/x", "reward 0.5".
func (r *Record) Title() string {
	switch {
	case r.Kind == KindExec && r.Exec != nil:
		return "exec `" + clip(Command(r.Exec), 60) + "`"
	case r.File != nil:
		return r.Kind + " " + r.File.Path
	case r.Kind == KindReward && r.Reward != nil:
		return "reward " + strconv.FormatFloat(r.Reward.Value, 'g', -1, 64)
	case r.Kind == KindCreate && r.Environment != nil:
		return "create " + r.Environment.Image
	}
	return r.Kind
}

// Command is an exec's command line as a user would type it: the shell
// script, or the argv with arguments quoted where a shell would need it.
func Command(x *Exec) string {
	if len(x.Argv) == 0 {
		return x.Shell
	}
	parts := make([]string, len(x.Argv))
	for i, a := range x.Argv {
		parts[i] = shellQuote(a)
	}
	return strings.Join(parts, " ")
}

func shellQuote(s string) string {
	if s == "" {
		return "''"
	}
	safe := true
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("-_./:=,+@%", c)) {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// clip shortens s to at most n runes, marking the cut.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-3]) + "..."
}

// previewMax is the largest output a divergence report quotes in full.
const previewMax = 80

// Compare reports how now, the outcome of re-running recorded's operation,
// differs from recorded: one human-readable entry per difference, none when
// they agree. It compares what the operation observed, never timing: for an
// exec the outcome, exit code, signal, timeout and OOM flags and the digests
// of stdout and stderr; for a read the digest of the data read; for every
// operation whether it failed, and with which code (messages name
// sandboxes and may differ).
func Compare(recorded, now *Record) []string {
	if recorded.Kind != now.Kind {
		return []string{fmt.Sprintf("kind differs: recorded %s, now %s", recorded.Kind, now.Kind)}
	}
	rc, nc := errCode(recorded.Error), errCode(now.Error)
	switch {
	case rc != "" && nc == "":
		return []string{fmt.Sprintf("recorded error %s (%s), now it succeeded", rc, clip(recorded.Error.Message, 120))}
	case rc == "" && nc != "":
		return []string{fmt.Sprintf("failed now with %s (%s), recorded success", nc, clip(now.Error.Message, 120))}
	case rc != nc:
		return []string{fmt.Sprintf("error differs: recorded %s, now %s (%s)", rc, nc, clip(now.Error.Message, 120))}
	case rc != "":
		return nil // the same failure; there is no result to compare
	}
	var out []string
	switch recorded.Kind {
	case KindExec:
		a, b := recorded.Exec, now.Exec
		if a == nil || b == nil {
			if a != b {
				out = append(out, "exec result missing")
			}
			return out
		}
		if a.Outcome != b.Outcome {
			d := fmt.Sprintf("outcome differs: recorded %s, now %s", a.Outcome, b.Outcome)
			if b.InfraError != "" {
				d += " (" + clip(b.InfraError, 120) + ")"
			}
			out = append(out, d)
		}
		if a.ExitCode != b.ExitCode {
			out = append(out, fmt.Sprintf("exit code differs: recorded %d, now %d", a.ExitCode, b.ExitCode))
		}
		if a.Signal != b.Signal {
			out = append(out, fmt.Sprintf("signal differs: recorded %d, now %d", a.Signal, b.Signal))
		}
		if a.TimedOut != b.TimedOut {
			out = append(out, fmt.Sprintf("timed_out differs: recorded %t, now %t", a.TimedOut, b.TimedOut))
		}
		if a.OOMKilled != b.OOMKilled {
			out = append(out, fmt.Sprintf("oom_killed differs: recorded %t, now %t", a.OOMKilled, b.OOMKilled))
		}
		if a.PidsExhausted != b.PidsExhausted {
			out = append(out, fmt.Sprintf("pids_exhausted differs: recorded %t, now %t", a.PidsExhausted, b.PidsExhausted))
		}
		if a.DiskFull != b.DiskFull {
			out = append(out, fmt.Sprintf("disk_full differs: recorded %t, now %t", a.DiskFull, b.DiskFull))
		}
		out = appendDataDiff(out, "stdout", a.Stdout, b.Stdout)
		out = appendDataDiff(out, "stderr", a.Stderr, b.Stderr)
	case KindReadFile:
		var a, b *Data
		if recorded.File != nil {
			a = recorded.File.Data
		}
		if now.File != nil {
			b = now.File.Data
		}
		out = appendDataDiff(out, "data read", a, b)
	case KindWriteFile:
		// Success on both sides is all a write reports.
	}
	return out
}

func errCode(e *Error) string {
	if e == nil {
		return ""
	}
	if e.Code == "" {
		return "unknown"
	}
	return e.Code
}

// emptyDigest names zero bytes, for data fields left nil.
var emptyDigest = digest(nil)

func appendDataDiff(out []string, what string, a, b *Data) []string {
	if a == nil {
		a = &Data{Digest: emptyDigest}
	}
	if b == nil {
		b = &Data{Digest: emptyDigest}
	}
	if a.Digest == b.Digest {
		return out
	}
	return append(out, fmt.Sprintf("%s differs (recorded %s, now %s)", what, describeData(a), describeData(b)))
}

// describeData is a digest, a size and, for small data at hand, the bytes.
func describeData(d *Data) string {
	s := fmt.Sprintf("%s %d bytes", ShortDigest(d.Digest), d.Size)
	if d.Inline != nil && len(d.Inline) <= previewMax {
		s += " " + strconv.Quote(string(d.Inline))
	}
	return s
}

// ShortDigest abbreviates "sha256:<64 hex>" to its first 12 hex digits.
func ShortDigest(d string) string {
	const n = len("sha256:") + 12
	if len(d) > n {
		return d[:n]
	}
	return d
}

// CompareLayers reports how a replay sandbox's layers differ from the
// recorded ones (an image tag that moved since the recording), "" when they
// are the same list.
func CompareLayers(recorded, now []string) string {
	if slices.Equal(recorded, now) {
		return ""
	}
	short := func(ds []string) string {
		s := make([]string, len(ds))
		for i, d := range ds {
			s[i] = ShortDigest(d)
		}
		return "[" + strings.Join(s, " ") + "]"
	}
	return fmt.Sprintf("layers differ (recorded %d %s, now %d %s): the image changed since the recording",
		len(recorded), short(recorded), len(now), short(now))
}
