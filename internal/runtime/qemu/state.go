package qemu

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/fail"
)

// Events follows the QMP events of one VM that the fullvm backend waits
// on: the state of a migration (MIGRATION), and a guest opening a
// virtio-serial port that has an id (VSERPORT_CHANGE). It must be made once per VM
// (WatchEvents): QMP's event stream has a single reader, which drains
// it until QEMU goes, since an event nobody reads would block the replies
// to commands behind it.
type Events struct {
	vm      *VM
	mu      sync.Mutex
	changed chan struct{} // closed and replaced at every event
	ports   map[string]bool
	migr    string // last MIGRATION status
	migrGen int    // counts MIGRATION events
}

// WatchEvents starts reading vm's QMP events. Call it once per VM, right
// after Start: events sent before it are not seen.
func (vm *VM) WatchEvents(ctx context.Context) (*Events, error) {
	ch, err := vm.mon.Events(ctx)
	if err != nil {
		return nil, fail.Errorf(fail.Internal, "qemu: events: %w", err)
	}
	e := &Events{vm: vm, changed: make(chan struct{}), ports: map[string]bool{}}
	// Ends when the monitor is disconnected (Kill, Quit), which closes ch.
	go func() {
		for ev := range ch {
			e.mu.Lock()
			switch ev.Event {
			case "VSERPORT_CHANGE":
				id, _ := ev.Data["id"].(string)
				open, _ := ev.Data["open"].(bool)
				e.ports[id] = open
			case "MIGRATION":
				e.migr, _ = ev.Data["status"].(string)
				e.migrGen++
			}
			close(e.changed)
			e.changed = make(chan struct{})
			e.mu.Unlock()
		}
	}()
	return e, nil
}

// wait blocks until cond (called with e.mu held) holds, ctx ends or QEMU
// exits.
func (e *Events) wait(ctx context.Context, what string, cond func() bool) error {
	for {
		e.mu.Lock()
		ok, ch := cond(), e.changed
		e.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fail.New(ctxKind(ctx.Err()), fmt.Errorf("qemu: waiting for %s: %w", what, ctx.Err()))
		case <-e.vm.done:
			return fail.Errorf(fail.Internal, "qemu: waiting for %s: qemu exited (%v): %s", what, e.vm.waitErr, e.vm.Stderr())
		}
	}
}

// WaitAgentPort waits until the guest has opened the agent's
// virtio-serial port. The guest's agent (its unit opens the port, then
// runs dsec-agent on it) is then as good as ready, and nothing has been
// sent on the channel yet, which is what a saved template must hold (see
// SaveState).
//
// QEMU announces a guest opening a port (VSERPORT_CHANGE) only for port
// devices that have an id, and Start gives the agent's port none; so
// this asks QMP query-chardev, whose frontend-open for the agent's
// chardev is the same flag, every pollInterval until it is set. (With an
// id on the port, the event would do: see the report to the lead.)
func (e *Events) WaitAgentPort(ctx context.Context) error {
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for {
		raw, err := e.vm.Run(ctx, "query-chardev", nil)
		if err != nil {
			return err
		}
		var devs []struct {
			Label        string `json:"label"`
			FrontendOpen bool   `json:"frontend-open"`
		}
		if err := json.Unmarshal(raw, &devs); err != nil {
			return fail.Errorf(fail.Internal, "qemu: query-chardev: %w", err)
		}
		for _, d := range devs {
			if d.Label == "agent" && d.FrontendOpen {
				return nil
			}
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return fail.New(ctxKind(ctx.Err()), fmt.Errorf("qemu: waiting for the guest to open the agent port: %w", ctx.Err()))
		case <-e.vm.done:
			return fail.Errorf(fail.Internal, "qemu: waiting for the guest to open the agent port: qemu exited (%v): %s", e.vm.waitErr, e.vm.Stderr())
		}
	}
}

// pollInterval is how often WaitAgentPort asks; a boot takes seconds.
const pollInterval = 100 * time.Millisecond

// ContAfterSave resumes a VM paused by SaveState (or any paused VM).
// QEMU announces a completed migration before it has left its
// finish-migrate state, in which it refuses cont ("Migration is not
// finalized yet"); so this waits, asking query-status every
// pollInterval, until the VM is out of it.
func (e *Events) ContAfterSave(ctx context.Context) error {
	t := time.NewTicker(pollInterval / 10)
	defer t.Stop()
	for {
		st, err := e.vm.Status(ctx)
		if err != nil {
			return err
		}
		if st != "finish-migrate" {
			return e.vm.Cont(ctx)
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return fail.New(ctxKind(ctx.Err()), fmt.Errorf("qemu: cont after save: %w", ctx.Err()))
		}
	}
}

// LoadState loads the state SaveState wrote into a VM started with
// "-incoming defer" (and the same devices) and returns once it has
// loaded. The VM is then paused, as the saved one was: Cont runs it.
func (e *Events) LoadState(ctx context.Context, path string) error {
	if strings.ContainsAny(path, "'\n") {
		return fail.Errorf(fail.InvalidArgument, "qemu: load state: path %q has a quote or a newline", path)
	}
	return e.migrate(ctx, "migrate-incoming", "exec:cat '"+path+"'", "load state")
}

// SaveState writes the VM's whole state (devices and RAM) to the file
// path with a QMP migrate to "exec:cat > path", and returns when it is
// complete. The caller stops the VM first (so the state is one consistent
// moment and RAM is sent once); after it the VM is paused in QEMU's
// postmigrate state, which Cont resumes. A new QEMU started with the same
// devices and "-incoming exec:cat path" continues from that moment.
func (e *Events) SaveState(ctx context.Context, path string) error {
	if strings.ContainsAny(path, "'\n") {
		return fail.Errorf(fail.InvalidArgument, "qemu: save state: path %q has a quote or a newline", path)
	}
	vm := e.vm
	if _, err := vm.Run(ctx, "migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": "events", "state": true}},
	}); err != nil {
		return err
	}
	// The default bandwidth cap (32 MiB/s) is for live migration over a
	// network; a file on this host takes whatever comes.
	if _, err := vm.Run(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}); err != nil {
		return err
	}
	return e.migrate(ctx, "migrate", "exec:cat > '"+path+"'", "save state")
}

// migrate runs the QMP migration command (migrate, migrate-incoming) to
// uri and waits for the migration's end (MIGRATION events).
func (e *Events) migrate(ctx context.Context, command, uri, what string) error {
	vm := e.vm
	if command == "migrate-incoming" {
		if _, err := vm.Run(ctx, "migrate-set-capabilities", map[string]any{
			"capabilities": []map[string]any{{"capability": "events", "state": true}},
		}); err != nil {
			return err
		}
	}
	e.mu.Lock()
	gen := e.migrGen
	e.mu.Unlock()
	if _, err := vm.Run(ctx, command, map[string]any{"uri": uri}); err != nil {
		return err
	}
	var status string
	err := e.wait(ctx, what, func() bool {
		if e.migrGen == gen {
			return false
		}
		status = e.migr
		return status == "completed" || status == "failed" || status == "cancelled"
	})
	if err != nil {
		return err
	}
	if status != "completed" {
		raw, _ := vm.Run(ctx, "query-migrate", nil)
		var q struct {
			ErrorDesc string `json:"error-desc"`
		}
		json.Unmarshal(raw, &q)
		return fail.Errorf(fail.Internal, "qemu: %s: migration %s: %s (%s)", what, status, q.ErrorDesc, vm.Stderr())
	}
	return nil
}
