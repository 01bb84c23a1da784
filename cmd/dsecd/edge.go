package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/aether"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/ids"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/lazyfs"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/container"
	"github.com/dsec-dev/dsec/internal/runtime/container/scratchfs"
	"github.com/dsec-dev/dsec/internal/spec"
	"github.com/dsec-dev/dsec/internal/swap"
)

// edgeFlags are the node's own settings, shared by edge and up.
type edgeFlags struct {
	nodeID       string
	agentPath    string
	cpu, memory  string
	maxSandboxes int64
	heartbeat    time.Duration
	usage        time.Duration
	share        placement.Share
	memReserve   string
	reserve      int64
	trajectory   bool
	fnWarm       int
	fnMax        int
	fnQueue      int
	autoPool     int
	// defCPU, defMemory, defPids and defDisk are the --default-* flags:
	// what a sandbox gets for what its spec and tenant leave 0.
	defCPU, defMemory, defDisk string
	defPids                    int64
	// scratchSize and scratchFile: the sandboxes' writable-layer file
	// system (scratch.go).
	scratchSize, scratchFile string
	// swapSize and swapFile: the node's swap area (swap.go).
	swapSize, swapFile string
	// egress and hostsFile: sandboxes' outward connections (--egress,
	// --hosts); hosts is hostsFile read by validate.
	egress    bool
	hostsFile string
	hosts     map[string][]netip.Addr
	// vm: the VM backends (vm.go).
	vm vmFlags
	// lazyCache and lazyMin: the lazy layer loader of an s3 store
	// (--lazy-cache, --lazy-min-size).
	lazyCache, lazyMin string

	capacity placement.Capacity // set by validate
	defaults spec.Resources     // set by validate: every field set
	mounts   *layer.Mounts      // set by build
	backend  *container.Backend // set by build
	scratch  *scratchfs.FS      // set by build, nil with --scratch-size off
	swap     *swap.Area         // set by build, nil with --swap 0
	lazy     *lazyfs.FS         // set by build, nil unless the store is remote
}

// warmAgents is how many sandbox agents an edge keeps started ahead of
// demand: a create then skips the process start (~10 ms of CPU here).
const warmAgents = 8

// layerLinger keeps an unused layer mounted this long: the next sandbox of
// the same image skips a mount and an unmount.
const layerLinger = 5 * time.Minute

func (f *edgeFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.nodeID, "node-id", defaultNodeID(), "this node's id (1-32 of [a-z0-9-]); sandbox ids start with it")
	fl.StringVar(&f.agentPath, "agent", "", "dsec-agent binary (default: next to this executable)")
	fl.StringVar(&f.cpu, "cpu", "", "CPU cores offered to sandboxes (default: all)")
	fl.StringVar(&f.memory, "memory", "", "memory offered to sandboxes, e.g. 16g; it also bounds their RAM together, as a cgroup (default: all RAM, no bound)")
	fl.Int64Var(&f.maxSandboxes, "max-sandboxes", 0, fmt.Sprintf("most sandboxes on this node (default %d, lowered to what the open-file limit holds: ~4 descriptors each)", edge.DefaultMaxSandboxes))
	fl.DurationVar(&f.heartbeat, "heartbeat-interval", edge.DefaultHeartbeatInterval, "how often to heartbeat to every server")
	fl.DurationVar(&f.usage, "usage-interval", edge.DefaultUsageInterval, "how often to read every running sandbox's CPU and memory use (what sandbox ls shows; its CPU is averaged over it); longer when a pass costs more than 2% of a core")
	fl.Float64Var(&f.share.CPU, "request-share-cpu", placement.DefaultShare.CPU, "fraction of a sandbox's requested CPU the node reserves for it on top of measured use, 0..1 (0: place by measured use only; 1: requests are reservations)")
	fl.Float64Var(&f.share.Memory, "request-share-memory", placement.DefaultShare.Memory, "fraction of a sandbox's requested memory the node reserves for it on top of measured use, 0..1")
	fl.StringVar(&f.memReserve, "memory-reserve", "", fmt.Sprintf("memory (available plus swap free) below which the node takes no more sandboxes (default %s or 2%% of RAM, whichever is larger)", cli.FormatSize(edge.DefaultMemoryReserve)))
	fl.IntVar(&f.fnWarm, "fn-warm", edge.DefaultFnWarm, "clean sandboxes each fncall pool (one per language image) keeps ready")
	fl.IntVar(&f.fnMax, "fn-max", edge.DefaultFnMax, "most sandboxes of one fncall pool; calls beyond wait")
	fl.IntVar(&f.fnQueue, "fn-queue", edge.DefaultFnQueue, "most fncall calls waiting for a sandbox; beyond, Unavailable with a retry-after hint")
	fl.IntVar(&f.autoPool, "auto-pool", edge.DefaultAutoPool, "destroyed sandboxes a node may always keep, reset, per hot spec for its next creates (more when the spec had more alive at once lately, within capacity), and per tenant to rebase onto creates of other specs; 0 disables recycling")
	fl.StringVar(&f.defCPU, "default-cpu", "", fmt.Sprintf("CPU cores a sandbox gets when neither its spec nor its tenant say (default %s)", cli.FormatCPU(spec.Builtin.MilliCPU)))
	fl.StringVar(&f.defMemory, "default-memory", "", fmt.Sprintf("memory limit a sandbox gets when neither its spec nor its tenant say, e.g. 512m (default %s)", cli.FormatSize(spec.Builtin.MemoryBytes)))
	fl.Int64Var(&f.defPids, "default-pids", 0, fmt.Sprintf("process limit a sandbox gets when neither its spec nor its tenant say (default %d)", spec.Builtin.Pids))
	fl.StringVar(&f.defDisk, "default-disk", "", fmt.Sprintf("writable-layer size a sandbox gets when neither its spec nor its tenant say (default %s)", cli.FormatSize(spec.Builtin.DiskBytes)))
	fl.StringVar(&f.lazyCache, "lazy-cache", "8g", "with an s3:// store, the most disk the node's cache of layer chunks (fetched on demand) may use")
	fl.StringVar(&f.lazyMin, "lazy-min-size", cli.FormatSize(lazyfs.DefaultMinLazyBytes), "with an s3:// store, layers smaller than this are fetched whole rather than on demand; \"off\" fetches every layer whole")
	f.registerScratch(cmd)
	f.registerSwap(cmd)
	f.vm.register(cmd)
	fl.BoolVar(&f.egress, "egress", true, "run every sandbox's egress proxy (--egress=false: sandboxes have loopback only, specs with network rules are refused)")
	fl.StringVar(&f.hostsFile, "hosts", "", "hosts-format FILE (ADDRESS NAME...) the egress proxy answers names from before DNS; its addresses may be loopback or private (test upstreams, a mirror)")
	fl.BoolVar(&f.trajectory, "trajectory", true, "keep every sandbox's trajectory log (--trajectory=false: no records, no fast-forward; for measuring its cost)")
}

// validate checks the flags (before the daemon touches its data dir or
// its port) and works out the node's capacity.
func (f *edgeFlags) validate() error {
	if err := validNodeFlag(f.nodeID); err != nil {
		return err
	}
	if f.fnWarm < 0 || f.fnMax < 1 || f.fnQueue < 1 || f.fnWarm > f.fnMax {
		return cli.Usagef("--fn-warm %d, --fn-max %d, --fn-queue %d: want 0 <= fn-warm <= fn-max and fn-max, fn-queue >= 1", f.fnWarm, f.fnMax, f.fnQueue)
	}
	if f.usage < 0 {
		return cli.Usagef("--usage-interval %s: must not be negative", f.usage)
	}
	if f.autoPool < 0 {
		return cli.Usagef("--auto-pool %d: must not be negative (0 disables recycling)", f.autoPool)
	}
	if _, err := f.scratchBytes(); err != nil {
		return err
	}
	if _, _, err := f.lazyBytes(); err != nil {
		return err
	}
	if err := f.vm.validate(); err != nil {
		return err
	}
	for _, v := range []struct {
		name string
		v    float64
	}{{"request-share-cpu", f.share.CPU}, {"request-share-memory", f.share.Memory}} {
		if !(v.v >= 0 && v.v <= 1) {
			return cli.Usagef("--%s %v: must be between 0 and 1", v.name, v.v)
		}
	}
	if f.memReserve != "" {
		var err error
		if f.reserve, err = cli.ParseSize("memory-reserve", f.memReserve); err != nil {
			return cli.UsageError{Err: err}
		}
	}
	if _, err := f.swapBytes(); err != nil {
		return err
	}
	if f.hostsFile != "" {
		if !f.egress {
			return cli.Usagef("--hosts %s: only with the egress proxy (not with --egress=false)", f.hostsFile)
		}
		var err error
		if f.hosts, err = aether.LoadHosts(f.hostsFile); err != nil {
			return cli.Usagef("--hosts: %v", err)
		}
	}
	f.capacity = placement.Capacity{Sandboxes: f.maxSandboxes}
	var err error
	if f.cpu != "" {
		if f.capacity.MilliCPU, err = cli.ParseCPU("cpu", f.cpu); err != nil {
			return cli.UsageError{Err: err}
		}
	}
	if f.memory != "" {
		if f.capacity.MemoryBytes, err = cli.ParseSize("memory", f.memory); err != nil {
			return cli.UsageError{Err: err}
		}
	}
	var d spec.Resources
	if f.defCPU != "" {
		if d.MilliCPU, err = cli.ParseCPU("default-cpu", f.defCPU); err != nil {
			return cli.UsageError{Err: err}
		}
	}
	if f.defMemory != "" {
		if d.MemoryBytes, err = cli.ParseSize("default-memory", f.defMemory); err != nil {
			return cli.UsageError{Err: err}
		}
	}
	if f.defDisk != "" {
		if d.DiskBytes, err = cli.ParseSize("default-disk", f.defDisk); err != nil {
			return cli.UsageError{Err: err}
		}
	}
	if f.defPids < 0 {
		return cli.Usagef("--default-pids %d: must not be negative", f.defPids)
	}
	d.Pids = f.defPids
	if f.defaults, err = spec.NodeDefaults(d); err != nil {
		return cli.Usagef("--default-*: %v", err)
	}
	return nil
}

// build makes the node's container backend and its edge. Sandbox state and
// layer mounts live under dataDir, which must be this node's own even when
// the blob store is shared.
func (f *edgeFlags) build(dataDir string, store blobstore.Repository, token, advertise string, servers []string,
	log *slog.Logger, reg prometheus.Registerer) (*edge.Edge, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	mounts, err := layer.NewMounts(filepath.Join(dataDir, "layers"), layer.WithLinger(layerLinger))
	if err != nil {
		return nil, fmt.Errorf("layer mounts: %w", err)
	}
	f.mounts = mounts
	if store, err = f.openLazy(dataDir, store, log, reg); err != nil {
		mounts.Close()
		return nil, err
	}
	if f.scratch, err = f.openScratch(dataDir, log); err != nil {
		f.closeLazy(log)
		return nil, err
	}
	// Before the backend: it splits v2 memory limits between RAM and swap
	// only when the host has swap.
	if err := f.openSwap(dataDir, log); err != nil {
		f.closeScratch(log)
		f.closeLazy(log)
		return nil, err
	}
	backend, err := container.New(container.Options{
		StateDir: filepath.Join(dataDir, "sandboxes"),
		Scratch:  f.scratch,
		// What a sandbox whose resources reach the backend without a
		// disk size gets (edge creates always carry one: the defaults).
		DefaultDiskBytes: f.defaults.DiskBytes,
		AgentPath:        f.agentPath,
		Layers:           mounts,
		Logger:           log,
		Warm:             warmAgents,
		// --memory bounds the sandboxes' RAM together (their parent
		// cgroup), not only the capacity the edge advertises.
		MemoryBytes: f.capacity.MemoryBytes,
	})
	if err != nil {
		f.closeSwap(log)
		f.closeScratch(log)
		f.closeLazy(log)
		return nil, err
	}
	f.backend = backend
	backends := map[runtime.Kind]runtime.Backend{runtime.KindContainer: backend}
	capacity := map[runtime.Kind]placement.Capacity{runtime.KindContainer: f.capacity}
	if err := f.vm.open(context.Background(), dataDir, f.agentPath, f.defaults.MemoryBytes, f.capacity, backends, capacity, log); err != nil {
		backend.Close()
		f.closeSwap(log)
		f.closeScratch(log)
		f.closeLazy(log)
		return nil, err
	}
	shares := map[runtime.Kind]placement.Share{}
	for kind := range backends {
		shares[kind] = f.share
	}
	e, err := edge.New(edge.Config{
		NodeID:            f.nodeID,
		DataDir:           dataDir,
		Store:             store,
		Backends:          backends,
		Capacity:          capacity,
		RequestShare:      shares,
		MemoryReserve:     f.reserve,
		AdvertiseURL:      advertise,
		Servers:           servers,
		ClusterToken:      token,
		HeartbeatInterval: f.heartbeat,
		UsageInterval:     f.usage,
		Logger:            log,
		Registry:          reg,
		NoTrajectory:      !f.trajectory,
		FnWarm:            f.fnWarm,
		FnMax:             f.fnMax,
		FnQueue:           f.fnQueue,
		AutoPool:          f.autoPool,
		Defaults:          f.defaults,
		NoEgress:          !f.egress,
		Hosts:             f.hosts,
	})
	if err != nil {
		backend.Close()
		f.closeSwap(log)
		f.closeScratch(log)
		f.closeLazy(log)
	}
	return e, err
}

func validNodeFlag(id string) error {
	if err := ids.ValidNode(id); err != nil {
		return cli.Usagef("--node-id: %v", err)
	}
	return nil
}

// closeEdge destroys the edge's sandboxes with a deadline of its own: the
// command's context is already cancelled when a signal stops it.
func closeEdge(ctx context.Context, e *edge.Edge, log *slog.Logger) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
	defer cancel()
	if err := e.Close(cctx); err != nil {
		log.Warn("edge shutdown", "err", err)
	}
}

// close shuts the edge down, then unmounts the layers left lingering.
func (f *edgeFlags) close(ctx context.Context, e *edge.Edge, log *slog.Logger) {
	closeEdge(ctx, e, log)
	if f.backend != nil {
		f.backend.Close()
	}
	if f.mounts != nil {
		if err := f.mounts.Close(); err != nil {
			log.Warn("unmount layers", "err", err)
		}
	}
	// After the layers: their EROFS mounts hold the lazy files open.
	f.closeLazy(log)
	f.closeScratch(log)
	f.closeSwap(log)
}

func newEdgeCmd() *cobra.Command {
	var (
		f         daemonFlags
		ef        edgeFlags
		mf        metricsFlags
		servers   []string
		advertise string
	)
	cmd := &cobra.Command{
		Use:   "edge --server URL[,URL...]",
		Short: short("edge"),
		Args:  cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := ef.validate(); err != nil {
				return err
			}
			if len(servers) == 0 {
				return cli.Usagef("--server is required (the control plane's URL; repeat or comma-separate for replicas)")
			}
			for i, s := range servers {
				if !strings.Contains(s, "://") {
					servers[i] = "http://" + s
				}
			}
			log, store, token, err := f.open(false)
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp", f.listen)
			if err != nil {
				return cli.Usagef("--listen %s: %v", f.listen, err)
			}
			defer ln.Close()
			if advertise == "" {
				advertise = loopbackURL(ln.Addr())
			}
			reg := newRegistry()
			e, err := ef.build(f.dataDir, store, token, advertise, servers, log, reg)
			if err != nil {
				return err
			}
			metrics, metricsLn, err := mf.open(f.dataDir, reg)
			if err != nil {
				ef.close(cmd.Context(), e, log)
				return err
			}
			if metricsLn != nil {
				defer metricsLn.Close()
			}
			mux := newMux(metrics)
			e.Mount(mux)
			log.Info("dsec edge listening", "node", ef.nodeID, "advertise", advertise, "servers", servers)
			printBounds(cmd.OutOrStdout(), e.Bounds())
			fmt.Fprintln(cmd.OutOrStdout(), ef.vm.status)
			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			var wg sync.WaitGroup
			wg.Go(func() { e.Run(ctx) })
			wg.Go(func() { serveMetrics(ctx, cancel, &mf, metricsLn, reg, log) })
			err = serveUntil(ctx, newHTTPServer(mux, log), ln)
			cancel()
			wg.Wait()
			ef.close(cmd.Context(), e, log)
			return err
		},
	}
	fl := cmd.Flags()
	fl.StringSliceVar(&servers, "server", nil, "control-plane URL(s) to heartbeat to (repeatable or comma-separated)")
	fl.StringVar(&advertise, "advertise", "", "URL servers reach this edge at (default http://LISTEN-ADDR)")
	fl.StringVar(&f.dataDir, "data-dir", defaultDataDir, "this node's data directory (sandbox state, layer mounts)")
	fl.StringVar(&f.listen, "listen", defaultEdgeListen, "address to serve EdgeService on")
	f.registerStore(cmd, "blob store URL shared with the servers (default DATA-DIR/blobs)")
	fl.StringVar(&f.tokenFile, "cluster-token-file", "", "the servers' shared secret (default DATA-DIR/cluster.token)")
	fl.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	ef.register(cmd)
	mf.register(cmd)
	return cmd
}

// printBounds says what bounds the node's capacity and by how much, the
// tightest first: what an operator raises to hold more sandboxes.
func printBounds(w io.Writer, bounds []edge.Bound) {
	if len(bounds) == 0 {
		return
	}
	fmt.Fprintf(w, "capacity: at most %d idle sandboxes, bound by %s\n", bounds[0].Sandboxes, bounds[0].What)
	for _, b := range bounds {
		fmt.Fprintf(w, "  %-14s %8d  %s\n", b.What, b.Sandboxes, b.Detail)
	}
}
