// Package runtime defines the seam every sandbox backend implements
// (container, fncall, microvm, fullvm): create a sandbox from an ordered list
// of read-only layers and resources, then exec, move files and destroy it.
//
// The edge talks only to this interface; each backend has its own package
// under internal/runtime and runs the shared conformance suite in
// internal/runtime/testsuite.
package runtime

import (
	"context"
	"errors"
	"io"
	"time"
)

// Kind names a backend; it is the value of the sandbox spec's backend field.
type Kind string

// The backends DSec knows about.
const (
	KindContainer Kind = "container"
	KindFnCall    Kind = "fncall"
	KindMicroVM   Kind = "microvm"
	KindFullVM    Kind = "fullvm"
)

// Errors every backend reports the same way, so that the API layer can map
// them to one status code.
var (
	// ErrInvalidSpec wraps a spec the backend refuses (the message names the field).
	ErrInvalidSpec = errors.New("invalid sandbox spec")
	// ErrSandboxGone is returned by operations on a sandbox that was destroyed
	// or whose init process died: an infrastructure failure, not a task failure.
	ErrSandboxGone = errors.New("sandbox is gone")
	// ErrForkServer: the sandbox could not start or reach its fork server
	// (ForkExec); the caller may run the exec the ordinary way.
	ErrForkServer = errors.New("fork server unavailable")
	// ErrTooLarge: ReadFile found the file larger than its bound (the
	// caller's to fix, not a failure of the sandbox).
	ErrTooLarge = errors.New("file is larger than the bound")
	// ErrFailedPrecondition: the sandbox's own state refuses a file
	// operation (not a regular file, larger than the caller's bound, an
	// I/O error of its file system, a full disk): the workload's or the
	// caller's doing, never a platform failure (Connect FailedPrecondition).
	ErrFailedPrecondition = errors.New("failed precondition")
	// ErrBusy: the node was too busy to bring the sandbox up in time (its
	// CPU saturated by other sandboxes' work). Nothing is wrong with the
	// spec or the node: the create is refused, and tried again elsewhere
	// or later (Connect ResourceExhausted), not failed.
	ErrBusy = errors.New("node too busy")
)

// Layer is one read-only layer of a sandbox's root filesystem: an EROFS
// file, or a node-local directory (a checkpoint, see layer.DirLayers).
type Layer struct {
	// Digest is "sha256:<hex>" of the EROFS file's bytes.
	Digest string
	// Path is the EROFS file, or the directory, on the local node.
	Path string
}

// Resources bounds what a sandbox may use. Zero means "no limit set" for
// each field, except Pids which backends default to a safe bound.
type Resources struct {
	// MilliCPU is the CPU quota in thousandths of a core (1000 = one core).
	MilliCPU int64
	// MemoryBytes is the memory limit: RAM and swap together (the node
	// decides how much of it stays resident).
	MemoryBytes int64
	// Pids bounds the number of tasks (a fork bomb stops there).
	Pids int64
	// DiskBytes bounds the sandbox's writable layer (what it writes over
	// its image), enforced by the kernel.
	DiskBytes int64
}

// Spec says what to create. Layers are ordered bottom first: the base
// image's layers, then the workspace, then toolkits (top).
//
// A fullvm sandbox takes no EROFS layers: its Layers hold exactly one
// entry, the base disk image (raw or qcow2, read-only, from the blob
// store), which the backend covers with a writable overlay of its own.
type Spec struct {
	ID        string
	Layers    []Layer
	Resources Resources
	// Hostname inside the sandbox; defaults to HostnameFor(ID).
	Hostname string
	// Env, Workdir and User are defaults for every exec (from the image config).
	Env     []string
	Workdir string
	User    string
	// UserNamespace maps root inside the sandbox to an unprivileged host uid.
	UserNamespace bool
}

// HostnameFor is the hostname of a sandbox with ID id whose spec names
// none: the ID, cut to the 63 bytes a hostname may have.
func HostnameFor(id string) string {
	if len(id) > 63 {
		return id[:63]
	}
	return id
}

// ExecRequest is one command to run inside a sandbox.
type ExecRequest struct {
	// Argv is the command; if empty, Shell is run with /bin/sh -c.
	Argv  []string
	Shell string
	Env   []string // K=V, appended to the sandbox defaults
	Cwd   string
	User  string // name, uid or uid:gid
	Stdin []byte
	// Timeout kills the whole process tree of this exec; zero means none.
	Timeout time.Duration
	// MaxOutputBytes bounds captured stdout and stderr each; zero means the
	// backend default. Streaming callers still receive everything.
	MaxOutputBytes int64
}

// Stream identifies an output stream of an exec.
type Stream int

// Output streams.
const (
	Stdout Stream = 1
	Stderr Stream = 2
)

// OutputFunc receives output as it is produced (the streaming form of Exec).
// It must not retain data after returning.
type OutputFunc func(s Stream, data []byte)

// ExecResult is what happened to one exec.
type ExecResult struct {
	ExitCode        int
	Signal          int // non-zero if the process was killed by a signal
	Stdout          []byte
	Stderr          []byte
	StdoutTruncated bool
	StderrTruncated bool
	Duration        time.Duration
	TimedOut        bool
	OOMKilled       bool
	// PidsExhausted: the sandbox's pids limit refused a fork during the exec.
	PidsExhausted bool
	// DiskFull: the sandbox's writable layer reached its limit during the exec.
	DiskFull bool
}

// Differ is implemented by sandboxes whose writable layer is an overlay
// upper directory on the host (the container backend): packing it while the
// sandbox is frozen gives a layer that, stacked on the sandbox's layers,
// reproduces its file system (snapshots, checkpoints).
type Differ interface {
	// UpperDir is the host path of the sandbox's overlay upper directory.
	UpperDir() string
}

// DiffArchiver is implemented by sandboxes whose writable layer the host
// must not read in place (a VM guest's disk: the host never mounts a file
// system a guest wrote). WriteDiff writes what the sandbox changed over its
// layers as a tar stream with OCI whiteouts (".wh.NAME" for a removed
// NAME, ".wh..wh..opq" in a directory that hides what its layers hold
// there); the host unpacks it with layer.Extract, which checks every path,
// and packs the result as it packs a Differ's upper directory (snapshots,
// checkpoints). The backend keeps the workload's processes stopped while
// it reads, and leaves a frozen sandbox frozen.
type DiffArchiver interface {
	WriteDiff(ctx context.Context, w io.Writer) error
}

// Egress is implemented by sandboxes whose agent relays connections made
// to a proxy listener inside the sandbox (internal/aether is the edge's
// half). AcceptEgress waits for the next connection to listen, a loopback
// address and port inside the sandbox, and returns it relayed: reading
// gives what the workload sent, writing answers it.
type Egress interface {
	AcceptEgress(ctx context.Context, listen string) (EgressConn, error)
}

// EgressConn is one relayed connection of a workload to its proxy.
type EgressConn interface {
	io.ReadWriteCloser
	// CloseWrite ends what the workload reads (it sees end of file).
	CloseWrite() error
}

// DiskSnapshotter is implemented by sandboxes that are a whole disk (the
// fullvm backend's): SnapshotDisk writes the sandbox's disk as it is now,
// as one standalone image file at out (qcow2), which the edge stores as a
// disk image. A frozen sandbox stays frozen.
type DiskSnapshotter interface {
	SnapshotDisk(ctx context.Context, out string) error
}

// Display is implemented by sandboxes with a screen, a keyboard and a
// mouse (the VM backends): computer-use tasks, and guests that do not run
// dsec-agent.
type Display interface {
	// Screenshot returns what the screen shows now, as a PNG image.
	Screenshot(ctx context.Context) ([]byte, error)
	// Input sends events to the guest in order.
	Input(ctx context.Context, events []InputEvent) error
}

// InputKind says what an InputEvent does.
type InputKind string

// The input events a Display takes.
const (
	// InputText types Text, one key press per character.
	InputText InputKind = "text"
	// InputKey presses Key, a key or a chord of keys joined by "-" (QEMU
	// key names: "ret", "esc", "ctrl-alt-delete", "shift-a"), and releases it.
	InputKey InputKind = "key"
	// InputMove moves the pointer to X, Y (pixels from the top left).
	InputMove InputKind = "move"
	// InputClick moves the pointer to X, Y and clicks Button ("left",
	// "middle" or "right"; "left" when empty).
	InputClick InputKind = "click"
)

// InputEvent is one keyboard or mouse event.
type InputEvent struct {
	Kind   InputKind
	Text   string
	Key    string
	X, Y   int
	Button string
}

// Resetter is implemented by sandboxes that can be put back, in place, into
// the state Create left them in, for much less than a destroy and a create:
// warm pools and fncall reuse a sandbox this way between users.
type Resetter interface {
	// Reset kills every process the sandbox's users started, discards the
	// writable layer (so the root file system is the layers' again), and
	// empties /tmp, /dev/shm and System V IPC. The caller guarantees no
	// other operation is in flight. On error the sandbox is unusable and
	// the caller destroys it.
	Reset(ctx context.Context) error
}

// Rebaser is implemented by sandboxes that can be reset onto another spec:
// the agent, its namespaces and its cgroup are kept, everything else is the
// new spec's. A create of a spec nobody has handed a sandbox back for can
// then take a sandbox released under another spec (recycling across specs)
// instead of starting a new agent, which costs several times more.
type Rebaser interface {
	// Quiesce is Reset's first half: every process the sandbox's users
	// started is killed and reaped, and IPC objects are removed; the root
	// file system is left as it is, for Rebase to replace. The caller
	// guarantees no other operation is in flight. On error the sandbox is
	// unusable and the caller destroys it.
	Quiesce(ctx context.Context) error
	// Rebase does what Reset does, then makes spec the sandbox's spec: its
	// root file system is a fresh writable layer over spec.Layers, and
	// spec's Hostname (spec.ID when empty, as Create), Resources, Env,
	// Workdir and User replace the old ones. The sandbox keeps its runtime
	// ID (spec.ID names only the hostname); spec.UserNamespace must be the
	// sandbox's (ErrInvalidSpec otherwise, and the sandbox is unchanged).
	// The caller guarantees no other operation is in flight. On any other
	// error the sandbox is unusable and the caller destroys it.
	Rebase(ctx context.Context, spec Spec) error
}

// Updater is implemented by sandboxes whose resource limits can change
// while they run (fncall's per-call memory limit).
type Updater interface {
	Update(ctx context.Context, r Resources) error
}

// ForkServer describes a fork server: a long-lived process in a sandbox
// that runs each exec as a fork of itself, so that an exec pays a fork
// instead of a program's start-up (an interpreter's, for fncall's Python).
// The server speaks the backend's protocol (see the container backend's
// forkserver.go); the backend adds one last argument to Argv, the name of
// the abstract Unix socket it must listen on.
type ForkServer struct {
	Argv []string
	Env  []string
}

// Forker is implemented by sandboxes that can keep a fork server across
// Resets (a Reset spares it and checks that the previous user left it as
// it was; anything it cannot vouch for ends the server).
type Forker interface {
	// ForkExec runs req as a fork of the sandbox's fork server, starting
	// server first when the sandbox has none (or one started from another
	// ForkServer). req.Argv is what the server runs; Shell and User must be
	// empty. The result means what Exec's does, streaming aside.
	ForkExec(ctx context.Context, server ForkServer, req ExecRequest) (ExecResult, error)
}

// Usage is what a backend's sandboxes use together (UsageReporter), or
// one sandbox (SandboxUsage), as the kernel accounts it.
type Usage struct {
	// CPUNanos is the CPU time they have used since the backend (or the
	// sandbox's cgroup) started accounting (monotonic; callers take
	// differences).
	CPUNanos uint64
	// MemoryBytes is the memory charged to them that the kernel cannot
	// drop at once: RAM in use less inactive file pages.
	MemoryBytes int64
	// SwapBytes is what of theirs is in swap.
	SwapBytes int64
}

// UsageReporter is implemented by backends that can say what their
// sandboxes use, so that a node is placed by use rather than by limits.
type UsageReporter interface {
	Usage() (Usage, error)
}

// SandboxUsage is implemented by sandboxes that can say what they use
// themselves (`dsec sandbox ls` shows it). Usage reads the kernel's
// accounting at each call and keeps nothing open between calls: a node
// holds thousands of idle sandboxes and its descriptors are counted.
type SandboxUsage interface {
	Usage() (Usage, error)
}

// Backend creates sandboxes of one kind.
type Backend interface {
	Kind() Kind
	// Create builds and starts a sandbox. On error nothing is left behind.
	Create(ctx context.Context, spec Spec) (Sandbox, error)
}

// Sandbox is one live sandbox. All methods are safe for concurrent use.
type Sandbox interface {
	ID() string
	// Exec runs a command; out, if not nil, receives output as it comes.
	Exec(ctx context.Context, req ExecRequest, out OutputFunc) (ExecResult, error)
	WriteFile(ctx context.Context, path string, data []byte, mode uint32) error
	ReadFile(ctx context.Context, path string, maxBytes int64) ([]byte, error)
	// PutArchive extracts a tar stream into dir (created if missing).
	PutArchive(ctx context.Context, dir string, tar io.Reader) error
	// GetArchive writes dir as a tar stream to w (names relative to dir);
	// when dir is a regular file, the stream holds that file alone under
	// its base name.
	GetArchive(ctx context.Context, dir string, w io.Writer) error
	// Freeze stops every process of the sandbox, keeping its memory and
	// state, and returns once they are stopped; Thaw resumes them. Both are
	// idempotent. Other calls on a frozen sandbox block until it is thawed:
	// callers refuse them instead.
	Freeze(ctx context.Context) error
	Thaw(ctx context.Context) error
	// Destroy kills every process and removes every mount, cgroup and
	// directory of the sandbox. It is idempotent.
	Destroy(ctx context.Context) error
	// Done is closed when the sandbox's init process has exited.
	Done() <-chan struct{}
}
