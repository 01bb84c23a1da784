package controlplane

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/api/dsec/v1/dsecv1connect"
	"github.com/dsec-dev/dsec/internal/inproc"
)

const (
	// edgeCallTimeout bounds edge calls that do not run user commands.
	edgeCallTimeout = 30 * time.Second
	// createTimeout bounds CreateOnEdge: a cold node may first fetch layers.
	createTimeout = 2 * time.Minute
	// execSlack is added to an exec's own timeout for the edge round trip.
	execSlack = 30 * time.Second
)

// edgeClients caches one EdgeService client per edge URL. They share one
// http.Client whose only timeouts are on connecting and on waiting for
// response headers of a dead peer's TCP connection; how long a call may
// take is the caller's context's business, since an exec can legitimately
// run for an hour. Edges in this process (Config.LocalEdges) are served by
// calling their handlers, with no socket (internal/inproc).
type edgeClients struct {
	http      *http.Client
	transport *bearerTransport
	// local serves Config.LocalEdges; nil when there are none.
	local *inproc.Transport
	mu    sync.Mutex
	m     map[string]dsecv1connect.EdgeServiceClient
}

func newEdgeClients(cfg Config) (*edgeClients, error) {
	hc := cfg.HTTPClient
	base := http.RoundTripper(http.DefaultTransport)
	if hc == nil {
		base = &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 15 * time.Second}).DialContext,
			MaxIdleConns:        4096,
			MaxIdleConnsPerHost: 512,
			IdleConnTimeout:     90 * time.Second,
		}
	} else if hc.Transport != nil {
		base = hc.Transport
	}
	var local *inproc.Transport
	if len(cfg.LocalEdges) > 0 {
		var err error
		if local, err = inproc.New(base, cfg.LocalEdges, cfg.Logger); err != nil {
			return nil, fmt.Errorf("Config.LocalEdges: %w", err)
		}
		base = local
	}
	// The token is added before the in-process transport, so a local
	// edge's handler checks it as a remote edge does.
	bt := &bearerTransport{base: base, header: "Bearer " + cfg.ClusterToken}
	c := &http.Client{Transport: bt}
	if hc != nil {
		c.CheckRedirect, c.Jar, c.Timeout = hc.CheckRedirect, hc.Jar, hc.Timeout
	}
	return &edgeClients{http: c, transport: bt, local: local, m: map[string]dsecv1connect.EdgeServiceClient{}}, nil
}

func (e *edgeClients) get(url string) dsecv1connect.EdgeServiceClient {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.m[url]
	if !ok {
		c = dsecv1connect.NewEdgeServiceClient(e.http, url)
		e.m[url] = c
	}
	return c
}

// bearerTransport presents the cluster token on every edge call.
// It also reports every answer: an edge that answers a call is alive
// whatever its heartbeats say (see registry.answered).
type bearerTransport struct {
	base     http.RoundTripper
	header   string
	answered func(url string, sent time.Time)
	// now is the clock answered is given the send time from.
	now func() time.Time
}

func (t *bearerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set("Authorization", t.header)
	var sent time.Time
	if t.answered != nil {
		sent = t.now()
	}
	resp, err := t.base.RoundTrip(req)
	if err == nil && t.answered != nil {
		t.answered(req.URL.Scheme+"://"+req.URL.Host, sent)
	}
	return resp, err
}

// callContext bounds a non-exec edge call.
func callContext(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}
