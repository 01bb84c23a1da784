package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/controlplane"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/layer"
)

func newUpCmd() *cobra.Command {
	var (
		f       daemonFlags
		sf      serveFlags
		ef      edgeFlags
		mf      metricsFlags
		imports []string
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: short("up"),
		Long: `Run a control-plane server and one edge in one process, sharing the data
directory and one port. The server calls the edge's service in process (the
same handler, cluster token check included, with no socket); the edge
heartbeats to the server over the port, and the port serves the edge's
service too. Ctrl-C destroys every sandbox and exits.`,
		Args: cli.ExactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := ef.validate(); err != nil {
				return err
			}
			if err := sf.validate(); err != nil {
				return err
			}
			if err := f.validateStore(); err != nil {
				return err
			}
			if err := os.MkdirAll(f.dataDir, 0o755); err != nil {
				return fmt.Errorf("--data-dir: %w", err)
			}
			log, store, token, err := f.open(true)
			if err != nil {
				return err
			}
			if err := seedImages(cmd.Context(), store, imports, log); err != nil {
				return err
			}
			ln, err := net.Listen("tcp", f.listen)
			if err != nil {
				return cli.Usagef("--listen %s: %v", f.listen, err)
			}
			defer ln.Close()
			self := loopbackURL(ln.Addr())
			reg := newRegistry()
			// The server reaches this process's edge by calling edgeMux,
			// registered under the URL the edge advertises: every sandbox
			// call is then one HTTP request in this process, not two.
			edgeMux := http.NewServeMux()
			calls := newEdgeCalls(reg)
			srv, err := controlplane.New(sf.apply(controlplane.Config{
				DataDir:      f.dataDir,
				Store:        store,
				ClusterToken: token,
				Defaults:     ef.defaults,
				Logger:       log,
				Registry:     reg,
				LocalEdges:   map[string]http.Handler{self: calls.count(edgeMux, "inproc")},
			}))
			if err != nil {
				return err
			}
			e, err := ef.build(f.dataDir, store, token, self, []string{self}, log, reg)
			if err != nil {
				return err
			}
			e.Mount(edgeMux)
			metrics, metricsLn, err := mf.open(f.dataDir, reg)
			if err != nil {
				ef.close(cmd.Context(), e, log)
				return err
			}
			if metricsLn != nil {
				defer metricsLn.Close()
			}
			// Healthy means usable: until the edge in this process has
			// registered (its first heartbeat, over this very listener), a
			// create would find no node.
			mux := newMuxHealth(metrics, func() error {
				if srv.LiveNodes() == 0 {
					return errors.New("the local edge has not registered yet")
				}
				return nil
			})
			srv.Mount(mux)
			// Still served on the port, for servers of other processes.
			mux.Handle("/"+dsecv1connect.EdgeServiceName+"/", calls.count(edgeMux, "network"))

			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			var wg sync.WaitGroup
			wg.Go(func() { srv.Run(ctx) })
			wg.Go(func() { e.Run(ctx) })
			wg.Go(func() { serveMetrics(ctx, cancel, &mf, metricsLn, reg, log) })
			tokenPath := filepath.Join(f.dataDir, iam.AdminTokenFile)
			fmt.Fprintf(cmd.OutOrStdout(), "dsec up: serving on %s (node %s)\nadmin token: %s\n", self, ef.nodeID, tokenPath)
			if f.dataDir != defaultDataDir || self != "http://"+defaultListen {
				fmt.Fprintf(cmd.OutOrStdout(), "clients: export DSEC_ENDPOINT=%s DSEC_TOKEN=$(cat %s)\n", self, tokenPath)
			}
			printBounds(cmd.OutOrStdout(), e.Bounds())
			fmt.Fprintln(cmd.OutOrStdout(), ef.vm.status)
			err = serveUntil(ctx, newHTTPServer(mux, log), ln)
			cancel()
			wg.Wait()
			log.Info("shutting down: destroying sandboxes")
			ef.close(cmd.Context(), e, log)
			return err
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.dataDir, "data-dir", defaultDataDir, "data directory (blobs, sandboxes, layers, tokens)")
	fl.StringVar(&f.listen, "listen", defaultListen, "address to serve the API on")
	f.registerStore(cmd, "blob store URL (default DATA-DIR/blobs)")
	fl.StringVar(&f.tokenFile, "cluster-token-file", "", "shared secret for extra edges (default DATA-DIR/cluster.token)")
	fl.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fl.StringArrayVar(&imports, "import", nil, "NAME:TAG=PATH: import PATH as a public image before serving, unless NAME:TAG exists (repeatable)")
	ef.register(cmd)
	sf.register(cmd)
	mf.register(cmd)
	return cmd
}

// seedImages imports starter images straight into the local store, so that
// `make up` needs no running server to provide one. An existing ref is left
// alone: restarting keeps whatever the user has tagged since.
func seedImages(ctx context.Context, store blobstore.Repository, specs []string, log *slog.Logger) error {
	images := image.NewStore(store, store.Refs())
	for _, spec := range specs {
		ref, path, ok := strings.Cut(spec, "=")
		if !ok || ref == "" || path == "" {
			return cli.Usagef("--import %q: want NAME:TAG=PATH", spec)
		}
		if _, err := image.ParseRef(ref); err != nil {
			return cli.Usagef("--import %q: %v", spec, err)
		}
		_, _, err := images.Get(ctx, ref)
		if err == nil {
			continue
		}
		if !errors.Is(err, image.ErrNotFound) {
			return fmt.Errorf("--import %s: %w", ref, err)
		}
		m, err := layer.Import(ctx, store, images, ref, path, nil)
		if err != nil {
			return fmt.Errorf("--import %s: %w", ref, err)
		}
		log.Info("imported starter image", "ref", ref, "path", path, "layers", len(m.Layers))
	}
	return nil
}

// edgeCalls counts the requests `dsec up`'s edge serves by the way they
// came: "inproc" from this process's server, "network" over the port. The
// second stays at zero unless something else calls the edge, which is how
// one sees that the shortcut is in use.
type edgeCalls struct{ c *prometheus.CounterVec }

func newEdgeCalls(reg prometheus.Registerer) edgeCalls {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "dsec_up_edge_requests_total",
		Help: "EdgeService requests served by the edge of dsec up, by how they came: inproc (from this process's server, no socket) or network.",
	}, []string{"via"})
	reg.MustRegister(c)
	return edgeCalls{c}
}

func (e edgeCalls) count(h http.Handler, via string) http.Handler {
	c := e.c.WithLabelValues(via)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.Inc()
		h.ServeHTTP(w, r)
	})
}
