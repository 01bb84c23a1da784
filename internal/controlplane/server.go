// Package controlplane is DSec's API server: it authenticates callers (see
// package iam), places sandboxes on edges, and routes every later call on a
// sandbox to the edge that owns it.
//
// It keeps no durable state of its own. Tenants and images live in the blob
// store; which nodes exist, what they hold and which sandboxes they run is
// soft state rebuilt from edge heartbeats. So any number of replicas can run
// side by side behind one address, and a restarted replica is whole again
// after one heartbeat interval.
package controlplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"path/filepath"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/redact"
	"github.com/dsec-dev/dsec/internal/spec"
)

// Defaults for Config fields left zero.
const (
	// DefaultNodeTimeout is ten heartbeats: an edge busy creating hundreds
	// of sandboxes can be late by seconds, and declaring a healthy node lost
	// turns every rollout on it into an infrastructure failure.
	DefaultNodeTimeout   = 10 * time.Second
	DefaultLostRetention = time.Hour
	DefaultQueueSize     = 1024
	DefaultQueueTimeout  = time.Minute
	// DefaultMaxImportBytes bounds an import (after decompression) when
	// neither the tenant's quota nor the server's config say: room for a
	// full language image, not for a decompression bomb.
	DefaultMaxImportBytes = 8 << 30
	// maxCreateAttempts bounds how many edges one create tries before
	// giving up: each refusal excludes that edge.
	maxCreateAttempts = 3
	// maxBatch is the largest BatchCreate (the paper's 32K burst).
	maxBatch = 32768
	// fanout bounds concurrent edge calls of one batch request.
	fanout = 64
)

// Config configures a Server.
type Config struct {
	// DataDir holds admin.token (created on first start, mode 0600).
	DataDir string
	// AdminToken overrides reading/creating DataDir/admin.token.
	AdminToken string
	// Store keeps images and tenants; every replica must share it.
	Store blobstore.Repository
	// ClusterToken is the secret edges and servers present to each other.
	ClusterToken string
	// NodeTimeout is how long a node may go without heartbeating before its
	// sandboxes are reported lost (default 3s).
	NodeTimeout time.Duration
	// LostRetention is how long lost sandboxes and dead nodes are still
	// reported before they are forgotten (default 1h).
	LostRetention time.Duration
	Logger        *slog.Logger
	// Registry receives the server's metrics (nil: a private registry). The
	// caller serves /metrics from its gatherer.
	Registry prometheus.Registerer
	// HTTPClient is used for edge calls; nil builds one suited to them.
	HTTPClient *http.Client
	// LocalEdges are edges in this process (`dsec up`), by the URL each
	// advertises in its heartbeats (http://HOST:PORT): the server calls
	// such an edge's handler (its EdgeService behind the cluster token
	// check) directly instead of over the network. Other edges, and
	// these under any other URL, are reached over HTTP.
	LocalEdges map[string]http.Handler
	// QueueSize bounds the creates waiting for room when every node is
	// full (default 1024); beyond it a create is Unavailable with a
	// retry-after hint. QueueTimeout bounds the wait of a create whose
	// caller set no deadline (default 60s).
	QueueSize    int
	QueueTimeout time.Duration
	// RunCodeOpen lists networks whose callers may use /run_code without a
	// token (SandboxFusion clients send none); they run as the admin's
	// tenant-less identity. Empty: a token is always required.
	RunCodeOpen []netip.Prefix
	// Defaults are the node defaults the server fills into specs while no
	// live node has reported its own (heartbeats carry them; `dsec up`
	// passes its edge's). Zero fields take spec.Builtin.
	Defaults spec.Resources
	// MaxImportBytes bounds an image import after decompression for
	// tenants whose quota does not set max_import_bytes, and for the
	// admin (default DefaultMaxImportBytes).
	MaxImportBytes int64
}

// Server is one control-plane replica.
type Server struct {
	cfg     Config
	log     *slog.Logger
	iam     *iam.IAM
	images  *image.Store
	reg     *registry
	edges   *edgeClients
	metrics *metrics
	// redact keeps host paths (data dir, blob store) out of what callers
	// are told.
	redact *redact.Redactor
	// queued counts creates waiting in the admission queue.
	queued atomic.Int64
	// started is when New ran: the registry knows every live edge's held
	// layers only a node timeout later (GarbageCollect waits for that).
	started time.Time
}

// New builds a server from cfg. It creates DataDir/admin.token if it does
// not exist.
func New(cfg Config) (*Server, error) {
	if cfg.Store == nil {
		return nil, errors.New("controlplane: Config.Store is nil")
	}
	if cfg.ClusterToken == "" {
		return nil, errors.New("controlplane: Config.ClusterToken is empty")
	}
	if cfg.NodeTimeout < 0 || cfg.LostRetention < 0 {
		return nil, fmt.Errorf("controlplane: NodeTimeout %v and LostRetention %v must not be negative", cfg.NodeTimeout, cfg.LostRetention)
	}
	if cfg.NodeTimeout == 0 {
		cfg.NodeTimeout = DefaultNodeTimeout
	}
	if cfg.LostRetention == 0 {
		cfg.LostRetention = DefaultLostRetention
	}
	if cfg.QueueSize == 0 {
		cfg.QueueSize = DefaultQueueSize
	}
	if cfg.QueueTimeout == 0 {
		cfg.QueueTimeout = DefaultQueueTimeout
	}
	defaults, err := spec.NodeDefaults(cfg.Defaults)
	if err != nil {
		return nil, fmt.Errorf("controlplane: Config.Defaults: %w", err)
	}
	cfg.Defaults = defaults
	if cfg.MaxImportBytes < 0 {
		return nil, fmt.Errorf("controlplane: Config.MaxImportBytes %d is negative", cfg.MaxImportBytes)
	}
	if cfg.MaxImportBytes == 0 {
		cfg.MaxImportBytes = DefaultMaxImportBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	edges, err := newEdgeClients(cfg)
	if err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	if cfg.AdminToken == "" {
		if cfg.DataDir == "" {
			return nil, errors.New("controlplane: Config.DataDir is empty and no AdminToken given")
		}
		tok, err := iam.EnsureTokenFile(filepath.Join(cfg.DataDir, iam.AdminTokenFile))
		if err != nil {
			return nil, fmt.Errorf("controlplane: admin token: %w", err)
		}
		cfg.AdminToken = tok
	}
	auth, err := iam.New(cfg.AdminToken, cfg.Store)
	if err != nil {
		return nil, fmt.Errorf("controlplane: %w", err)
	}
	s := &Server{
		started: time.Now(),
		cfg:     cfg,
		log:     cfg.Logger.With("component", "server"),
		iam:     auth,
		images:  image.NewStore(cfg.Store, cfg.Store.Refs()),
		reg:     newRegistry(cfg.NodeTimeout, cfg.LostRetention),
		edges:   edges,
	}
	edges.transport.answered = s.reg.answered
	edges.transport.now = s.reg.sentAt
	roots := []string{cfg.DataDir}
	if ing, ok := cfg.Store.(blobstore.Ingester); ok {
		// The store's own temp dir (spooled uploads, extracted trees) and
		// the store around it.
		roots = append(roots, ing.TempDir(), filepath.Dir(ing.TempDir()))
	}
	s.redact = redact.New(s.log, roots...)
	m, err := newMetrics(cfg.Registry, s.reg)
	if err != nil {
		return nil, fmt.Errorf("controlplane: metrics: %w", err)
	}
	s.metrics = m
	return s, nil
}

// Mount registers the public services (bearer-token auth), /run_code and
// NodeService (cluster-token auth) on mux. Every caller is authenticated
// before its body is read, every body is bounded (limits.MaxRequestBytes,
// on the wire and inflated), and nothing is answered unauthenticated but
// /run_code from the networks Config.RunCodeOpen lists.
func (s *Server) Mount(mux *http.ServeMux) {
	opts := connect.WithHandlerOptions(limits.HandlerOptions(limits.MaxRequestBytes), connect.WithInterceptors(s.redact.Interceptor()))
	public := func(path string, h http.Handler) {
		mux.Handle(path, s.authenticated(limits.Body(h, limits.MaxRequestBytes)))
	}
	public(dsecv1connect.NewSandboxServiceHandler(&sandboxService{s: s}, opts))
	public(dsecv1connect.NewTenantServiceHandler(&tenantService{s: s}, opts))
	public(dsecv1connect.NewPoolServiceHandler(&poolService{s: s}, opts))
	public(dsecv1connect.NewFnServiceHandler(&fnService{s: s}, opts))
	public(dsecv1connect.NewClusterServiceHandler(&clusterService{s: s}, opts))
	// Import is a client stream of chunks: each message is bounded (opts),
	// the upload as a whole goes to disk, not memory.
	path, h := dsecv1connect.NewImageServiceHandler(&imageService{s: s}, opts)
	mux.Handle(path, s.authenticated(h))
	mux.HandleFunc("/run_code", s.serveRunCode)
	path, h = dsecv1connect.NewNodeServiceHandler(&nodeService{s: s}, opts)
	mux.Handle(path, requireClusterToken(s.cfg.ClusterToken, limits.Body(h, limits.MaxRequestBytes)))
}

// Run expires nodes that stopped heartbeating and forgets what is past
// retention, until ctx ends.
func (s *Server) Run(ctx context.Context) error {
	tick := time.NewTicker(max(s.cfg.NodeTimeout/4, 50*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			for _, id := range s.reg.sweep() {
				s.log.Warn("node stopped heartbeating; its sandboxes are lost", "node", id, "timeout", s.cfg.NodeTimeout)
			}
		}
	}
}

// heartbeatInterval is what edges are told: three heartbeats per timeout,
// at least one a second (the field is in whole seconds).
func (s *Server) heartbeatInterval() int32 {
	return int32(max(1, int64(s.cfg.NodeTimeout/time.Second)/3))
}
