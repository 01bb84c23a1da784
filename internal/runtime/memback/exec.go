package memback

import (
	"context"
	"fmt"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// DefaultMaxOutput bounds captured stdout and stderr each when the request
// sets no bound.
const DefaultMaxOutput = 1 << 20

// output captures one stream up to a bound and streams it to out.
type output struct {
	stream    runtime.Stream
	buf       []byte
	max       int64
	truncated bool
	out       runtime.OutputFunc
}

func (o *output) write(s string) {
	if s == "" {
		return
	}
	if o.out != nil {
		o.out(o.stream, []byte(s))
	}
	room := o.max - int64(len(o.buf))
	if int64(len(s)) > room {
		s, o.truncated = s[:max(room, 0)], true
	}
	o.buf = append(o.buf, s...)
}

// Exec runs a built-in command: req.Argv, or req.Shell split on ";" into
// commands split on spaces (no quoting, no redirection). The commands are
// echo, cat [FILE...] (stdin without files), sleep SECONDS, exit N, true,
// false, rm [-r] [-f] PATH..., mkdir [-p] PATH..., write PATH TEXT...
// and hostname; any other is exit 127, as a shell's "not found".
func (s *Sandbox) Exec(ctx context.Context, req runtime.ExecRequest, out runtime.OutputFunc) (runtime.ExecResult, error) {
	kill, err := s.enter(ctx)
	if err != nil {
		return runtime.ExecResult{}, err
	}
	var cmds [][]string
	switch {
	case len(req.Argv) > 0:
		cmds = [][]string{req.Argv}
	case strings.TrimSpace(req.Shell) != "":
		for c := range strings.SplitSeq(req.Shell, ";") {
			if f := strings.Fields(c); len(f) > 0 {
				cmds = append(cmds, f)
			}
		}
	default:
		return runtime.ExecResult{}, fmt.Errorf("argv or shell is required: %w", runtime.ErrInvalidSpec)
	}
	limit := req.MaxOutputBytes
	if limit <= 0 {
		limit = DefaultMaxOutput
	}
	stdout := &output{stream: runtime.Stdout, max: limit, out: out}
	stderr := &output{stream: runtime.Stderr, max: limit, out: out}
	run := ctx
	if req.Timeout > 0 {
		var cancel context.CancelFunc
		run, cancel = context.WithTimeout(ctx, req.Timeout)
		defer cancel()
	}
	start := time.Now()
	res := runtime.ExecResult{}
	for _, argv := range cmds {
		code, exited, err := s.run(run, kill, argv, req.Stdin, stdout, stderr)
		if err != nil {
			return runtime.ExecResult{}, err
		}
		res.ExitCode = code
		if code < 0 || exited {
			break
		}
	}
	switch {
	case kill.Err() != nil:
		// Killed by Kill, Reset or Destroy: the sandbox is gone for
		// this exec, as a container's agent is when its init dies.
		s.mu.Lock()
		err := s.goneLocked()
		s.mu.Unlock()
		if err == nil {
			err = fmt.Errorf("sandbox %q was reset during the exec: %w", s.id, runtime.ErrSandboxGone)
		}
		return runtime.ExecResult{}, err
	case ctx.Err() != nil:
		return runtime.ExecResult{}, ctx.Err()
	case run.Err() != nil:
		res.TimedOut, res.ExitCode, res.Signal = true, -1, 9
	}
	res.Stdout, res.StdoutTruncated = stdout.buf, stdout.truncated
	res.Stderr, res.StderrTruncated = stderr.buf, stderr.truncated
	res.Duration = time.Since(start)
	return res, nil
}

// run runs one command; exited says the command was exit (the rest of a
// shell line does not run). A code of -1 means it was stopped by ctx or
// kill.
func (s *Sandbox) run(ctx, kill context.Context, argv []string, stdin []byte, stdout, stderr *output) (code int, exited bool, err error) {
	args := argv[1:]
	switch argv[0] {
	case "true":
		return 0, false, nil
	case "false":
		return 1, false, nil
	case "echo":
		stdout.write(strings.Join(args, " ") + "\n")
		return 0, false, nil
	case "hostname":
		h := s.spec.Hostname
		if h == "" {
			h = runtime.HostnameFor(s.spec.ID)
		}
		stdout.write(h + "\n")
		return 0, false, nil
	case "exit":
		n := 0
		if len(args) > 0 {
			if n, err = strconv.Atoi(args[0]); err != nil {
				stderr.write("exit: bad number " + args[0] + "\n")
				return 2, true, nil
			}
		}
		return n, true, nil
	case "sleep":
		if len(args) != 1 {
			stderr.write("usage: sleep SECONDS\n")
			return 2, false, nil
		}
		secs, err := strconv.ParseFloat(args[0], 64)
		if err != nil || secs < 0 {
			stderr.write("sleep: bad duration " + args[0] + "\n")
			return 2, false, nil
		}
		t := time.NewTimer(time.Duration(secs * float64(time.Second)))
		defer t.Stop()
		select {
		case <-t.C:
			return 0, false, nil
		case <-ctx.Done():
		case <-kill.Done():
		}
		return -1, true, nil
	case "cat":
		if len(args) == 0 {
			stdout.write(string(stdin))
			return 0, false, nil
		}
		code := 0
		for _, p := range args {
			data, err := s.ReadFile(ctx, p, 0)
			if err != nil {
				stderr.write("cat: " + err.Error() + "\n")
				code = 1
				continue
			}
			stdout.write(string(data))
		}
		return code, false, nil
	case "write":
		if len(args) < 1 {
			stderr.write("usage: write PATH TEXT...\n")
			return 2, false, nil
		}
		if err := s.WriteFile(ctx, args[0], []byte(strings.Join(args[1:], " ")), 0o644); err != nil {
			stderr.write("write: " + err.Error() + "\n")
			return 1, false, nil
		}
		return 0, false, nil
	case "rm", "mkdir":
		return s.fileCommand(argv[0], args, stderr), false, nil
	}
	stderr.write(argv[0] + ": not found\n")
	return 127, false, nil
}

// fileCommand runs rm or mkdir over their flags and paths.
func (s *Sandbox) fileCommand(name string, args []string, stderr *output) int {
	flags := map[string]bool{}
	var paths []string
	for _, a := range args {
		if strings.HasPrefix(a, "-") && len(a) > 1 {
			for _, f := range a[1:] {
				flags[string(f)] = true
			}
			continue
		}
		paths = append(paths, a)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.goneLocked() != nil {
		return -1
	}
	code := 0
	for _, p := range paths {
		cp, err := cleanPath(p)
		if err != nil {
			stderr.write(name + ": " + err.Error() + "\n")
			code = 1
			continue
		}
		n := s.tree[cp]
		switch name {
		case "rm":
			switch {
			case n == nil && flags["f"]:
			case n != nil && n.dir && !flags["r"]:
				stderr.write("rm: " + cp + ": is a directory\n")
				code = 1
			default:
				if err := s.removeLocked(cp); err != nil {
					stderr.write("rm: " + err.Error() + "\n")
					code = 1
				}
			}
		case "mkdir":
			parent := s.tree[path.Dir(cp)]
			switch {
			case n != nil && n.dir && flags["p"]:
			case n != nil:
				stderr.write("mkdir: " + cp + ": exists\n")
				code = 1
			case (parent == nil || !parent.dir) && !flags["p"]:
				stderr.write("mkdir: " + cp + ": no parent directory\n")
				code = 1
			default:
				addParents(s.tree, cp)
				s.tree[cp] = &node{dir: true, mode: 0o755}
			}
		}
	}
	return code
}
