package main

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/internal/controlplane"
	"github.com/dsec-dev/dsec/internal/placement"
)

func newServerCmd() *cobra.Command {
	var (
		f           daemonFlags
		nodeTimeout time.Duration
		oc          placement.Overcommit
	)
	cmd := &cobra.Command{
		Use:   "server",
		Short: "Run a control-plane replica (API, IAM, placement); edges heartbeat to it",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			log, store, token, err := f.open(true)
			if err != nil {
				return err
			}
			reg := newRegistry()
			srv, err := controlplane.New(controlplane.Config{
				DataDir:      f.dataDir,
				Store:        store,
				ClusterToken: token,
				NodeTimeout:  nodeTimeout,
				Overcommit:   oc,
				Logger:       log,
				Registry:     reg,
			})
			if err != nil {
				return err
			}
			mux := newMux(reg)
			srv.Mount(mux)
			ln, err := net.Listen("tcp", f.listen)
			if err != nil {
				return usagef("--listen %s: %v", f.listen, err)
			}
			log.Info("dsec server listening", "endpoint", loopbackURL(ln.Addr()), "data_dir", f.dataDir)
			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			var wg sync.WaitGroup
			wg.Go(func() { srv.Run(ctx) })
			err = serveUntil(ctx, newHTTPServer(mux, log), ln)
			cancel()
			wg.Wait()
			return err
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.dataDir, "data-dir", defaultDataDir, "data directory (admin.token, cluster.token, default blob store)")
	fl.StringVar(&f.listen, "listen", defaultListen, "address to serve the API on")
	fl.StringVar(&f.store, "store", "", "blob store URL shared by every server and edge (default DATA-DIR/blobs)")
	fl.StringVar(&f.tokenFile, "cluster-token-file", "", "shared secret of servers and edges (default DATA-DIR/cluster.token, created if missing)")
	fl.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fl.DurationVar(&nodeTimeout, "node-timeout", controlplane.DefaultNodeTimeout, "a node silent this long is lost, and so are its sandboxes")
	fl.Float64Var(&oc.CPU, "overcommit-cpu", placement.DefaultOvercommit.CPU, "CPU overcommit ratio (must match the edges')")
	fl.Float64Var(&oc.Memory, "overcommit-memory", placement.DefaultOvercommit.Memory, "memory overcommit ratio (must match the edges')")
	return cmd
}
