package main

import (
	"context"
	"fmt"
	"sort"
	"strings"
)

// System is one way of running a sandbox that the harness measures. Every
// method may block, so each takes a context; Cycle and StartIdle must be safe
// for concurrent use because the throughput phase runs C of them at once.
type System interface {
	// Name is the row label and the -systems key.
	Name() string
	// Setup prepares shared state (bundles, daemons, images) before any
	// timing starts; env.WorkDir is private to this system.
	Setup(ctx context.Context, env Env) error
	// Cycle creates a sandbox, runs /bin/true in it, checks that it exited
	// 0, and destroys the sandbox: the unit the latency and throughput
	// figures are made of.
	Cycle(ctx context.Context) error
	// StartIdle creates sandbox number i running something idle (sleep or
	// the system's own init) and returns once it is running. stop destroys
	// it.
	StartIdle(ctx context.Context, i int) (stop func(context.Context) error, err error)
	// Teardown removes everything Setup and the sandboxes left behind, even
	// after a failed or cancelled phase.
	Teardown(ctx context.Context) error
}

// CgroupMeter is implemented by systems whose sandboxes live under one
// cgroup subtree, so the harness can report their summed memory charge
// beside the host-wide figure.
type CgroupMeter interface {
	// CgroupMemory returns the memory charged to all of this system's
	// sandboxes right now, in bytes.
	CgroupMemory() (int64, error)
}

// Env is what the harness hands every system: the same busybox root file
// system for all of them, and a scratch directory of their own.
type Env struct {
	// Rootfs is the busybox tree; systems must treat it as read-only and
	// give each sandbox its own writable layer where they can.
	Rootfs string
	// RootfsEROFS is the same tree packed as an EROFS image, for systems
	// (DSec) that take layers rather than directories.
	RootfsEROFS string
	// WorkDir is empty at Setup and removed by the harness after Teardown.
	WorkDir string
	// SelfExe is the harness binary, for systems that re-exec helpers.
	SelfExe string
	// PoolSize is the ready target of pooled systems (-pool-size).
	PoolSize int
}

// entry describes how the harness must host a system's worker process.
type entry struct {
	name string
	new  func() System
	// peer marks the third-party systems that get -peer-idle sandboxes
	// instead of -idle in the memory phase, because they are slow to start.
	peer bool
	// privateMounts runs the worker in its own mount namespace so that the
	// per-sandbox overlays it mounts never appear in, or leak into, the
	// host's mount table.
	privateMounts bool
	// hideCgroup2 unmounts /sys/fs/cgroup/unified inside that namespace:
	// crun refuses the hybrid v1+v2 layout of this host otherwise.
	hideCgroup2 bool
	// noIdle, when set, says why the system has no idle-memory figure;
	// the harness skips that phase for it and prints n/a.
	noIdle string
}

var registry = []entry{
	{name: "host-exec", new: newHostExec},
	{name: "ns-spawn", new: newNSSpawn},
	{name: "dsec", new: newDSec},
	{name: "dsec-cold", new: newDSecCold},
	{name: "dsec-pool", new: newDSecPool, noIdle: "an idle pooled sandbox is the dsec row's sandbox"},
	{name: "dsec-rebase", new: newDSecRebase, noIdle: "an idle rebased sandbox is the dsec row's sandbox"},
	{name: "crun", new: func() System { return newOCI("crun") }, peer: true, privateMounts: true, hideCgroup2: true},
	{name: "runc", new: func() System { return newOCI("runc") }, peer: true, privateMounts: true},
	{name: "bwrap", new: newBwrap, peer: true},
	{name: "docker-nonet", new: func() System { return newDocker(false) }, peer: true, privateMounts: true},
	{name: "docker", new: func() System { return newDocker(true) }, peer: true, privateMounts: true},
}

func lookup(name string) (entry, error) {
	for _, e := range registry {
		if e.name == name {
			return e, nil
		}
	}
	names := make([]string, 0, len(registry))
	for _, e := range registry {
		names = append(names, e.name)
	}
	sort.Strings(names)
	return entry{}, fmt.Errorf("unknown system %q in -systems (known: %s)", name, strings.Join(names, ", "))
}
