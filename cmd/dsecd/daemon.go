package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/dsec-dev/dsec/cmd/dsec/cli"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/s3store"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/ids"
)

// Defaults of the daemon commands.
const (
	defaultDataDir    = "/var/lib/dsec"
	defaultListen     = "127.0.0.1:7110"
	defaultEdgeListen = "127.0.0.1:7111"
	clusterTokenFile  = "cluster.token"
	// shutdownTimeout bounds a clean stop (destroying every sandbox).
	shutdownTimeout = 60 * time.Second
)

// daemonFlags are shared by up, server and edge.
type daemonFlags struct {
	dataDir    string
	listen     string
	store      string
	s3Endpoint string
	tokenFile  string
	logLevel   string
}

// registerStore adds --store (described by usage) and --s3-endpoint.
func (f *daemonFlags) registerStore(cmd *cobra.Command, usage string) {
	fl := cmd.Flags()
	fl.StringVar(&f.store, "store", "", usage+"; dir:///PATH, a path, or s3://BUCKET[/PREFIX] with --s3-endpoint")
	fl.StringVar(&f.s3Endpoint, "s3-endpoint", "", "S3 server of an s3:// --store, http[s]://HOST[:PORT] (https: TLS); credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
}

// open does what every daemon does first: its logger, the blob store and
// the cluster token (created if missing when createToken is set).
func (f *daemonFlags) open(createToken bool) (*slog.Logger, blobstore.Repository, string, error) {
	log, err := f.logger()
	if err != nil {
		return nil, nil, "", err
	}
	store, err := f.openStore(context.Background())
	if err != nil {
		return nil, nil, "", err
	}
	token, err := f.clusterToken(createToken)
	if err != nil {
		return nil, nil, "", err
	}
	return log, store, token, nil
}

func (f *daemonFlags) logger() (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(f.logLevel)); err != nil {
		return nil, cli.Usagef("--log-level %q: want debug, info, warn or error", f.logLevel)
	}
	l := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	slog.SetDefault(l)
	return l, nil
}

// openStore opens --store, or the data dir's own blob store. An s3 store
// is put behind a Cache in DATA-DIR/blobcache: layers are mounted from
// local files, fetched once per node.
func (f *daemonFlags) openStore(ctx context.Context) (blobstore.Repository, error) {
	u := f.store
	if u == "" {
		u = filepath.Join(f.dataDir, "blobs")
	}
	if err := f.validateStore(); err != nil {
		return nil, err
	}
	if strings.HasPrefix(u, "s3://") {
		return f.openS3(ctx, u)
	}
	repo, err := blobstore.New(u)
	if err != nil {
		return nil, fmt.Errorf("--store: %w", err)
	}
	return repo, nil
}

// validateStore refuses --store and --s3-endpoint that do not go
// together, before anything is made on disk.
func (f *daemonFlags) validateStore() error {
	if !strings.HasPrefix(f.store, "s3://") {
		if f.s3Endpoint != "" {
			return cli.Usagef("--s3-endpoint is for an s3:// --store, not %q", f.store)
		}
		return nil
	}
	if _, _, err := s3store.ParseURL(f.store); err != nil {
		return cli.Usagef("--store: %v", err)
	}
	if f.s3Endpoint == "" {
		return cli.Usagef("--store %s: give the S3 server with --s3-endpoint http[s]://HOST[:PORT]", f.store)
	}
	if !strings.HasPrefix(f.s3Endpoint, "http://") && !strings.HasPrefix(f.s3Endpoint, "https://") {
		return cli.Usagef("--s3-endpoint %q: want http[s]://HOST[:PORT]", f.s3Endpoint)
	}
	return nil
}

func (f *daemonFlags) openS3(ctx context.Context, u string) (blobstore.Repository, error) {
	bucket, prefix, err := s3store.ParseURL(u)
	if err != nil {
		return nil, cli.Usagef("--store: %v", err)
	}
	local, err := blobstore.NewDir(filepath.Join(f.dataDir, "blobcache"))
	if err != nil {
		return nil, fmt.Errorf("--store %s: node cache: %w", u, err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	remote, err := s3store.Open(ctx, s3store.Config{
		Bucket: bucket, Prefix: prefix, Endpoint: f.s3Endpoint,
		// Spooled blobs and built layers on the cache's file system, so
		// that ingesting into the cache is a rename.
		TempDir: local.TempDir(),
	})
	if err != nil {
		return nil, fmt.Errorf("--store %s: %w", u, err)
	}
	return blobstore.NewCache(remote, local), nil
}

// clusterToken reads the shared secret of servers and edges: from
// --cluster-token-file, else from the data dir. create makes the file when
// it is missing (servers and `up` do; an edge must be given the servers'
// secret, so it only reads).
func (f *daemonFlags) clusterToken(create bool) (string, error) {
	path := f.tokenFile
	if path == "" {
		path = filepath.Join(f.dataDir, clusterTokenFile)
	}
	if create {
		tok, err := iam.EnsureTokenFile(path)
		if err != nil {
			return "", fmt.Errorf("cluster token: %w", err)
		}
		return tok, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("cluster token (give the servers' secret with --cluster-token-file): %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("cluster token file %s is empty", path)
	}
	return tok, nil
}

// newRegistry returns a metrics registry with the Go runtime and process
// collectors that every daemon exposes.
func newRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}

// newMux returns the process's one mux with /healthz on it, and metrics
// (nil: served elsewhere, see metricsFlags) at /metrics.
func newMux(metrics http.Handler) *http.ServeMux {
	return newMuxHealth(metrics, nil)
}

// newMuxHealth is newMux whose /healthz answers 503 with the reason while
// ready returns an error. /healthz is the one path served to anyone: it
// says "ok" or why not, nothing else.
func newMuxHealth(metrics http.Handler, ready func() error) *http.ServeMux {
	mux := http.NewServeMux()
	if metrics != nil {
		mux.Handle("/metrics", metrics)
	}
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if ready != nil {
			if err := ready(); err != nil {
				http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// metricsFile is the default file of the token /metrics asks for.
const metricsFile = "metrics.token"

// metricsFlags say where /metrics is served: on the daemon's port behind
// a token of its own (the default; a Prometheus scrape config names the
// token file as its authorization credentials), or with --metrics-addr on
// a listener of its own without a token (bind it to an address only the
// monitoring network reaches).
type metricsFlags struct {
	addr      string
	tokenFile string
}

func (f *metricsFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.addr, "metrics-addr", "", "serve /metrics on this address of its own, without a token, and not on the main port (default: on the main port, behind the metrics token)")
	fl.StringVar(&f.tokenFile, "metrics-token-file", "", "bearer token /metrics on the main port asks for (default DATA-DIR/metrics.token, created if missing): give it to Prometheus as authorization.credentials_file")
}

// open returns the handler for /metrics on the main port (nil when it has
// its own listener) and that listener (nil when it has none).
func (f *metricsFlags) open(dataDir string, reg *prometheus.Registry) (http.Handler, net.Listener, error) {
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg})
	if f.addr != "" {
		ln, err := net.Listen("tcp", f.addr)
		if err != nil {
			return nil, nil, cli.Usagef("--metrics-addr %s: %v", f.addr, err)
		}
		return nil, ln, nil
	}
	path := f.tokenFile
	if path == "" {
		path = filepath.Join(dataDir, metricsFile)
	}
	tok, err := iam.EnsureTokenFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("metrics token: %w", err)
	}
	return requireToken(tok, h), nil, nil
}

// serve serves /metrics on ln (when open made one) until ctx ends.
func (f *metricsFlags) serve(ctx context.Context, ln net.Listener, reg *prometheus.Registry, log *slog.Logger) error {
	if ln == nil {
		return nil
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	return serveUntil(ctx, newHTTPServer(mux, log), ln)
}

// serveMetrics runs mf.serve for a daemon: a metrics listener that fails
// stops the daemon (cancel), as its main listener would.
func serveMetrics(ctx context.Context, cancel context.CancelFunc, mf *metricsFlags, ln net.Listener, reg *prometheus.Registry, log *slog.Logger) {
	if err := mf.serve(ctx, ln, reg, log); err != nil {
		log.Error("metrics listener failed", "err", err)
		cancel()
	}
}

// requireToken serves h only to requests bearing token.
func requireToken(token string, h http.Handler) http.Handler {
	want := sha256.Sum256([]byte(token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, ok := iam.BearerToken(r.Header.Get("Authorization"))
		got := sha256.Sum256([]byte(tok))
		if !ok || subtle.ConstantTimeCompare(want[:], got[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="dsec metrics"`)
			http.Error(w, "/metrics needs Authorization: Bearer <the metrics token> (DATA-DIR/metrics.token or --metrics-token-file), or run with --metrics-addr", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// newHTTPServer serves HTTP/1.1 and cleartext HTTP/2 (h2c) on one port, so
// gRPC, gRPC-Web, Connect and curl all work without TLS.
func newHTTPServer(h http.Handler, log *slog.Logger) *http.Server {
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	return &http.Server{
		Handler:           h,
		Protocols:         &p,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
}

// loopbackURL is the URL at which this process reaches a listener: a
// wildcard address becomes 127.0.0.1.
func loopbackURL(addr net.Addr) string {
	tcp, ok := addr.(*net.TCPAddr)
	if !ok {
		return "http://" + addr.String()
	}
	ip := tcp.IP
	if ip == nil || ip.IsUnspecified() {
		ip = net.IPv4(127, 0, 0, 1)
	}
	return "http://" + net.JoinHostPort(ip.String(), fmt.Sprint(tcp.Port))
}

// defaultNodeID derives a node id from the host name.
func defaultNodeID() string {
	h, err := os.Hostname()
	if err != nil {
		return "node"
	}
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '-':
			b.WriteRune(r)
		case r == '.':
			// The first label is the host's short name.
			return finishNodeID(b.String())
		default:
			b.WriteByte('-')
		}
	}
	return finishNodeID(b.String())
}

func finishNodeID(s string) string {
	s = strings.Trim(s, "-")
	if len(s) > 32 {
		s = strings.Trim(s[:32], "-")
	}
	if ids.ValidNode(s) != nil {
		return "node"
	}
	return s
}

// serveUntil serves srv on ln until ctx ends, then shuts it down.
func serveUntil(ctx context.Context, srv *http.Server, ln net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
