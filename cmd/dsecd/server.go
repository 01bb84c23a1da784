package main

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/controlplane"
)

func newServerCmd() *cobra.Command {
	var (
		f           daemonFlags
		sf          serveFlags
		mf          metricsFlags
		nodeTimeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "server",
		Short: short("server"),
		Args:  cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := sf.validate(); err != nil {
				return err
			}
			log, store, token, err := f.open(true)
			if err != nil {
				return err
			}
			reg := newRegistry()
			srv, err := controlplane.New(sf.apply(controlplane.Config{
				DataDir:      f.dataDir,
				Store:        store,
				ClusterToken: token,
				NodeTimeout:  nodeTimeout,
				Logger:       log,
				Registry:     reg,
			}))
			if err != nil {
				return err
			}
			metrics, metricsLn, err := mf.open(f.dataDir, reg)
			if err != nil {
				return err
			}
			if metricsLn != nil {
				defer metricsLn.Close()
			}
			mux := newMux(metrics)
			srv.Mount(mux)
			ln, err := net.Listen("tcp", f.listen)
			if err != nil {
				return cli.Usagef("--listen %s: %v", f.listen, err)
			}
			log.Info("dsec server listening", "endpoint", loopbackURL(ln.Addr()), "data_dir", f.dataDir)
			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			var wg sync.WaitGroup
			wg.Go(func() { srv.Run(ctx) })
			wg.Go(func() { serveMetrics(ctx, cancel, &mf, metricsLn, reg, log) })
			err = serveUntil(ctx, newHTTPServer(mux, log), ln)
			cancel()
			wg.Wait()
			return err
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.dataDir, "data-dir", defaultDataDir, "data directory (admin.token, cluster.token, default blob store)")
	fl.StringVar(&f.listen, "listen", defaultListen, "address to serve the API on")
	f.registerStore(cmd, "blob store URL shared by every server and edge (default DATA-DIR/blobs)")
	fl.StringVar(&f.tokenFile, "cluster-token-file", "", "shared secret of servers and edges (default DATA-DIR/cluster.token, created if missing)")
	fl.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fl.DurationVar(&nodeTimeout, "node-timeout", controlplane.DefaultNodeTimeout, "a node silent this long is lost, and so are its sandboxes")
	sf.register(cmd)
	mf.register(cmd)
	return cmd
}

// serveFlags are the API's admission and /run_code settings, shared by
// server and up.
type serveFlags struct {
	queueSize    int
	queueTimeout time.Duration
	runCodeOpen  []string
	// maxImport is --max-import-size; maxImportBytes it parsed.
	maxImport      string
	maxImportBytes int64
}

func (f *serveFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.IntVar(&f.queueSize, "queue-size", controlplane.DefaultQueueSize, "creates that may wait for room when every node is full; beyond it they are refused with a retry-after hint")
	fl.DurationVar(&f.queueTimeout, "queue-timeout", controlplane.DefaultQueueTimeout, "longest wait for room of a create whose caller set no deadline")
	fl.StringVar(&f.maxImport, "max-import-size", "", fmt.Sprintf("largest image an import may expand to after decompression, for tenants whose quota does not say and for the admin (default %s)", cli.FormatSize(controlplane.DefaultMaxImportBytes)))
	fl.StringSliceVar(&f.runCodeOpen, "run-code-open", nil, "networks (CIDR, e.g. 10.0.0.0/8) whose callers may POST /run_code without a token, for SandboxFusion clients (default: none)")
}

// apply validates the flags into cfg.
func (f *serveFlags) apply(cfg controlplane.Config) controlplane.Config {
	cfg.QueueSize, cfg.QueueTimeout = f.queueSize, f.queueTimeout
	cfg.MaxImportBytes = f.maxImportBytes
	for _, c := range f.runCodeOpen {
		pfx, err := netip.ParsePrefix(strings.TrimSpace(c))
		if err != nil {
			// Checked again by validate before the server starts.
			continue
		}
		cfg.RunCodeOpen = append(cfg.RunCodeOpen, pfx.Masked())
	}
	return cfg
}

// validate reports a malformed flag.
func (f *serveFlags) validate() error {
	if f.queueSize < 1 {
		return cli.Usagef("--queue-size %d: must be at least 1", f.queueSize)
	}
	if f.queueTimeout <= 0 {
		return cli.Usagef("--queue-timeout %s: must be positive", f.queueTimeout)
	}
	if f.maxImport != "" {
		n, err := cli.ParseSize("max-import-size", f.maxImport)
		if err != nil {
			return cli.UsageError{Err: err}
		}
		if n == 0 {
			return cli.Usagef("--max-import-size 0: must be positive")
		}
		f.maxImportBytes = n
	}
	for _, c := range f.runCodeOpen {
		if _, err := netip.ParsePrefix(strings.TrimSpace(c)); err != nil {
			return cli.Usagef("--run-code-open %q: %v (want a CIDR such as 10.0.0.0/8)", c, err)
		}
	}
	return nil
}
