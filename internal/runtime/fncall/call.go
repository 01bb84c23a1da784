// Package fncall runs stateless calls, SandboxFusion style: "run this code
// in that language and return its output", each in one clean sandbox.
//
// The language table (languages.json, embedded) says per language how to
// compile and run, which environment and default memory limit to use, and
// which Debian packages its image needs (scripts/langimage.sh builds that
// image). Call runs one request in one sandbox it is handed: it writes the
// source and the request's files in one archive, compiles, runs, and reads
// the requested files back. Choosing and resetting sandboxes is the pool's
// business (internal/pool), not this package's.
package fncall

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// WorkDir is the working directory of every call. It lives on the
// sandbox's /tmp, which a reset empties with the rest of the writable layer.
const WorkDir = "/tmp/fncall"

// binaryName is what compilers write in WorkDir ({binary}).
const binaryName = "main"

// Defaults and bounds of a request.
const (
	DefaultCompileTimeout = 10 * time.Second
	DefaultRunTimeout     = 10 * time.Second
	// MinMemoryLimitMB is the smallest memory limit a request may set: the
	// sandbox's agent and the call's tmpfs files count against it too.
	MinMemoryLimitMB = 16
	// MaxFetchBytes bounds a call's FetchFiles together (the API's
	// ReadFile ceiling, limits.MaxReadBytes): a file past it is named in
	// the message and left out.
	MaxFetchBytes = 16 << 20
)

// Response statuses (SandboxFusion's).
const (
	// StatusSuccess: the program ran and exited 0.
	StatusSuccess = "Success"
	// StatusFailed: the code failed (compile error, non-zero exit, signal,
	// time or memory limit).
	StatusFailed = "Failed"
	// StatusSandboxError: DSec failed; the trainer should mask the sample.
	StatusSandboxError = "SandboxError"
)

// CommandResult statuses.
const (
	// CommandFinished: the command ran to its end, whatever its exit code.
	CommandFinished = "Finished"
	// CommandTimeLimitExceeded: the command was killed at its time limit.
	CommandTimeLimitExceeded = "TimeLimitExceeded"
	// CommandError: the command could not be run.
	CommandError = "Error"
)

// Request is one call; it mirrors api/dsec/v1 RunCodeRequest.
type Request struct {
	Code, Language string
	// Zero means DefaultCompileTimeout / DefaultRunTimeout.
	CompileTimeout, RunTimeout time.Duration
	// MemoryLimitMB bounds compile and run; zero means the language's
	// default. Applied when the sandbox implements runtime.Updater.
	MemoryLimitMB int64
	Stdin         []byte
	// Files are written before compiling: name (relative to WorkDir, or
	// absolute) -> content.
	Files map[string][]byte
	// FetchFiles are read back after the run; missing ones are left out.
	FetchFiles []string
	// Args are appended to the language's run argv.
	Args []string
	// MaxOutputBytes bounds captured stdout and stderr each; zero means
	// the sandbox's default.
	MaxOutputBytes int64
	// Image overrides the language's image. The caller uses it to choose
	// a sandbox; Call itself ignores it.
	Image string
}

// CommandResult is one step of a call (compile or run); it mirrors
// api/dsec/v1 CommandResult.
type CommandResult struct {
	Status          string // CommandFinished, CommandTimeLimitExceeded or CommandError
	ExecutionTime   time.Duration
	ReturnCode      int
	Signal          int
	Stdout, Stderr  []byte
	StdoutTruncated bool
	StderrTruncated bool
	OOMKilled       bool
}

// Response is the outcome of a call; it mirrors api/dsec/v1
// RunCodeResponse.
type Response struct {
	Status  string // StatusSuccess, StatusFailed or StatusSandboxError
	Message string
	// Compile is nil for interpreted languages; Run is nil when compiling
	// failed (or the sandbox failed before the run).
	Compile, Run *CommandResult
	// Files holds the FetchFiles that exist, by the name asked for.
	Files map[string][]byte
}

// Validate checks a request before it is given a sandbox. Its errors are
// the caller's (InvalidArgument at the API); Call only reports sandbox
// faults.
func (r Request) Validate() error {
	lang, err := Lookup(r.Language)
	if err != nil {
		return err
	}
	return r.validate(lang)
}

// validate checks everything but the language name.
func (r Request) validate(lang Language) error {
	if r.Code == "" {
		return errors.New("code is empty")
	}
	switch {
	case r.CompileTimeout < 0:
		return fmt.Errorf("compile_timeout %v is negative", r.CompileTimeout)
	case r.RunTimeout < 0:
		return fmt.Errorf("run_timeout %v is negative", r.RunTimeout)
	case r.MemoryLimitMB < 0:
		return fmt.Errorf("memory_limit_mb %d is negative", r.MemoryLimitMB)
	case r.MemoryLimitMB > 0 && r.MemoryLimitMB < MinMemoryLimitMB:
		return fmt.Errorf("memory_limit_mb %d is below the minimum of %d", r.MemoryLimitMB, MinMemoryLimitMB)
	case r.MaxOutputBytes < 0:
		return fmt.Errorf("max_output_bytes %d is negative", r.MaxOutputBytes)
	}
	if err := checkFiles(r.Files, path.Join(WorkDir, lang.Source)); err != nil {
		return fmt.Errorf("files: %w", err)
	}
	for _, name := range r.FetchFiles {
		if _, err := filePath(name); err != nil {
			return fmt.Errorf("fetch_files: %w", err)
		}
	}
	for i, a := range r.Args {
		if strings.IndexByte(a, 0) >= 0 {
			return fmt.Errorf("args[%d] contains a NUL byte", i)
		}
	}
	return nil
}

// checkFiles refuses names the archive could not write: bad names, the
// source file, and a path that is a file and also the directory of another
// one (or of the working directory).
func checkFiles(files map[string][]byte, source string) error {
	what := make(map[string]string, len(files)+1) // path -> what the message calls it
	for _, name := range sortedKeys(files) {
		p, err := filePath(name)
		if err != nil {
			return err
		}
		if p == source {
			return fmt.Errorf("%q is where the code goes (%s): rename it", name, source)
		}
		what[p] = strconv.Quote(name)
	}
	what[source] = "the code (" + source + ")"
	paths := slices.Sorted(maps.Keys(what))
	for _, p := range paths {
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if other, ok := what[d]; ok {
				return fmt.Errorf("%s is a file but %s needs it to be a directory", other, what[p])
			}
		}
	}
	return nil
}

// filePath resolves a Files or FetchFiles name to an absolute path.
// Absolute names may go anywhere (it is the caller's own sandbox); relative
// ones must stay inside WorkDir, where a "../" is most likely a mistake.
func filePath(name string) (string, error) {
	switch {
	case name == "":
		return "", errors.New("a file name is empty")
	case strings.IndexByte(name, 0) >= 0:
		return "", fmt.Errorf("file name %q contains a NUL byte", name)
	case strings.HasSuffix(name, "/"):
		return "", fmt.Errorf("file name %q names a directory", name)
	}
	if path.IsAbs(name) {
		p := path.Clean(name)
		if p == "/" {
			return "", fmt.Errorf("file name %q names a directory", name)
		}
		return p, nil
	}
	p := path.Join(WorkDir, name)
	if !strings.HasPrefix(p, WorkDir+"/") {
		return "", fmt.Errorf("file name %q leaves the working directory %s (use an absolute path)", name, WorkDir)
	}
	return p, nil
}

// Call runs req in sb, which must be clean (fresh or reset) and built from
// lang's image. base is the sandbox's resources: a per-call memory limit
// is set through runtime.Updater when sb has it, and base restored after
// (neither when the call's limit is base's).
// Call expects a request that passed Validate; StatusSandboxError is for
// faults of the sandbox (gone, a write or read that failed), which leave
// it unfit for reuse.
func Call(ctx context.Context, sb rt.Sandbox, lang Language, req Request, base rt.Resources) (resp Response) {
	fail := func(format string, args ...any) Response {
		resp.Status = StatusSandboxError
		resp.Message = fmt.Sprintf(format, args...)
		return resp
	}
	if err := req.validate(lang); err != nil {
		return fail("invalid request (not validated): %v", err)
	}
	source := path.Join(WorkDir, lang.Source)
	expand := strings.NewReplacer("{workdir}", WorkDir, "{source}", source,
		"{binary}", path.Join(WorkDir, binaryName)).Replace

	// One round trip writes the working directory, the code and every
	// file: the cost of a call should be the program's.
	archive, err := buildArchive(source, req)
	if err != nil {
		return fail("pack files: %v", err)
	}
	if err := sb.PutArchive(ctx, "/", bytes.NewReader(archive)); err != nil {
		return fail("write files: %v", err)
	}

	want := req.MemoryLimitMB
	if want == 0 {
		want = lang.MemoryLimitMB
	}
	var limitMB int64 // the limit in force, for messages
	if u, ok := sb.(rt.Updater); ok && want > 0 && want<<20 != base.MemoryBytes {
		r := base
		r.MemoryBytes = want << 20
		if err := u.Update(ctx, r); err != nil {
			return fail("set memory limit to %d MB: %v", want, err)
		}
		limitMB = want
		defer func() {
			// Restored even when ctx is done: the sandbox outlives the
			// call. If it cannot be, the sandbox is unfit for the next
			// call: a SandboxError makes the caller discard it.
			if err := u.Update(context.WithoutCancel(ctx), base); err != nil {
				msg := fmt.Sprintf("restore resources after the call: %v", err)
				if resp.Message != "" {
					msg += " (the call: " + resp.Status + ", " + resp.Message + ")"
				}
				resp.Status, resp.Message = StatusSandboxError, msg
			}
		}()
	} else if base.MemoryBytes > 0 {
		limitMB = base.MemoryBytes >> 20
	}

	env := make([]string, len(lang.Env))
	for i, e := range lang.Env {
		env[i] = expand(e)
	}
	step := func(argv []string, timeout time.Duration, stdin []byte, fork bool) (*CommandResult, error) {
		er := rt.ExecRequest{
			Argv:           argv,
			Env:            env,
			Cwd:            WorkDir,
			Stdin:          stdin,
			Timeout:        timeout,
			MaxOutputBytes: req.MaxOutputBytes,
		}
		var (
			res rt.ExecResult
			err error
		)
		forker, ok := sb.(rt.Forker)
		if server := forkServerArgv(lang); fork && ok && server != nil {
			// The sandbox keeps the server across resets: a call forks a
			// pre-started interpreter instead of starting one.
			res, err = forker.ForkExec(ctx, rt.ForkServer{Argv: server, Env: env}, er)
			fork = !errors.Is(err, rt.ErrForkServer)
		} else {
			fork = false
		}
		if !fork {
			res, err = sb.Exec(ctx, er, nil)
		}
		cr := &CommandResult{
			Status:          CommandFinished,
			ExecutionTime:   res.Duration,
			ReturnCode:      res.ExitCode,
			Signal:          res.Signal,
			Stdout:          res.Stdout,
			Stderr:          res.Stderr,
			StdoutTruncated: res.StdoutTruncated,
			StderrTruncated: res.StderrTruncated,
			OOMKilled:       res.OOMKilled,
		}
		switch {
		case err != nil:
			cr.Status = CommandError
		case res.TimedOut:
			cr.Status = CommandTimeLimitExceeded
		}
		return cr, err
	}

	if lang.Compiled() {
		argv := make([]string, len(lang.Compile))
		for i, a := range lang.Compile {
			argv[i] = expand(a)
		}
		timeout := orDefault(req.CompileTimeout, DefaultCompileTimeout)
		resp.Compile, err = step(argv, timeout, nil, false)
		if err != nil {
			return fail("compile: %v", err)
		}
		if why := failure(resp.Compile, timeout, limitMB); why != "" {
			resp.Status = StatusFailed
			resp.Message = "compile: " + why
			return fetch(ctx, sb, req, resp)
		}
	}

	argv := make([]string, 0, len(lang.Run)+len(req.Args))
	for _, a := range lang.Run {
		argv = append(argv, expand(a))
	}
	argv = append(argv, req.Args...)
	timeout := orDefault(req.RunTimeout, DefaultRunTimeout)
	resp.Run, err = step(argv, timeout, req.Stdin, true)
	if err != nil {
		return fail("run: %v", err)
	}
	resp.Status = StatusSuccess
	if why := failure(resp.Run, timeout, limitMB); why != "" {
		resp.Status = StatusFailed
		resp.Message = "run: " + why
	}
	return fetch(ctx, sb, req, resp)
}

// failure says why a finished step failed, or "" if it succeeded.
func failure(c *CommandResult, timeout time.Duration, limitMB int64) string {
	switch {
	case c.Status == CommandTimeLimitExceeded:
		return fmt.Sprintf("time limit of %v exceeded", timeout)
	case c.OOMKilled && limitMB > 0:
		return fmt.Sprintf("killed at the memory limit of %d MB", limitMB)
	case c.OOMKilled:
		return "killed at the memory limit"
	case c.Signal != 0:
		return fmt.Sprintf("killed by signal %d", c.Signal)
	case c.ReturnCode != 0:
		return fmt.Sprintf("exit code %d", c.ReturnCode)
	}
	return ""
}

// fetch reads req.FetchFiles into resp.Files. A missing file is left out
// and a file that cannot be read (a directory, too large) is named in the
// message; only a sandbox fault turns the response into a SandboxError.
func fetch(ctx context.Context, sb rt.Sandbox, req Request, resp Response) Response {
	var problems []string
	// The files are buffered whole, here and in every hop's message: they
	// share one bound, whatever their number.
	left := int64(MaxFetchBytes)
	for _, name := range req.FetchFiles {
		if _, done := resp.Files[name]; done {
			continue
		}
		p, _ := filePath(name) // validated
		if left <= 0 {
			problems = append(problems, fmt.Sprintf("fetch %s: the call's fetched files already take the %d bytes they may", name, MaxFetchBytes))
			continue
		}
		data, err := sb.ReadFile(ctx, p, left)
		switch {
		case err == nil:
			if resp.Files == nil {
				resp.Files = map[string][]byte{}
			}
			resp.Files[name] = data
			left -= int64(len(data))
		case errors.Is(err, rt.ErrTooLarge):
			problems = append(problems, fmt.Sprintf("fetch %s: larger than the %d bytes left of the %d the call's fetched files may take", name, left, MaxFetchBytes))
		case errors.Is(err, fs.ErrNotExist):
		case errors.Is(err, rt.ErrSandboxGone) || ctx.Err() != nil:
			resp.Status = StatusSandboxError
			resp.Message = fmt.Sprintf("fetch %s: %v", name, err)
			return resp
		default:
			problems = append(problems, fmt.Sprintf("fetch %s: %v", name, err))
		}
	}
	if len(problems) > 0 {
		if resp.Message != "" {
			problems = slices.Insert(problems, 0, resp.Message)
		}
		resp.Message = strings.Join(problems, "; ")
	}
	return resp
}

// buildArchive packs the working directory, the source and req.Files as
// one tar stream rooted at "/".
func buildArchive(source string, req Request) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	now := time.Now()
	rel := func(p string) string { return strings.TrimPrefix(p, "/") }
	// World-writable: the image may run calls as a user other than root,
	// and the program and compilers write next to the source.
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: rel(WorkDir) + "/", Mode: 0o777, ModTime: now}); err != nil {
		return nil, err
	}
	add := func(p string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: rel(p), Mode: 0o644, Size: int64(len(data)), ModTime: now}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	if err := add(source, []byte(req.Code)); err != nil {
		return nil, err
	}
	for _, name := range sortedKeys(req.Files) {
		p, err := filePath(name)
		if err != nil {
			return nil, err
		}
		if err := add(p, req.Files[name]); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func sortedKeys(m map[string][]byte) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// orDefault returns d, or def when d is zero.
func orDefault(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}
