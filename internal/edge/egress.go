package edge

import (
	"context"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/aether"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// Egress: every sandbox whose backend relays its proxy listener
// (runtime.Egress) has its connections decided by the node's Aether
// against its policy (spec.network, SetNetwork), each decision recorded on
// its trajectory and in metrics. A sandbox without rules has a proxy that
// refuses everything: default deny, with the refusal recorded.

// egressRun is one running sandbox's relay loop.
type egressRun struct {
	sb     *aether.Sandbox
	cancel context.CancelFunc
	done   chan struct{}
}

// policyOf is the policy sb's spec holds (validated: spec.Validate).
func policyOf(s *dsecv1.SandboxSpec) aether.Policy {
	p, _ := spec.Network("spec.network", s.GetNetwork().GetAllow(), s.GetNetwork().GetDeny())
	return p
}

// startEgressLocked starts relaying rs's proxy connections for sb; the
// caller holds e.mu and has just made rs sb's running runtime.
func (e *Edge) startEgressLocked(sb *sandbox, rs runtime.Sandbox) {
	if e.aether == nil {
		return
	}
	eg, ok := rs.(runtime.Egress)
	if !ok {
		return
	}
	if old := sb.egress; old != nil {
		old.cancel()
		old.sb.Close()
	}
	asb := e.aether.Sandbox(sb.id, policyOf(sb.spec))
	ctx, cancel := context.WithCancel(e.stopCtx)
	run := &egressRun{sb: asb, cancel: cancel, done: make(chan struct{})}
	sb.egress = run
	go func() {
		defer close(run.done)
		err := asb.Run(ctx, func(ctx context.Context) (aether.Conn, error) {
			return eg.AcceptEgress(ctx, aether.ListenAddr)
		})
		if ctx.Err() == nil && errors.Is(err, runtime.ErrFailedPrecondition) {
			// The workload took the proxy's port first: its own egress
			// is gone, and its trajectory says so.
			e.log.Info("sandbox egress stopped", "sandbox", sb.id, "err", err)
			e.recordEgress(sb.id, aether.Event{Start: time.Now(), Time: time.Now(), Rule: "deny: proxy unavailable: " + err.Error()})
		}
	}()
}

// stopEgress ends sb's relay loop and closes its open connections.
func (e *Edge) stopEgress(sb *sandbox) {
	e.mu.Lock()
	run := sb.egress
	sb.egress = nil
	e.mu.Unlock()
	if run != nil {
		run.cancel()
		run.sb.Close()
	}
}

// proxyEnv is what every exec in rs gets for its tools to use the proxy,
// and, for the ecosystems sb's policy allows when the exec starts, the
// node's mirror (aether.MirrorEnv: pip's index, npm's registry).
func (e *Edge) proxyEnv(sb *sandbox, rs runtime.Sandbox, env []string) []string {
	if e.aether == nil {
		return env
	}
	if _, ok := rs.(runtime.Egress); !ok {
		return env
	}
	pre := aether.ProxyEnv()
	if e.mirror != nil {
		e.mu.Lock()
		s := sb.spec
		e.mu.Unlock()
		pre = append(pre, aether.MirrorEnv(policyOf(s))...)
	}
	// The request's own entries come after: the agent takes the last of a
	// key, so a caller may still set its own.
	return append(pre, env...)
}

// newMirror makes the node's package mirror over its blob store, naming
// upstreams through res, with its counters in the edge's metrics; nil
// with Config.NoMirror.
func (e *Edge) newMirror(res *aether.Resolver) *aether.Mirror {
	if e.cfg.NoMirror {
		return nil
	}
	mc := e.cfg.Mirror
	mc.Store, mc.Resolver = e.cfg.Store, res
	m := aether.NewMirror(mc)
	stat := func(f func(aether.MirrorStats) int64) func() float64 {
		return func() float64 { return float64(f(m.Stats())) }
	}
	for _, c := range []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "dsec_edge_mirror_hits_total",
			Help: "Package mirror requests served from the blob store or the index cache (including those that waited for another's fetch)."},
			stat(func(s aether.MirrorStats) int64 { return s.Hits })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "dsec_edge_mirror_misses_total",
			Help: "Package mirror requests that fetched upstream."},
			stat(func(s aether.MirrorStats) int64 { return s.Misses })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "dsec_edge_mirror_served_bytes_total",
			Help: "Bytes the package mirror served to sandboxes."},
			stat(func(s aether.MirrorStats) int64 { return s.BytesServed })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "dsec_edge_mirror_upstream_bytes_total",
			Help: "Bytes the package mirror fetched from upstreams."},
			stat(func(s aether.MirrorStats) int64 { return s.BytesUpstream })),
	} {
		if err := e.cfg.Registry.Register(c); err != nil {
			e.log.Warn("register mirror metrics", "err", err)
		}
	}
	e.mirror = m
	return m
}

// recordEgress puts one decision on the sandbox's trajectory and in metrics.
func (e *Edge) recordEgress(id string, ev aether.Event) {
	decision := "denied"
	if ev.Allowed {
		decision = "allowed"
	}
	e.metrics.egress.WithLabelValues(decision).Inc()
	e.metrics.egressBytes.WithLabelValues("out").Add(float64(ev.BytesOut))
	e.metrics.egressBytes.WithLabelValues("in").Add(float64(ev.BytesIn))
	if e.traj == nil {
		return
	}
	err := e.traj.EgressEvent(context.Background(), id, ev.Start, ev.Time, trajectory.Egress{
		Host: ev.Host, Port: ev.Port, Method: ev.Method, Addr: ev.Addr,
		Allowed: ev.Allowed, Rule: ev.Rule, BytesOut: ev.BytesOut, BytesIn: ev.BytesIn, Ended: ev.Ended,
	})
	if err != nil {
		e.log.Warn("trajectory egress event", "sandbox", id, "err", err)
	}
}

// SetNetworkOnEdge changes or reads a sandbox's egress policy.
func (s *service) SetNetworkOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeSetNetworkRequest]) (*connect.Response[dsecv1.SetNetworkResponse], error) {
	r := req.Msg.GetRequest()
	if r == nil {
		return nil, invalid("request is required")
	}
	add, err := spec.Network("request", r.GetAllow(), r.GetDeny())
	if err != nil {
		return nil, fail.New(fail.InvalidArgument, err)
	}
	e := s.e
	sb, err := e.lookup(req.Msg.GetCaller(), r.GetSandboxId())
	if err != nil {
		return nil, err
	}
	change := r.GetReplace() || len(add.Rules) > 0
	if change && e.aether == nil {
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("node %q runs without egress: sandbox %q has no proxy", e.cfg.NodeID, sb.id))
	}
	e.mu.Lock()
	if !sb.st.Live() {
		e.mu.Unlock()
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("sandbox %q is %s", sb.id, sb.phase()))
	}
	p := policyOf(sb.spec)
	if r.GetReplace() {
		p = add
	} else {
		for _, rule := range add.Rules {
			p = p.With(rule)
		}
	}
	if len(p.Rules) > spec.MaxNetworkRules {
		e.mu.Unlock()
		return nil, invalid("request: the policy would hold %d rules, more than %d", len(p.Rules), spec.MaxNetworkRules)
	}
	if change {
		// sb.spec is shared with readers (Get copies it under e.mu): a
		// new value, not an edit.
		ns := proto.CloneOf(sb.spec)
		ns.Network = spec.NetworkProto(p)
		sb.spec = ns
	}
	run := sb.egress
	e.mu.Unlock()
	closed := 0
	if change && run != nil {
		closed = run.sb.SetPolicy(p)
	}
	return connect.NewResponse(&dsecv1.SetNetworkResponse{Network: spec.NetworkProto(p), Closed: int32(closed)}), nil
}
