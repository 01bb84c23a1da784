// Package dsec is the Go client for DSec, the elastic sandbox platform for
// agentic RL. A trainer creates sandboxes, runs commands in them turn after
// turn, moves files in and out, and destroys them:
//
//	c := dsec.New("", "") // DSEC_ENDPOINT and DSEC_TOKEN, or the local defaults
//	sb, err := c.Create(ctx, dsec.Spec{Image: "busybox:latest"})
//	res, err := sb.Exec(ctx, "echo", "hello")
//	defer sb.Destroy(ctx)
//
// Every call takes a context and speaks the Connect protocol to the public
// API. Errors keep their Connect code, so callers branch with IsNotFound,
// IsResourceExhausted and friends instead of parsing messages. An exec whose
// sandbox or node failed is not an error: it returns an ExecResult whose
// Outcome is OutcomeInfraError, so a trainer can mask it rather than learn
// from it.
//
// Trainers driving many sandboxes at once use the batch calls (Acquire,
// BatchExec, BatchRollback, Release): one request for the whole batch, one
// result per item, and one item's failure never fails the others. Warm
// pools (CreatePool) keep sandboxes of a spec ready ahead of demand, and
// RunCode is a stateless "run this code in that language" call.
//
// When the service is saturated it queues creates within their deadline
// and, once its queue is full, refuses with Unavailable and a hint of when
// to come back: RetryAfter(err) reads it. The client never re-sends a
// create by itself (it cannot know whether the caller still wants it).
package dsec

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
)

// Defaults used when New gets empty arguments and the environment is unset.
const (
	DefaultEndpoint  = "http://127.0.0.1:7110"
	DefaultTokenFile = "/var/lib/dsec/admin.token"
)

// Environment variables read by New.
const (
	EnvEndpoint = "DSEC_ENDPOINT"
	EnvToken    = "DSEC_TOKEN"
)

// Client talks to one DSec API endpoint. It is safe for concurrent use;
// create one per process and share it.
type Client struct {
	endpoint  string
	sandboxes dsecv1connect.SandboxServiceClient
	images    dsecv1connect.ImageServiceClient
	tenants   dsecv1connect.TenantServiceClient
	pools     dsecv1connect.PoolServiceClient
	fn        dsecv1connect.FnServiceClient
	cluster   dsecv1connect.ClusterServiceClient
}

type options struct {
	httpClient connect.HTTPClient
	connect    []connect.ClientOption
}

// Option configures a Client.
type Option func(*options)

// WithHTTPClient replaces the HTTP client. The default speaks HTTP/2 without
// TLS (h2c) to http:// endpoints, so thousands of concurrent calls share a
// few connections, and ordinary HTTP/2 over TLS to https:// endpoints.
func WithHTTPClient(c connect.HTTPClient) Option {
	return func(o *options) { o.httpClient = c }
}

// WithConnectOptions passes extra options to the generated Connect clients
// (for example connect.WithGRPC() to speak gRPC instead of Connect).
func WithConnectOptions(opts ...connect.ClientOption) Option {
	return func(o *options) { o.connect = append(o.connect, opts...) }
}

// New returns a client for endpoint authenticating with token. An empty
// endpoint means $DSEC_ENDPOINT, else DefaultEndpoint; an empty token means
// $DSEC_TOKEN, else the contents of DefaultTokenFile when it is readable
// (the admin token of a local `dsec up`).
func New(endpoint, token string, opts ...Option) *Client {
	endpoint = ResolveEndpoint(endpoint)
	token = ResolveToken(token)
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.httpClient == nil {
		o.httpClient = defaultHTTPClient(endpoint)
	}
	copts := append([]connect.ClientOption{connect.WithInterceptors(bearer(token))}, o.connect...)
	return &Client{
		endpoint:  endpoint,
		sandboxes: dsecv1connect.NewSandboxServiceClient(o.httpClient, endpoint, copts...),
		images:    dsecv1connect.NewImageServiceClient(o.httpClient, endpoint, copts...),
		tenants:   dsecv1connect.NewTenantServiceClient(o.httpClient, endpoint, copts...),
		pools:     dsecv1connect.NewPoolServiceClient(o.httpClient, endpoint, copts...),
		fn:        dsecv1connect.NewFnServiceClient(o.httpClient, endpoint, copts...),
		cluster:   dsecv1connect.NewClusterServiceClient(o.httpClient, endpoint, copts...),
	}
}

// Endpoint returns the base URL the client talks to.
func (c *Client) Endpoint() string { return c.endpoint }

// ResolveEndpoint applies New's defaults to endpoint.
func ResolveEndpoint(endpoint string) string {
	if endpoint == "" {
		endpoint = os.Getenv(EnvEndpoint)
	}
	if endpoint == "" {
		endpoint = DefaultEndpoint
	}
	if !strings.Contains(endpoint, "://") {
		endpoint = "http://" + endpoint
	}
	return strings.TrimRight(endpoint, "/")
}

// ResolveToken applies New's defaults to token.
func ResolveToken(token string) string {
	if token == "" {
		token = os.Getenv(EnvToken)
	}
	if token == "" {
		if b, err := os.ReadFile(DefaultTokenFile); err == nil {
			token = strings.TrimSpace(string(b))
		}
	}
	return token
}

func defaultHTTPClient(endpoint string) *http.Client {
	t := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		TLSClientConfig:     &tls.Config{MinVersion: tls.VersionTLS12},
	}
	if strings.HasPrefix(endpoint, "http://") {
		// Prior-knowledge h2c: the server speaks it on its plain port, and it
		// lets streams (exec output, image upload) share one connection.
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		t.Protocols = &p
	}
	return &http.Client{Transport: t}
}

// bearer adds the Authorization header to every request, unary or streaming.
type bearer string

func (b bearer) header() string { return "Bearer " + string(b) }

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if b != "" {
			req.Header().Set("Authorization", b.header())
		}
		return next(ctx, req)
	}
}

func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if b != "" {
			conn.RequestHeader().Set("Authorization", b.header())
		}
		return conn
	}
}

func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// queued prepares a call that the server may hold in its admission queue
// (creates, Acquire, RunCode) for the caller's deadline. Connect would
// give the server exactly the caller's deadline, and then the server's
// answer ("waited 5s for room", or an Acquire's per-item results and the
// handles of the sandboxes it did create) races the caller's own timeout
// and usually loses. So the server is told a deadline a little earlier
// (a tenth of the time left, at most a second), and the call itself ends
// at the caller's deadline as before. Without a deadline nothing changes.
func queued(ctx context.Context, h http.Header) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return ctx, func() {}
	}
	left := time.Until(deadline)
	server := left - min(time.Second, left/10)
	if server <= 0 {
		return ctx, func() {}
	}
	// Both protocols' headers: the server reads the one it speaks.
	ms := server.Milliseconds()
	h.Set("Connect-Timeout-Ms", strconv.FormatInt(max(ms, 1), 10))
	if ms < 1e8 {
		h.Set("Grpc-Timeout", strconv.FormatInt(max(ms, 1), 10)+"m")
	} else {
		h.Set("Grpc-Timeout", strconv.FormatInt(int64(server/time.Second), 10)+"S")
	}
	// The call keeps the caller's values and ends when the caller's
	// context does, but carries no deadline of its own for Connect to
	// turn into a header.
	call, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	return call, func() { stop(); cancel() }
}
