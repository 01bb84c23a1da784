// Package edge is DSec's node agent: one per node, it owns the node's
// sandboxes and is the source of truth for them. It serves EdgeService to the
// control plane (create, exec, files, destroy), enforces each sandbox's ttl
// and idle timeout, and heartbeats its capacity, usage, held layers and
// sandbox summaries to every server replica so that the stateless servers
// can rebuild their soft view of the cluster from heartbeats alone.
//
// The edge does the final admission check of optimistic placement: a server
// places from a view that may be a heartbeat old, so the edge refuses with
// ResourceExhausted when it is full and the server retries elsewhere.
//
// The package is split where the parts have seams of their own: a
// sandbox's states and the moves between them are package lifecycle's
// (setState is the only place that moves one), checkpoints and the layers
// of snapshot images package snapshot's, and the pools that reuse runtime
// sandboxes are recyclers (recycle.go). Errors are fail kinds everywhere
// below EdgeService and become Connect codes in one place (apierr.go).
//
// Lock order: Edge.mu is the only lock guarding sandbox records; it is never
// held across a runtime call (create, exec, destroy), so a slow sandbox never
// stalls operations on the others. snapshot.Store's lock may be taken under
// Edge.mu, never the reverse.
package edge

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/aether"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge/snapshot"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/rawfile"
	"github.com/dsec-dev/dsec/internal/redact"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// Defaults for Config's zero values.
const (
	DefaultHeartbeatInterval = time.Second
	DefaultMaxSandboxes      = 4096
	// DefaultMemoryReserve is the least memory (available plus swap free)
	// a node keeps out of sandboxes' reach: past it, creates are refused.
	DefaultMemoryReserve = 256 << 20
	// DefaultRetention is how long a destroyed, lost or failed sandbox is
	// remembered, so that Get can say what became of it.
	DefaultRetention = 5 * time.Minute
	// DefaultShipInterval is how often trajectories are shipped while
	// their sandboxes run.
	DefaultShipInterval = 30 * time.Second
)

// maxEdgeRequest bounds one EdgeService request: a caller's request
// (limits.MaxRequestBytes) and what the server adds to it.
const maxEdgeRequest = limits.MaxRequestBytes + 1<<20

// Config configures an Edge. Zero values get defaults where one makes sense.
type Config struct {
	// NodeID names this node; sandbox IDs it accepts start with it.
	NodeID string
	// DataDir is the node's data directory (default /var/lib/dsec). The
	// backends' state lives under it; the edge itself keeps nothing there yet.
	DataDir string
	// Store is the shared blob store holding layers, manifests and refs.
	// Its blobs must be local files (blobstore.Local) so layers can be
	// mounted straight from it: a dir store, or a blobstore.Cache that
	// fetches a remote store's layers to this node when a create needs
	// them.
	Store blobstore.Repository
	// Backends this node offers, by kind. At least one is required.
	Backends map[runtime.Kind]runtime.Backend
	// Capacity per backend; a missing entry or zero field defaults to the
	// machine's cores*1000 milliCPU, MemTotal and DefaultMaxSandboxes.
	Capacity map[runtime.Kind]placement.Capacity
	// RequestShare is the fraction of a sandbox's requested CPU and memory
	// the node charges for it, per backend, on top of what it measures in
	// use (see nodestate.go); a backend missing from the map takes
	// placement.DefaultShare (nothing: measured use only). Heartbeats
	// report it, so servers place by the same rule.
	RequestShare map[runtime.Kind]placement.Share
	// MemoryReserve is the memory (available plus swap free) below which
	// the node takes no more sandboxes; default DefaultMemoryReserve or
	// 2% of the node's memory, whichever is larger.
	MemoryReserve int64
	// AdvertiseURL is the base URL servers reach this edge's EdgeService at.
	AdvertiseURL string
	// Servers are the base URLs of every server replica to heartbeat to.
	Servers []string
	// ClusterToken is the shared secret servers present on EdgeService calls
	// and the edge presents on NodeService calls. Required.
	ClusterToken string
	// HeartbeatInterval, default DefaultHeartbeatInterval.
	HeartbeatInterval time.Duration
	// UsageInterval is how often every running sandbox's own usage is
	// read (what Get and List report; its CPU is averaged over it),
	// default DefaultUsageInterval; longer when a pass costs more than
	// 2% of a core of CPU time (see sandboxusage.go).
	UsageInterval time.Duration
	// Retention, default DefaultRetention.
	Retention time.Duration
	// HTTPClient carries heartbeats; default a client with no overall
	// timeout (each heartbeat has its own deadline).
	HTTPClient *http.Client
	// Logger, default slog.Default().
	Logger *slog.Logger
	// Registry receives the edge's metrics; default a private registry.
	Registry prometheus.Registerer
	// NoEgress turns the egress proxy off: sandboxes keep loopback only,
	// execs get no proxy variables, and a spec with network rules is
	// refused.
	NoEgress bool
	// Hosts answers the egress proxy's lookups before DNS (`--hosts FILE`,
	// aether.LoadHosts): its addresses may be loopback or private.
	Hosts map[string][]netip.Addr
	// Mirror configures the node's package mirror (aether.Mirror; its
	// Store and Resolver are filled in: the edge's blob store and the
	// egress resolver). NoMirror turns it off: sandboxes reach package
	// upstreams directly through the proxy only.
	Mirror   aether.MirrorConfig
	NoMirror bool
	// NoTrajectory turns the trajectory log off: no records, no
	// fast-forward (operations that carry a seq are refused). For
	// measuring the log's overhead.
	NoTrajectory bool
	// ShipInterval is how often running sandboxes' new trajectory records
	// are shipped to the blob store, default DefaultShipInterval.
	ShipInterval time.Duration
	// MaxLayers bounds a snapshot image's layers (default
	// DefaultMaxLayers); past it the layers are merged into one.
	MaxLayers int
	// FnWarm is how many clean sandboxes each fncall pool keeps ready,
	// FnMax bounds its sandboxes (calls beyond wait) and FnQueue the calls
	// waiting; defaults DefaultFnWarm, DefaultFnMax, DefaultFnQueue.
	FnWarm, FnMax, FnQueue int
	// FnPools bounds the images the node keeps fncall pools for (default
	// DefaultFnPools); past it the least recently used idle pool is
	// closed, or the call is Unavailable when every pool is busy.
	FnPools int
	// AutoPool is the least number of destroyed sandboxes of one spec (per
	// tenant) the node may keep, reset, for the next creates of that spec;
	// above it the pool follows the spec's recent peak alive (see
	// autopool.go). It also bounds the destroyed sandboxes each tenant's
	// rebase pool keeps, quiesced, for creates of other specs (see
	// rebase.go). 0 turns both kinds of recycling off. The CLI's default
	// is DefaultAutoPool.
	AutoPool int
	// Defaults are the resources a sandbox gets for what its spec (and
	// its tenant's defaults, which servers fill in) leave 0; zero fields
	// take spec.Builtin. Heartbeats report them to servers.
	Defaults spec.Resources
}

// Edge is one node's agent. Create it with New, mount its service with
// Mount, start heartbeats and the reaper with Run, and stop it with Close.
type Edge struct {
	cfg     Config
	log     *slog.Logger
	images  *image.Store
	local   blobstore.Local
	bootID  string
	metrics *metrics
	// redact keeps host paths (the data dir, the blob store) out of the
	// errors the node answers, which servers pass on to callers.
	redact *redact.Redactor
	// traj is the node's trajectory log; nil when Config.NoTrajectory.
	traj *trajectory.Log
	// ship takes sandboxes whose trajectory ended, to ship at once.
	ship chan string
	// snaps keeps checkpoints and their layers on this node (they do not
	// outlive it).
	snaps *snapshot.Store
	// wake nudges the reaper when a deadline earlier than its timer appears.
	wake chan struct{}
	// state is what the node measures about itself (nodestate.go).
	state sampler
	// aether decides sandboxes' outward connections (egress.go); nil
	// with Config.NoEgress.
	aether *aether.Proxy
	// mirror is the node's package mirror the proxy serves (egress.go);
	// nil with Config.NoEgress or NoMirror.
	mirror *aether.Mirror
	// usagePass and usagePassCPU are how long the last pass reading every
	// sandbox's usage took and the CPU time it spent, in nanoseconds
	// (sandboxusage.go).
	usagePass, usagePassCPU atomic.Int64

	mu        sync.Mutex
	closed    bool
	sandboxes map[string]*sandbox
	used      map[runtime.Kind]placement.Capacity
	// layers counts live sandboxes per layer digest (what the node holds).
	layers     map[string]int
	deadlines  deadlineHeap
	tombstones []tombstone
	// pools are the node's warm pools by ID; fnPools its fncall pools by
	// key.
	pools   map[string]*warmPool
	fnPools map[string]*fnPool
	// autoPools recycle destroyed sandboxes, by autoPoolKey; recent
	// says which specs are hot (see autopool.go).
	autoPools map[string]*warmPool
	recent    map[string]recentCreate
	// recyclers are the pools above as creates and destroys see them
	// (recycle.go).
	recyclers []recycler
	// rebasePools keep destroyed sandboxes, quiesced, for the next
	// creates of any spec by their tenant, by rebasePoolKey (see
	// rebase.go).
	rebasePools map[string]*rebasePool
	// tenantContainers counts each tenant's container sandboxes charged
	// to the node (a rebase pool's demand).
	tenantContainers map[string]int
	// idleMu guards idle, the sandboxes idle in automatic and rebase pools
	// as summed at idleAt (see idleSum).
	idleMu sync.Mutex
	idle   int64
	idleAt time.Time

	stop    context.CancelFunc
	stopCtx context.Context
	wg      sync.WaitGroup
}

// New checks cfg, fills in defaults and returns an Edge that holds no
// sandboxes yet.
func New(cfg Config) (*Edge, error) {
	if err := ids.ValidNode(cfg.NodeID); err != nil {
		return nil, fmt.Errorf("edge config NodeID: %w", err)
	}
	if cfg.Store == nil {
		return nil, errors.New("edge config Store is required")
	}
	local, ok := cfg.Store.(blobstore.Local)
	if !ok {
		return nil, fmt.Errorf("edge config Store (%T) must keep blobs as local files", cfg.Store)
	}
	if len(cfg.Backends) == 0 {
		return nil, errors.New("edge config Backends: at least one backend is required")
	}
	for kind, b := range cfg.Backends {
		if b == nil || b.Kind() != kind {
			return nil, fmt.Errorf("edge config Backends[%q]: backend is nil or of another kind", kind)
		}
	}
	if cfg.ClusterToken == "" {
		return nil, errors.New("edge config ClusterToken is required")
	}
	if cfg.DataDir == "" {
		cfg.DataDir = "/var/lib/dsec"
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if cfg.Retention <= 0 {
		cfg.Retention = DefaultRetention
	}
	if cfg.UsageInterval <= 0 {
		cfg.UsageInterval = DefaultUsageInterval
	}
	if cfg.ShipInterval <= 0 {
		cfg.ShipInterval = DefaultShipInterval
	}
	if cfg.FnWarm == 0 {
		cfg.FnWarm = DefaultFnWarm
	}
	if cfg.FnMax == 0 {
		cfg.FnMax = DefaultFnMax
	}
	if cfg.FnQueue == 0 {
		cfg.FnQueue = DefaultFnQueue
	}
	if cfg.FnPools <= 0 {
		cfg.FnPools = DefaultFnPools
	}
	if cfg.MaxLayers <= 0 {
		cfg.MaxLayers = DefaultMaxLayers
	}
	shares := map[runtime.Kind]placement.Share{}
	for kind := range cfg.Backends {
		sh, ok := cfg.RequestShare[kind]
		if !ok {
			sh = placement.DefaultShare
		}
		if !(sh.CPU >= 0 && sh.CPU <= 1) || !(sh.Memory >= 0 && sh.Memory <= 1) {
			return nil, fmt.Errorf("edge config RequestShare[%q] %+v: shares must be in [0, 1]", kind, sh)
		}
		shares[kind] = sh
	}
	cfg.RequestShare = shares
	if cfg.MemoryReserve < 0 {
		return nil, fmt.Errorf("edge config MemoryReserve %d: must not be negative", cfg.MemoryReserve)
	}
	defaults, err := spec.NodeDefaults(cfg.Defaults)
	if err != nil {
		return nil, fmt.Errorf("edge config Defaults: %w", err)
	}
	cfg.Defaults = defaults
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	machine, err := machineCapacity()
	if err != nil {
		return nil, err
	}
	caps := map[runtime.Kind]placement.Capacity{}
	for kind := range cfg.Backends {
		c := cfg.Capacity[kind]
		if c.MilliCPU < 0 || c.MemoryBytes < 0 || c.Sandboxes < 0 {
			return nil, fmt.Errorf("edge config Capacity[%q]: values must not be negative", kind)
		}
		if c.MilliCPU == 0 {
			c.MilliCPU = machine.MilliCPU
		}
		if c.MemoryBytes == 0 {
			c.MemoryBytes = machine.MemoryBytes
		}
		if c.Sandboxes == 0 {
			c.Sandboxes = machine.Sandboxes
		}
		caps[kind] = c
	}
	if err := boundByOpenFiles(caps, cfg.Capacity, cfg.Logger); err != nil {
		return nil, err
	}
	cfg.Capacity = caps
	if cfg.MemoryReserve == 0 {
		cfg.MemoryReserve = max(DefaultMemoryReserve, machine.MemoryBytes/50)
	}
	m, err := newMetrics(cfg.Registry)
	if err != nil {
		return nil, err
	}
	var boot [8]byte
	if _, err := rand.Read(boot[:]); err != nil {
		return nil, fmt.Errorf("boot id: %w", err)
	}
	// Checkpoints do not survive the edge: start with an empty store.
	snaps, err := snapshot.Open(filepath.Join(cfg.DataDir, "checkpoints"), cfg.Logger.With("node", cfg.NodeID))
	if err != nil {
		return nil, fmt.Errorf("edge %w", err)
	}
	stopCtx, stop := context.WithCancel(context.Background())
	roots := []string{cfg.DataDir}
	if ing, ok := cfg.Store.(blobstore.Ingester); ok {
		roots = append(roots, ing.TempDir(), filepath.Dir(ing.TempDir()))
	}
	e := &Edge{
		redact:      redact.New(cfg.Logger, roots...),
		cfg:         cfg,
		log:         cfg.Logger.With("node", cfg.NodeID),
		images:      image.NewStore(cfg.Store, cfg.Store.Refs()),
		local:       local,
		bootID:      hex.EncodeToString(boot[:]),
		metrics:     m,
		wake:        make(chan struct{}, 1),
		sandboxes:   map[string]*sandbox{},
		used:        map[runtime.Kind]placement.Capacity{},
		layers:      map[string]int{},
		ship:        make(chan string, 1024),
		snaps:       snaps,
		pools:       map[string]*warmPool{},
		fnPools:     map[string]*fnPool{},
		autoPools:   map[string]*warmPool{},
		recent:      map[string]recentCreate{},
		rebasePools: map[string]*rebasePool{},

		tenantContainers: map[string]int{},
		stop:             stop,
		stopCtx:          stopCtx,
	}
	e.recyclers = recyclersOf(e)
	if !cfg.NoEgress {
		res := aether.NewResolver(cfg.Hosts)
		e.aether = aether.New(aether.Config{Resolver: res, Record: e.recordEgress, Mirror: e.newMirror(res)})
	}
	e.state.meters = map[runtime.Kind]runtime.UsageReporter{}
	for kind, b := range cfg.Backends {
		if m, ok := b.(runtime.UsageReporter); ok {
			e.state.meters[kind] = m
		}
	}
	e.state.sample()
	if err := cfg.Registry.Register(poolCollector{e}); err != nil {
		stop()
		return nil, fmt.Errorf("register edge metrics: %w", err)
	}
	if err := cfg.Registry.Register(stateCollector{e}); err != nil {
		cfg.Registry.Unregister(poolCollector{e})
		stop()
		return nil, fmt.Errorf("register edge metrics: %w", err)
	}
	if !cfg.NoTrajectory {
		if err := e.openTrajectory(); err != nil {
			cfg.Registry.Unregister(poolCollector{e})
			cfg.Registry.Unregister(stateCollector{e})
			stop()
			return nil, err
		}
	}
	return e, nil
}

// NodeID returns the node this edge serves.
func (e *Edge) NodeID() string { return e.cfg.NodeID }

// Mount registers EdgeService on mux, behind the cluster token check.
func (e *Edge) Mount(mux *http.ServeMux) {
	// The token is checked before anything reads the body; bodies and
	// their inflation are bounded like the server's, with room for what
	// a server adds to a caller's request (caller, spec).
	path, h := dsecv1connect.NewEdgeServiceHandler(&service{e: e}, limits.HandlerOptions(maxEdgeRequest),
		// Errors are mapped to API codes first (apierr.go), then redacted.
		connect.WithInterceptors(e.redact.Interceptor(), apiErrors{}))
	mux.Handle(path, RequireClusterToken(e.cfg.ClusterToken, limits.Body(h, maxEdgeRequest)))
}

// Run heartbeats to every server and enforces lifecycles until ctx is done
// or Close is called. It returns nil when stopped.
func (e *Edge) Run(ctx context.Context) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.wg.Add(1)
	e.mu.Unlock()
	defer e.wg.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-e.stopCtx.Done():
			cancel()
		case <-ctx.Done():
		}
	}()
	var wg sync.WaitGroup
	for _, url := range e.cfg.Servers {
		wg.Go(func() { e.heartbeatLoop(ctx, url) })
	}
	wg.Go(func() { e.reapLoop(ctx) })
	wg.Go(func() { e.sampleLoop(ctx) })
	wg.Go(func() { e.usageLoop(ctx) })
	if e.traj != nil {
		wg.Go(func() { e.shipLoop(ctx) })
	}
	wg.Wait()
	return nil
}

// Close stops Run and destroys every sandbox: sandboxes do not outlive their
// edge (the backend would clean up their leftovers at the next start anyway,
// but a clean shutdown releases them now). New requests fail with
// Unavailable from then on.
func (e *Edge) Close(ctx context.Context) error {
	e.stop()
	e.mu.Lock()
	e.closed = true
	var victims []*sandbox
	for _, sb := range e.sandboxes {
		if sb.phase() == StateRunning {
			victims = append(victims, sb)
		}
	}
	e.mu.Unlock()
	e.wg.Wait()

	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		sem  = make(chan struct{}, 16)
	)
	for _, sb := range victims {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := e.destroy(ctx, sb, reasonShutdown); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	e.closePools(ctx)
	e.closeFnPools(ctx)
	if e.traj != nil {
		if err := e.traj.ShipAll(ctx); err != nil {
			errs = append(errs, err)
		}
		if err := e.traj.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Every sandbox holds descriptors in the edge's process while it waits:
// at most 4 with the container backend, in every state (its agent's
// socket and pidfd, once reset the root prepared for its next Reset, a
// fork server's connection; what an exec, Reset or Rebase reads is opened
// while it runs: internal/runtime/container's TestDescriptorsPerSandbox).
// Past RLIMIT_NOFILE, creates, accepted connections and trajectory writes
// fail with EMFILE. So a node's sandbox capacity is bounded by what the
// limit leaves after fdReserve for the process itself and for work in
// flight (an exec holds two more while it runs; less reserve under small
// limits), at fdsPerSandbox each: 4,744 sandboxes under a limit of 20,000.
const (
	fdsPerSandbox = 4
	fdReserve     = 1024
)

// fdBoundedSandboxes is how many sandboxes a process with the open-file
// limit limit can hold. Under a small limit (a default of 1024 somewhere)
// the reserve shrinks to a quarter of it, so the node still holds a few
// dozen sandboxes rather than none.
func fdBoundedSandboxes(limit uint64) int64 {
	reserve := min(uint64(fdReserve), limit/4)
	return int64((limit - reserve) / fdsPerSandbox)
}

// boundByOpenFiles lowers each backend's default sandbox capacity in caps
// to what the process's open-file limit can hold (Go raises the soft limit
// to the hard one at start), and refuses a capacity the operator set
// (given) above it: the node would fail creates part way instead of
// declaring itself full.
func boundByOpenFiles(caps, given map[runtime.Kind]placement.Capacity, log *slog.Logger) error {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY {
		return nil
	}
	most := fdBoundedSandboxes(rl.Cur)
	for kind, c := range caps {
		if c.Sandboxes <= most {
			continue
		}
		if given[kind].Sandboxes > 0 {
			return fmt.Errorf("edge config Capacity[%q].Sandboxes %d: the open-file limit (RLIMIT_NOFILE %d) holds at most %d sandboxes (~%d descriptors each, besides the process's own): raise it (LimitNOFILE= in a systemd unit, ulimit -n) or lower --max-sandboxes",
				kind, c.Sandboxes, rl.Cur, most, fdsPerSandbox)
		}
		log.Info("sandbox capacity bounded by the open-file limit", "backend", kind, "sandboxes", most, "default", c.Sandboxes, "rlimit_nofile", rl.Cur)
		c.Sandboxes = most
		caps[kind] = c
	}
	return nil
}

// machineCapacity is what the node offers when the config does not say.
func machineCapacity() (placement.Capacity, error) {
	mem, err := memTotal()
	if err != nil {
		return placement.Capacity{}, err
	}
	return placement.Capacity{
		MilliCPU:    int64(goruntime.NumCPU()) * 1000,
		MemoryBytes: mem,
		Sandboxes:   DefaultMaxSandboxes,
	}, nil
}

// meminfo reads one field of /proc/meminfo, in bytes.
func meminfo(field string) (int64, error) {
	m, err := rawfile.Meminfo()
	if err != nil {
		return 0, err
	}
	v, ok := m[field]
	if !ok {
		return 0, fmt.Errorf("no %s in /proc/meminfo", field)
	}
	return v, nil
}

func memTotal() (int64, error) { return meminfo("MemTotal") }

// loadPerCore is the 1-minute load average divided by the cores.
func loadPerCore() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := bytes.Fields(b)
	if len(f) == 0 {
		return 0
	}
	l, err := strconv.ParseFloat(string(f[0]), 64)
	if err != nil {
		return 0
	}
	return l / float64(goruntime.NumCPU())
}
