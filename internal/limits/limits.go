// Package limits holds the bounds DSec's services apply to what a caller
// sends and to what they buffer for an answer, and the checks of requests
// against them. The API server and the edge share them, so that both
// refuse the same input with the same message naming the field, and
// neither holds more than a bounded amount of memory for one request: the
// daemons run outside every sandbox's cgroup, so what they buffer for a
// caller is host memory.
package limits

import (
	"fmt"
	"path"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

const (
	// MaxRequestBytes bounds one request: its body on the wire and each
	// message after decompression. 64 MiB is /run_code's bound too; larger
	// data goes in through image imports (a stream of small chunks).
	MaxRequestBytes = 64 << 20

	// MaxOutputBytes is the most of each of stdout and stderr that one
	// exec's result carries (ExecRequest.max_output_bytes above it is
	// taken as it; the result is flagged truncated). What an exec returns
	// in its result is buffered whole by the agent client, the trajectory
	// record and each hop's message, so this bounds a service's memory per
	// exec. ExecStream delivers all of the output as it comes.
	MaxOutputBytes = 16 << 20

	// MaxReadBytes is the most one ReadFile returns (max_bytes above it,
	// or 0, is taken as it): larger files are read with ExecStream.
	MaxReadBytes = 16 << 20

	// MaxPageBytes ends a GetTrajectory page early: its records inline
	// outputs and files, so page_size records could be gigabytes. A page
	// holds at least one record.
	MaxPageBytes = 32 << 20

	// MaxExecTimeout bounds ExecRequest.timeout. A longer one is surely a
	// mistake (or an attack: 9.3e9 s overflows Go's durations, and the
	// deadline computed from it was in the past).
	MaxExecTimeout = 30 * 24 * time.Hour

	// MaxArgString is the longest one argv, shell or env string may be:
	// Linux's MAX_ARG_STRLEN (32 pages) less the NUL.
	MaxArgString = 32*4096 - 1

	// MaxArgBytes bounds argv (or shell) and env of one exec together,
	// counted as execve does (each string with its NUL, plus a pointer).
	// Linux allows a quarter of the stack limit, 2 MiB under the usual
	// 8 MiB; half of it leaves room for the image's environment.
	MaxArgBytes = 1 << 20

	// MaxPath is the longest path a file request may name (PATH_MAX less
	// the NUL).
	MaxPath = 4095
)

// Output returns the output bound the runtime is asked for when a caller
// asked for n: 0 keeps the runtime's default (below the ceiling), more
// than MaxOutputBytes is MaxOutputBytes.
func Output(n int64) int64 { return min(n, MaxOutputBytes) }

// Read returns the bound of a ReadFile whose caller asked for n: 0 (the
// default) and anything above MaxReadBytes are MaxReadBytes.
func Read(n int64) int64 {
	if n <= 0 || n > MaxReadBytes {
		return MaxReadBytes
	}
	return n
}

func invalid(format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(format, args...))
}

// Exec checks an exec request's command, environment and bounds; field
// names in its errors start with prefix ("request.", "exec." or "").
// Output bounds above the ceiling are not an error (see Output).
func Exec(prefix string, r *dsecv1.ExecRequest) error {
	if len(r.GetArgv()) == 0 && r.GetShell() == "" {
		return invalid("%sargv or %sshell is required: give a command", prefix, prefix)
	}
	if err := Duration(prefix+"timeout", r.GetTimeout(), MaxExecTimeout); err != nil {
		return err
	}
	if n := r.GetMaxOutputBytes(); n < 0 {
		return invalid("%smax_output_bytes %d must not be negative", prefix, n)
	}
	total := 0
	arg := func(field string, s string) error {
		if i := strings.IndexByte(s, 0); i >= 0 {
			return invalid("%s%s has a NUL byte at offset %d (a command's arguments, environment and paths are C strings)", prefix, field, i)
		}
		if len(s) > MaxArgString {
			return invalid("%s%s is %d bytes; Linux takes at most %d in one argument or variable", prefix, field, len(s), MaxArgString)
		}
		total += len(s) + 1 + 8
		return nil
	}
	for i, a := range r.GetArgv() {
		if err := arg(fmt.Sprintf("argv[%d]", i), a); err != nil {
			return err
		}
	}
	if r.GetShell() != "" {
		if err := arg("shell", r.GetShell()); err != nil {
			return err
		}
	}
	for i, kv := range r.GetEnv() {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return invalid("%senv[%d] %q must be K=V", prefix, i, kv)
		}
		if err := arg(fmt.Sprintf("env[%d]", i), kv); err != nil {
			return err
		}
	}
	if total > MaxArgBytes {
		return invalid("%sargv and %senv take %d bytes together (each string with its NUL and a pointer, as execve counts); one exec may pass at most %d", prefix, prefix, total, MaxArgBytes)
	}
	for _, f := range []struct{ name, v string }{{"cwd", r.GetCwd()}, {"user", r.GetUser()}} {
		if i := strings.IndexByte(f.v, 0); i >= 0 {
			return invalid("%s%s has a NUL byte at offset %d", prefix, f.name, i)
		}
	}
	if len(r.GetCwd()) > MaxPath {
		return invalid("%scwd is %d bytes, longer than the %d a path may be", prefix, len(r.GetCwd()), MaxPath)
	}
	if n := len(r.GetStdin()); n > MaxRequestBytes {
		return invalid("%sstdin is %d bytes, more than the %d one request may carry", prefix, n, MaxRequestBytes)
	}
	return nil
}

// Path checks a path a file request names (the caller checks that it is
// not empty where it must not be).
func Path(field, p string) error {
	if i := strings.IndexByte(p, 0); i >= 0 {
		return invalid("%s has a NUL byte at offset %d (paths are C strings)", field, i)
	}
	if len(p) > MaxPath {
		return invalid("%s is %d bytes, longer than the %d a path may be", field, len(p), MaxPath)
	}
	return nil
}

// ReadFile checks a ReadFile request (field names start with prefix).
func ReadFile(prefix string, r *dsecv1.ReadFileRequest) error {
	if r.GetPath() == "" {
		return invalid("%spath is required", prefix)
	}
	if err := Path(prefix+"path", r.GetPath()); err != nil {
		return err
	}
	if r.GetMaxBytes() < 0 {
		return invalid("%smax_bytes %d must not be negative", prefix, r.GetMaxBytes())
	}
	return nil
}

// WriteFile checks a WriteFile request (field names start with prefix).
func WriteFile(prefix string, r *dsecv1.WriteFileRequest) error {
	if r.GetPath() == "" {
		return invalid("%spath is required", prefix)
	}
	if err := Path(prefix+"path", r.GetPath()); err != nil {
		return err
	}
	if r.GetMode() > 0o7777 {
		return invalid("%smode %#o has bits beyond 07777", prefix, r.GetMode())
	}
	return nil
}

// Duration checks an optional duration field: valid, not negative, at
// most most (0: no upper bound but Go's own).
func Duration(field string, d *durationpb.Duration, most time.Duration) error {
	if d == nil {
		return nil
	}
	if err := d.CheckValid(); err != nil {
		return invalid("%s: %w", field, err)
	}
	// CheckValid allows ±10,000 years; a time.Duration holds ±292.
	const goMax = int64(1<<63-1) / int64(time.Second)
	if d.GetSeconds() >= goMax {
		return invalid("%s %ds is longer than the %v allowed", field, d.GetSeconds(), orMax(most))
	}
	v := d.AsDuration()
	if v < 0 {
		return invalid("%s %v must not be negative", field, v)
	}
	if most > 0 && v > most {
		return invalid("%s %v is longer than the %v allowed", field, v, most)
	}
	return nil
}

func orMax(most time.Duration) time.Duration {
	if most > 0 {
		return most
	}
	return time.Duration(1<<63 - 1)
}

// TooLarge is the message of a ReadFile refused because the file is
// larger than its bound.
func TooLarge(prefix, path string, bound int64) error {
	return invalid("%spath %s is larger than this ReadFile's bound of %d bytes (max_bytes; at most %d): read larger files in parts or through ExecStream",
		prefix, path, bound, MaxReadBytes)
}

const (
	// MaxInputEvents bounds one Input request's events.
	MaxInputEvents = 256
	// MaxInputText bounds one text event (typed a key at a time: a few
	// thousand keys already take seconds in a guest).
	MaxInputText = 4096
	// MaxScreenCoord bounds pointer coordinates (QEMU's absolute axes
	// span 0..32767 whatever the screen's size).
	MaxScreenCoord = 32767
)

// Input checks an Input request's events (field names start with prefix):
// the kinds and buttons it names, the coordinates and the sizes. Whether
// a key name exists is the guest's machine's to say.
func Input(prefix string, r *dsecv1.InputRequest) error {
	evs := r.GetEvents()
	if len(evs) == 0 {
		return invalid("%sevents is required: give at least one event", prefix)
	}
	if len(evs) > MaxInputEvents {
		return invalid("%sevents has %d events, more than %d", prefix, len(evs), MaxInputEvents)
	}
	for i, ev := range evs {
		f := fmt.Sprintf("%sevents[%d].", prefix, i)
		switch ev.GetKind() {
		case "text":
			if ev.GetText() == "" {
				return invalid("%stext is required for a text event", f)
			}
			if len(ev.GetText()) > MaxInputText {
				return invalid("%stext is %d bytes, more than %d", f, len(ev.GetText()), MaxInputText)
			}
		case "key":
			k := ev.GetKey()
			if k == "" {
				return invalid("%skey is required for a key event", f)
			}
			for _, part := range strings.Split(k, "-") {
				if part == "" || len(part) > 32 || strings.ContainsFunc(part, func(r rune) bool {
					return !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_')
				}) {
					return invalid("%skey %q is not a key or a chord of keys joined by \"-\" (QEMU key names such as ret, esc, ctrl-alt-delete, shift-a)", f, k)
				}
			}
		case "move", "click":
			if x, y := ev.GetX(), ev.GetY(); x < 0 || y < 0 || x > MaxScreenCoord || y > MaxScreenCoord {
				return invalid("%sx, y = %d, %d is off the screen (0 to %d)", f, x, y, MaxScreenCoord)
			}
			switch b := ev.GetButton(); {
			case ev.GetKind() == "move" && b != "":
				return invalid("%sbutton is for click events, not move", f)
			case b != "" && b != "left" && b != "middle" && b != "right":
				return invalid("%sbutton %q is not left, middle or right", f, b)
			}
		default:
			return invalid("%skind %q is not text, key, move or click", f, ev.GetKind())
		}
	}
	return nil
}

// MaxArtifacts bounds a verify's artifacts.
const MaxArtifacts = 64

// Verify checks a verify request (field names start with prefix): a
// grading command as Exec checks it, and 1 to MaxArtifacts artifacts, each
// an absolute, clean path other than "/" (a verifier gets what the grade
// needs, not the whole sandbox back).
func Verify(prefix string, r *dsecv1.VerifyRequest) error {
	if r.GetExec() == nil {
		return invalid("%sexec is required (the grading command)", prefix)
	}
	if err := Exec(prefix+"exec.", r.GetExec()); err != nil {
		return err
	}
	if len(r.GetArtifacts()) == 0 {
		return invalid("%sartifacts: at least one path to copy into the verifier is required", prefix)
	}
	if len(r.GetArtifacts()) > MaxArtifacts {
		return invalid("%sartifacts: %d paths, more than %d", prefix, len(r.GetArtifacts()), MaxArtifacts)
	}
	for i, a := range r.GetArtifacts() {
		field := fmt.Sprintf("%sartifacts[%d]", prefix, i)
		if err := Path(field, a); err != nil {
			return err
		}
		if !path.IsAbs(a) || path.Clean(a) != a || a == "/" {
			return invalid("%s %q must be an absolute, clean path other than /", field, a)
		}
	}
	return nil
}
