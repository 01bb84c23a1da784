package fullvm

import (
	"bytes"
	"context"
	"fmt"
	"image/png"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/agentconv"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// Sandbox is one fullvm sandbox: a QEMU process, its overlay and its
// directory.
type Sandbox struct {
	b      *Backend
	id     string
	spec   runtime.Spec
	dir    string
	vm     *qemu.VM
	ev     *qemu.Events
	client *agent.Client

	// mu guards frozen and destroyed, and orders Freeze, Thaw, Destroy and
	// SnapshotDisk against each other.
	mu        sync.Mutex
	frozen    bool
	destroyed bool
}

var (
	_ runtime.Sandbox = (*Sandbox)(nil)
	_ runtime.Display = (*Sandbox)(nil)
)

func newSandbox(b *Backend, spec runtime.Spec, vm *qemu.VM, ev *qemu.Events, dir string) *Sandbox {
	return &Sandbox{b: b, id: spec.ID, spec: spec, dir: dir, vm: vm, ev: ev, client: vm.Agent()}
}

// ID is the sandbox's ID.
func (s *Sandbox) ID() string { return s.id }

// Done is closed when QEMU has exited.
func (s *Sandbox) Done() <-chan struct{} { return s.vm.Done() }

// Exec runs req in the guest through the agent. The spec's exec defaults
// (env, workdir, user) apply here, on the host: the guest's agent is the
// image's, started by its unit, and takes no Init.
func (s *Sandbox) Exec(ctx context.Context, req runtime.ExecRequest, out runtime.OutputFunc) (runtime.ExecResult, error) {
	r := agentconv.ExecRequest(req)
	r.Env = mergeEnv(s.spec.Env, req.Env)
	if r.Cwd == "" {
		r.Cwd = s.spec.Workdir
	}
	if r.User == "" {
		r.User = s.spec.User
	}
	res, err := s.client.Exec(ctx, r, agentconv.Output(out))
	if err != nil {
		return runtime.ExecResult{}, s.err(err)
	}
	return agentconv.ExecResult(res), nil
}

// mergeEnv is defaults overridden by req, key by key (the agent's rule
// for its own defaults), in first-seen order.
func mergeEnv(defaults, req []string) []string {
	if len(defaults) == 0 {
		return req
	}
	idx := map[string]int{}
	var env []string
	for _, kv := range append(append([]string(nil), defaults...), req...) {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := idx[k]; ok {
			env[i] = kv
			continue
		}
		idx[k] = len(env)
		env = append(env, kv)
	}
	return env
}

// err gives an agent error the runtime's meaning; a lost channel of a
// VM that exited is the sandbox gone.
func (s *Sandbox) err(err error) error {
	return agentconv.Err(err)
}

// WriteFile writes a file in the guest.
func (s *Sandbox) WriteFile(ctx context.Context, path string, data []byte, mode uint32) error {
	return s.err(s.client.WriteFile(ctx, path, data, mode))
}

// ReadFile reads a file of the guest.
func (s *Sandbox) ReadFile(ctx context.Context, path string, maxBytes int64) ([]byte, error) {
	b, err := s.client.ReadFile(ctx, path, maxBytes)
	return b, s.err(err)
}

// PutArchive extracts a tar stream into dir in the guest.
func (s *Sandbox) PutArchive(ctx context.Context, dir string, r io.Reader) error {
	return s.err(s.client.PutArchive(ctx, dir, r))
}

// GetArchive writes dir of the guest as a tar stream.
func (s *Sandbox) GetArchive(ctx context.Context, dir string, w io.Writer) error {
	return s.err(s.client.GetArchive(ctx, dir, w))
}

// Freeze pauses the guest's vCPUs (QMP stop).
func (s *Sandbox) Freeze(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fail.New(fail.FailedPrecondition, fmt.Errorf("fullvm: freeze %q: %w", s.id, runtime.ErrSandboxGone))
	}
	if s.frozen {
		return nil
	}
	if err := s.vm.Stop(ctx); err != nil {
		return s.gone("freeze", err)
	}
	s.frozen = true
	return nil
}

// Thaw resumes the guest's vCPUs (QMP cont).
func (s *Sandbox) Thaw(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fail.New(fail.FailedPrecondition, fmt.Errorf("fullvm: thaw %q: %w", s.id, runtime.ErrSandboxGone))
	}
	if !s.frozen {
		return nil
	}
	if err := s.vm.Cont(ctx); err != nil {
		return s.gone("thaw", err)
	}
	s.frozen = false
	return nil
}

// gone wraps err with ErrSandboxGone when QEMU has exited.
func (s *Sandbox) gone(op string, err error) error {
	if isGone(s.vm) {
		return fail.New(fail.FailedPrecondition, fmt.Errorf("fullvm: %s %q: %w: %w", op, s.id, runtime.ErrSandboxGone, err))
	}
	return err
}

// Destroy kills QEMU and removes the sandbox's directory (its overlay
// with it). It is idempotent.
func (s *Sandbox) Destroy(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return nil
	}
	s.vm.Kill()
	if err := os.RemoveAll(s.dir); err != nil {
		return fmt.Errorf("fullvm: destroy %q: %w", s.id, err)
	}
	s.destroyed = true
	s.b.release(s.id)
	return nil
}

// Screenshot returns the guest's screen as a PNG.
func (s *Sandbox) Screenshot(ctx context.Context) ([]byte, error) {
	b, err := s.vm.Screendump(ctx)
	if err != nil {
		return nil, s.gone("screenshot", err)
	}
	return b, nil
}

// Input sends keyboard and mouse events in order. Pointer positions are
// pixels of the screen as it is now (read from a screenshot), scaled to
// the tablet's absolute range.
func (s *Sandbox) Input(ctx context.Context, events []runtime.InputEvent) error {
	var w, h int
	var out []qemu.InputEvent
	for i, e := range events {
		switch e.Kind {
		case runtime.InputText:
			ev, err := qemu.TextEvents(e.Text)
			if err != nil {
				return fail.Errorf(fail.InvalidArgument, "events[%d].%w", i, err)
			}
			out = append(out, ev...)
		case runtime.InputKey:
			ev, err := qemu.ChordEvents(e.Key)
			if err != nil {
				return fail.Errorf(fail.InvalidArgument, "events[%d].%w", i, err)
			}
			out = append(out, ev...)
		case runtime.InputMove, runtime.InputClick:
			if w == 0 {
				var err error
				if w, h, err = s.screenSize(ctx); err != nil {
					return err
				}
			}
			if e.X < 0 || e.Y < 0 || e.X >= w || e.Y >= h {
				return fail.Errorf(fail.InvalidArgument, "events[%d]: position %d,%d is off the %dx%d screen", i, e.X, e.Y, w, h)
			}
			out = append(out, qemu.AbsEvent("x", scale(e.X, w)), qemu.AbsEvent("y", scale(e.Y, h)))
			if e.Kind == runtime.InputClick {
				button := e.Button
				switch button {
				case "":
					button = "left"
				case "left", "middle", "right":
				default:
					return fail.Errorf(fail.InvalidArgument, "events[%d].button %q: want left, middle or right", i, e.Button)
				}
				out = append(out, qemu.ButtonEvent(button, true), qemu.ButtonEvent(button, false))
			}
		default:
			return fail.Errorf(fail.InvalidArgument, "events[%d].kind %q: want text, key, move or click", i, e.Kind)
		}
	}
	if err := s.vm.InputSendEvent(ctx, out); err != nil {
		return s.gone("input", err)
	}
	return nil
}

// scale maps pixel p of a screen n pixels wide to the tablet's range.
func scale(p, n int) int {
	if n <= 1 {
		return 0
	}
	return p * qemu.AbsMax / (n - 1)
}

func (s *Sandbox) screenSize(ctx context.Context) (int, int, error) {
	b, err := s.Screenshot(ctx)
	if err != nil {
		return 0, 0, err
	}
	cfg, err := png.DecodeConfig(bytes.NewReader(b))
	if err != nil {
		return 0, 0, fail.Errorf(fail.Internal, "fullvm: screenshot: %w", err)
	}
	return cfg.Width, cfg.Height, nil
}

// SnapshotDisk writes the sandbox's disk as it is now to out, as a new
// standalone qcow2 (no backing file) that `dsec image import --disk` takes
// and a fullvm sandbox boots: the guest's file systems are synced (the
// agent runs sync), the vCPUs paused so nothing changes meanwhile, and the
// overlay with everything under it converted into one image by qemu-img.
// The host reads image files only, never the guest's file system. A
// frozen sandbox stays frozen (and is not synced: its processes cannot
// run; what they wrote before the freeze is in the guest's page cache
// unless they synced it); a running one runs again afterwards.
func (s *Sandbox) SnapshotDisk(ctx context.Context, out string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fail.New(fail.FailedPrecondition, fmt.Errorf("fullvm: snapshot %q: %w", s.id, runtime.ErrSandboxGone))
	}
	if !s.frozen {
		res, err := s.client.Exec(ctx, agent.ExecRequest{Argv: []string{"sync"}, User: "root", Cwd: "/"}, nil)
		if err != nil {
			return s.err(err)
		}
		if res.ExitCode != 0 {
			return fail.Errorf(fail.Internal, "fullvm: snapshot %q: sync: exit %d: %s", s.id, res.ExitCode, res.Stderr)
		}
		// Stopping drains QEMU's in-flight I/O and flushes its caches
		// to the overlay file.
		if err := s.vm.Stop(ctx); err != nil {
			return s.gone("snapshot", err)
		}
		defer s.vm.Cont(context.WithoutCancel(ctx))
	}
	tmp := out + ".tmp"
	// -U: QEMU holds the overlay's write lock; the VM is paused, so
	// reading it under the lock is safe.
	cmd := exec.CommandContext(ctx, s.b.opts.QEMUImg, "convert", "-U", "-q", "-f", "qcow2", "-O", "qcow2",
		filepath.Join(s.dir, "disk.qcow2"), tmp)
	if b, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return fail.Errorf(fail.Internal, "fullvm: snapshot %q: qemu-img convert: %v: %s", s.id, err, b)
	}
	if err := os.Rename(tmp, out); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("fullvm: snapshot %q: %w", s.id, err)
	}
	return nil
}
