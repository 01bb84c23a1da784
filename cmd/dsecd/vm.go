package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/fullvm"
	"github.com/dsec-dev/dsec/internal/runtime/microvm"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// The VM backends (microvm, fullvm) beside the container backend: on by
// default where QEMU is installed (`make up` installs it), off with a
// reason otherwise, and `dsec up` says which.

// vmFlags are an edge's --vm and --max-vms.
type vmFlags struct {
	mode   string
	maxVMs int64
	// status is the line `dsec up` prints: which VM backends run, or why
	// none does. Set by open.
	status string
}

// defaultMaxVMs bounds each VM backend's sandboxes on a node: a guest
// holds its RAM (128 MiB and up) and, under TCG, a host thread busy while
// it computes.
const defaultMaxVMs = 64

// vmPrepareTimeout bounds a microVM's first-use preparation (fetching the
// guest kernel with apt on a new machine, building its initramfs).
const vmPrepareTimeout = 5 * time.Minute

func (v *vmFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&v.mode, "vm", "auto", "VM backends (microvm, fullvm): auto (where QEMU is installed), on (fail without them) or off")
	fl.Int64Var(&v.maxVMs, "max-vms", defaultMaxVMs, "most sandboxes of each VM backend on this node")
}

func (v *vmFlags) validate() error {
	switch v.mode {
	case "auto", "on", "off":
	default:
		return cli.Usagef("--vm %q: want auto, on or off", v.mode)
	}
	if v.maxVMs < 1 {
		return cli.Usagef("--max-vms %d: must be at least 1", v.maxVMs)
	}
	return nil
}

// open builds the VM backends into backends and capacity. With --vm auto
// a backend that cannot start is left out (status says why); with --vm on
// that is an error.
func (v *vmFlags) open(ctx context.Context, dataDir, agentPath string, defaultMemory int64, node placement.Capacity,
	backends map[runtime.Kind]runtime.Backend, capacity map[runtime.Kind]placement.Capacity, log *slog.Logger) error {
	if v.mode == "off" {
		v.status = "VM backends: off (--vm off)"
		return nil
	}
	if !qemu.Available() {
		if v.mode == "on" {
			return fmt.Errorf("--vm on: %s is not installed (scripts/deps.sh installs qemu-system-x86)", qemu.Binary)
		}
		v.status = fmt.Sprintf("VM backends: off (%s not installed; `make up` installs it)", qemu.Binary)
		return nil
	}
	if agentPath == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("VM backends: find dsec-agent: %w", err)
		}
		agentPath = filepath.Join(filepath.Dir(exe), "dsec-agent")
	}
	accel := qemu.Accel()
	var on, off []string
	add := func(kind runtime.Kind, b runtime.Backend, err error) error {
		if err != nil {
			if v.mode == "on" {
				return fmt.Errorf("--vm on: %s backend: %w", kind, err)
			}
			log.Warn("VM backend off", "backend", kind, "err", err)
			off = append(off, fmt.Sprintf("%s: %v", kind, err))
			return nil
		}
		backends[kind] = b
		// The node's CPU and memory (--cpu, --memory) bound every
		// backend; the count is the VM backend's own.
		c := node
		c.Sandboxes = v.maxVMs
		capacity[kind] = c
		on = append(on, string(kind))
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, vmPrepareTimeout)
	defer cancel()
	// Short state directories: QEMU's sockets live under them (108 bytes).
	mv, err := microvm.New(pctx, microvm.Options{
		StateDir:           filepath.Join(dataDir, "mv"),
		AgentPath:          agentPath,
		Accel:              accel,
		DefaultMemoryBytes: defaultMemory,
		Logger:             log,
	})
	if err := add(runtime.KindMicroVM, backendOrNil(mv, err), err); err != nil {
		return err
	}
	fv, err := fullvm.New(fullvm.Options{
		StateDir:           filepath.Join(dataDir, "fv"),
		AgentPath:          agentPath,
		Accel:              accel,
		DefaultMemoryBytes: defaultMemory,
	})
	if err := add(runtime.KindFullVM, backendOrNil(fv, err), err); err != nil {
		return err
	}
	switch {
	case len(on) == 0:
		v.status = "VM backends: off (" + strings.Join(off, "; ") + ")"
	default:
		v.status = fmt.Sprintf("VM backends: %s (QEMU, %s)", strings.Join(on, ", "), accel)
		if len(off) > 0 {
			v.status += "; off: " + strings.Join(off, "; ")
		}
	}
	return nil
}

// backendOrNil keeps a typed nil pointer out of the Backends map.
func backendOrNil[B runtime.Backend](b B, err error) runtime.Backend {
	if err != nil {
		return nil
	}
	return b
}
