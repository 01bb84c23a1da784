package fullvm

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/agentconv"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// template is the boot template of one machine (see the package doc):
// a frozen overlay of the base disk and the saved state of the VM that
// ran on it, taken when its guest had just opened the agent's port.
type template struct {
	dir string
	// sem is held by the create that makes the template (one cold boot,
	// not one per concurrent create); a context can give up waiting on it.
	sem   chan struct{}
	ready bool // guarded by sem
}

func (t *template) disk() string  { return filepath.Join(t.dir, "disk.qcow2") }
func (t *template) state() string { return filepath.Join(t.dir, "state") }

// fromTemplate restores the machine's template, making it first (by a
// cold boot that saves it on the way) when there is none.
func (b *Backend) fromTemplate(ctx context.Context, spec runtime.Spec, m machine, dir string) (runtime.Sandbox, error) {
	key := m.key()
	b.mu.Lock()
	t := b.tmpls[key]
	if t == nil {
		t = &template{dir: filepath.Join(b.tmplDir, key), sem: make(chan struct{}, 1)}
		b.tmpls[key] = t
	}
	b.mu.Unlock()
	select {
	case t.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, fail.New(ctxKind(ctx), fmt.Errorf("fullvm: sandbox %q: waiting for its boot template: %w", spec.ID, ctx.Err()))
	}
	if t.ready {
		<-t.sem
		return b.restore(ctx, spec, m, dir, t)
	}
	defer func() { <-t.sem }()
	return b.boot(ctx, spec, m, dir, t)
}

// boot starts a sandbox from its base disk; with t, it saves the boot
// template of its machine on the way.
func (b *Backend) boot(ctx context.Context, spec runtime.Spec, m machine, dir string, t *template) (runtime.Sandbox, error) {
	if err := b.overlay(ctx, filepath.Join(dir, "disk.qcow2"), m.base, m.format); err != nil {
		return nil, err
	}
	vm, err := qemu.Start(ctx, b.config(m, dir))
	if err != nil {
		return nil, err
	}
	ev, err := vm.WatchEvents(ctx)
	if err != nil {
		vm.Kill()
		return nil, err
	}
	if t != nil {
		if err := b.saveTemplate(ctx, vm, ev, dir, t); err != nil {
			if isGone(vm) || ctx.Err() != nil {
				vm.Kill()
				return nil, err
			}
			// The sandbox itself is fine: it runs cold-booted, and the
			// next create tries to make the template again.
			slog.Warn("fullvm: boot template not saved", "sandbox", spec.ID, "err", err)
		}
		// Paused for the save (or by a save that failed half way).
		if err := ev.ContAfterSave(ctx); err != nil {
			vm.Kill()
			return nil, err
		}
	}
	return b.finish(ctx, spec, vm, ev, dir)
}

func isGone(vm *qemu.VM) bool {
	select {
	case <-vm.Done():
		return true
	default:
		return false
	}
}

// saveTemplate waits until the guest has opened the agent's port, pauses
// the VM, and saves its state and a copy of its overlay as t; the VM
// stays paused (ContAfterSave resumes it).
// Nothing has gone over the agent channel yet: a restored guest's agent
// has read nothing and answers a new client as it would have this one.
func (b *Backend) saveTemplate(ctx context.Context, vm *qemu.VM, ev *qemu.Events, dir string, t *template) (err error) {
	bootCtx, cancel := context.WithTimeout(ctx, b.opts.BootTimeout)
	defer cancel()
	if err := ev.WaitAgentPort(bootCtx); err != nil {
		return b.bootErr(vm, dir, err)
	}
	if err := vm.Stop(ctx); err != nil {
		return err
	}
	if err := os.MkdirAll(t.dir, 0o700); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(t.dir)
		}
	}()
	tmp := t.state() + ".tmp"
	if err := ev.SaveState(ctx, tmp); err != nil {
		os.Remove(tmp)
		return err
	}
	// QEMU flushed and released the overlay when the migration completed;
	// it is one consistent disk with the saved state until Cont.
	if err := copyFile(filepath.Join(dir, "disk.qcow2"), t.disk()); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, t.state()); err != nil {
		return err
	}
	t.ready = true
	return nil
}

// restore starts a sandbox from t: a fresh overlay over t's frozen one,
// and QEMU loading t's state.
func (b *Backend) restore(ctx context.Context, spec runtime.Spec, m machine, dir string, t *template) (runtime.Sandbox, error) {
	if err := b.overlay(ctx, filepath.Join(dir, "disk.qcow2"), t.disk(), "qcow2"); err != nil {
		return nil, err
	}
	cfg := b.config(m, dir)
	// "defer": the state is loaded once the events that say it has
	// loaded are turned on (LoadState).
	cfg.Args = append(cfg.Args, "-incoming", "defer")
	vm, err := qemu.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	ev, err := vm.WatchEvents(ctx)
	if err != nil {
		vm.Kill()
		return nil, err
	}
	// The saved VM was paused, and so is this one once loaded.
	if err := ev.LoadState(ctx, t.state()); err != nil {
		vm.Kill()
		return nil, err
	}
	if err := vm.Cont(ctx); err != nil {
		vm.Kill()
		return nil, err
	}
	return b.finish(ctx, spec, vm, ev, dir)
}

// finish waits for the guest's agent and gives the sandbox what must be
// its own: the hostname, and the host's clock (a restored guest's clock
// says when its template was saved).
func (b *Backend) finish(ctx context.Context, spec runtime.Spec, vm *qemu.VM, ev *qemu.Events, dir string) (_ runtime.Sandbox, err error) {
	defer func() {
		if err != nil {
			vm.Kill()
		}
	}()
	client := vm.Agent()
	bootCtx, cancel := context.WithTimeout(ctx, b.opts.BootTimeout)
	defer cancel()
	if err := client.Ping(bootCtx); err != nil {
		return nil, b.bootErr(vm, dir, err)
	}
	hostname := spec.Hostname
	if hostname == "" {
		hostname = runtime.HostnameFor(spec.ID)
	}
	now := time.Now()
	// Both checked by validate: a hostname of safe characters, a number.
	script := "hostname " + hostname + " && date -u -s @" + strconv.FormatInt(now.Unix(), 10) + "." + fmt.Sprintf("%09d", now.Nanosecond()) + " >/dev/null"
	res, err := client.Exec(ctx, agent.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, User: "root", Cwd: "/"}, nil)
	if err != nil {
		return nil, agentconv.Err(err)
	}
	if res.ExitCode != 0 {
		return nil, fail.Errorf(fail.Internal, "fullvm: sandbox %q: setting hostname and clock: exit %d: %s", spec.ID, res.ExitCode, res.Stderr)
	}
	return newSandbox(b, spec, vm, ev, dir), nil
}

// bootErr explains a boot that did not reach the agent: the end of the
// guest's console says why more often than QEMU does.
func (b *Backend) bootErr(vm *qemu.VM, dir string, err error) error {
	tail := consoleTail(filepath.Join(dir, "console.log"), 2000)
	if isGone(vm) {
		return fail.Errorf(fail.Internal, "fullvm: qemu exited during boot (%s); console: %s", vm.Stderr(), tail)
	}
	return fail.New(fail.KindOf(err), fmt.Errorf("fullvm: guest agent not ready: %w; console: %s", err, tail))
}

func consoleTail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return "(none)"
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		f.Seek(st.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	return string(b)
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o400)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func ctxKind(ctx context.Context) fail.Kind {
	if ctx.Err() == context.DeadlineExceeded {
		return fail.DeadlineExceeded
	}
	return fail.Canceled
}
