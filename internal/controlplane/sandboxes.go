package controlplane

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/placement"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/spec"
)

type sandboxService struct{ s *Server }

// prepared is a validated create: the spec as the user wrote it, the spec
// the edge gets (internal image names; both with the user's explicit
// resources, the requests), the limits the sandbox gets, and what
// placement needs to know (the requests).
type prepared struct {
	user, edge *dsecv1.SandboxSpec
	// limits are the resources the sandbox gets (spec.Resolve): what its
	// tenant's quota is charged and the edge is told.
	limits spec.Resources
	req    placement.Request
	// key matches warm pools of the same spec (edge.PoolKey, on limits).
	key string
	// resolved are the spec's images as read once here: what placement
	// and key were computed from, and what the edge mounts.
	resolved *dsecv1.ResolvedImages
}

// charge is what one sandbox of prep charges its tenant's quota.
func (prep *prepared) charge() iam.Usage {
	return iam.Usage{Sandboxes: 1, MilliCPU: prep.limits.MilliCPU, MemoryBytes: prep.limits.MemoryBytes}
}

// placeReq returns the placement of one sandbox of prep for p (pool: a
// pool of that many, see placeReq.pool).
func (prep *prepared) placeReq(p iam.Principal, quota *iam.Quota, pool int64) placeReq {
	return placeReq{tenant: p.Tenant, quota: quota, req: prep.req, charge: prep.charge(), labels: prep.user.Labels, pool: pool}
}

func validDuration(field string, d *durationpb.Duration) error {
	if d == nil {
		return nil
	}
	if err := d.CheckValid(); err != nil {
		return errf(connect.CodeInvalidArgument, "%s: %w", field, err)
	}
	if d.AsDuration() < 0 {
		return errf(connect.CodeInvalidArgument, "%s: %v is negative", field, d.AsDuration())
	}
	return nil
}

// prepare checks a create by the spec contract (package spec), resolves
// its images for the caller and its resources (spec.Resolve): the
// requests are what the spec states, placed against node capacity; the
// limits fill what it leaves 0 from the tenant's default, else the nodes'
// (as their heartbeats report them, else Config.Defaults). The edge gets
// the limits beside the spec, so the quota charges what the sandbox gets
// and the pool key of a defaulted spec is that of the same values written
// out, while a sandbox that leaves its resources to the defaults
// reserves none of a node's CPU or memory.
func (s *Server) prepare(ctx context.Context, p iam.Principal, in *dsecv1.SandboxSpec) (*prepared, error) {
	user, err := spec.Validate(in)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	var tenantDefaults spec.Resources
	if !p.Admin {
		t, err := s.iam.Tenant(ctx, p.Tenant)
		if err != nil {
			return nil, errf(connect.CodeUnavailable, "tenant %q: %w", p.Tenant, err)
		}
		tenantDefaults = t.Defaults
	}
	requests, limits := spec.Resolve(user, tenantDefaults, s.reg.defaults(s.cfg.Defaults))

	edge := proto.Clone(user).(*dsecv1.SandboxSpec)
	var ms []image.Manifest
	var manifests []string
	resolve := func(field, ref string) (string, error) {
		internal, m, digest, err := s.resolveImage(ctx, p, field, ref)
		if err != nil {
			return "", err
		}
		ms, manifests = append(ms, m), append(manifests, digest)
		return internal, nil
	}
	if edge.Image, err = resolve("spec.image", user.Image); err != nil {
		return nil, err
	}
	if user.Workspace != "" {
		if edge.Workspace, err = resolve("spec.workspace", user.Workspace); err != nil {
			return nil, err
		}
	}
	for i, t := range user.Toolkits {
		if edge.Toolkits[i], err = resolve(fmt.Sprintf("spec.toolkits[%d]", i), t); err != nil {
			return nil, err
		}
	}
	if err := image.CheckBackend(user.Backend, ms, image.SpecFields(user.Workspace != "", len(user.Toolkits))); err != nil {
		return nil, errf(connect.CodeInvalidArgument, "%w", err)
	}
	composed, err := image.Compose(ms, manifests)
	if err != nil {
		return nil, errf(connect.CodeInvalidArgument, "spec.image: %w", err)
	}
	resolved := &dsecv1.ResolvedImages{
		Env: composed.Config.Env, Workdir: composed.Config.WorkingDir, User: composed.Config.User, Manifests: composed.Manifests,
	}
	layers := make([]placement.LayerRef, len(composed.Layers))
	digests := make([]string, len(composed.Layers))
	for i, l := range composed.Layers {
		layers[i] = placement.LayerRef{Digest: l.Digest, Bytes: l.Size}
		digests[i] = l.Digest
		resolved.Layers = append(resolved.Layers, &dsecv1.ResolvedLayer{Digest: l.Digest, Size: l.Size})
	}
	return &prepared{
		key:      poolKeyOf(user.Backend, digests, limits.Proto(), user.Env),
		user:     user,
		edge:     edge,
		limits:   limits,
		resolved: resolved,
		req: placement.Request{
			Kind: runtime.Kind(user.Backend), MilliCPU: requests.MilliCPU, MemoryBytes: requests.MemoryBytes,
			Layers: layers, Tenant: p.Tenant, Labels: user.Labels,
		},
	}, nil
}

// quotaOf returns the caller's quota; nil means unlimited (the admin).
func (s *Server) quotaOf(ctx context.Context, p iam.Principal) (*iam.Quota, error) {
	if p.Admin {
		return nil, nil
	}
	t, err := s.iam.Tenant(ctx, p.Tenant)
	if err != nil {
		return nil, errf(connect.CodeUnavailable, "tenant %q: %w", p.Tenant, err)
	}
	return &t.Quota, nil
}

// toUser rewrites a sandbox from an edge for display: image names back to
// what the owner wrote.
func toUser(sb *dsecv1.Sandbox) *dsecv1.Sandbox {
	if sb == nil || sb.Spec == nil {
		return sb
	}
	owner := sb.Tenant
	sb.Spec.Image = userRef(sb.Spec.Image, owner)
	sb.Spec.Workspace = userRef(sb.Spec.Workspace, owner)
	for i, t := range sb.Spec.Toolkits {
		sb.Spec.Toolkits[i] = userRef(t, owner)
	}
	return sb
}

// place reserves one sandbox of prep, avoiding the excluded nodes.
func (s *Server) place(p iam.Principal, quota *iam.Quota, prep *prepared, exclude []string) (reservation, error) {
	pr := prep.placeReq(p, quota, 0)
	pr.req.Exclude = exclude
	if len(exclude) == 0 {
		// A node with a ready sandbox of a matching warm pool serves the
		// create in the time of a take, and one with a ready sandbox of
		// the tenant's rebase pool (edge.RebaseKey: any container spec)
		// in the time of a reset: try those nodes first, in that order.
		keys := []string{prep.key}
		if prep.user.Backend == string(runtime.KindContainer) {
			keys = append(keys, edge.RebaseKey(false))
		}
		for _, key := range keys {
			warm := s.reg.warmNodes(key, p.Tenant)
			if len(warm) == 0 {
				continue
			}
			pr.req.Exclude = s.reg.nodesExcept(warm)
			out, err := s.reg.reserve([]placeReq{pr})
			if err == nil && out[0].err == nil {
				s.reg.tookWarm(out[0].node, key)
				return out[0], nil
			}
			pr.req.Exclude = nil
		}
	}
	out, err := s.reg.reserve([]placeReq{pr})
	if err != nil {
		return reservation{}, errf(connect.CodeInternal, "placement: %w", err)
	}
	return out[0], out[0].err
}

// reserve places one request by load alone (no warm-node preference).
func (s *Server) reserve(pr placeReq) (reservation, error) {
	out, err := s.reg.reserve([]placeReq{pr})
	if err != nil {
		return reservation{}, errf(connect.CodeInternal, "placement: %w", err)
	}
	return out[0], out[0].err
}

// admit does what a create does before it calls an edge: it authorises
// and validates the spec, reads the caller's quota and places the sandbox,
// waiting in the admission queue when every node is full.
func (s *Server) admit(ctx context.Context, p iam.Principal, spec *dsecv1.SandboxSpec) (*prepared, *iam.Quota, reservation, error) {
	prep, err := s.prepare(ctx, p, spec)
	if err != nil {
		return nil, nil, reservation{}, err
	}
	quota, err := s.quotaOf(ctx, p)
	if err != nil {
		return nil, nil, reservation{}, err
	}
	res, err := s.place(p, quota, prep, nil)
	if err != nil {
		if res, err = s.placeOrWait(ctx, p, quota, prep, err); err != nil {
			return nil, nil, reservation{}, err
		}
	}
	return prep, quota, res, nil
}

// onSomeEdge calls try with the placement res and, when the edge refuses
// or cannot be reached before it made anything (try says whether it did:
// then its error is final), places the sandbox again elsewhere, up to
// maxCreateAttempts edges in all. what names the call in the log.
func (s *Server) onSomeEdge(ctx context.Context, p iam.Principal, quota *iam.Quota, prep *prepared, res reservation, what string,
	try func(reservation) (made bool, err error)) error {
	var exclude []string
	for attempt := 1; ; attempt++ {
		made, err := try(res)
		if err == nil || made {
			return err
		}
		s.reg.release(res.id)
		if !retryable(err) || attempt >= maxCreateAttempts || ctx.Err() != nil {
			return err
		}
		s.log.Debug("edge refused "+what+"; placing elsewhere", "node", res.node, "attempt", attempt, "err", err)
		s.metrics.retries.Inc()
		exclude = append(exclude, res.node)
		if res, err = s.place(p, quota, prep, exclude); err != nil {
			// Every node refused or is full: wait for room as a
			// create the first placement found no room for does.
			// Edges and servers charge by the same rule, so a refusal
			// comes from a node's measured state, which changes.
			if res, err = s.refusedOrWait(ctx, p, quota, prep, err); err != nil {
				return err
			}
			exclude = nil
		}
	}
}

// create finishes a create whose first placement is res (see onSomeEdge).
func (s *Server) create(ctx context.Context, p iam.Principal, quota *iam.Quota, prep *prepared, res reservation) (*dsecv1.Sandbox, error) {
	var sb *dsecv1.Sandbox
	err := s.onSomeEdge(ctx, p, quota, prep, res, "create", func(res reservation) (bool, error) {
		var err error
		if sb, err = s.createOnEdge(ctx, p, prep, res); err == nil {
			s.reg.completed(res.id)
			s.metrics.creates.WithLabelValues(prep.user.Backend).Inc()
		}
		return false, err
	})
	if err != nil {
		return nil, err
	}
	return sb, nil
}

func (s *Server) createOnEdge(ctx context.Context, p iam.Principal, prep *prepared, res reservation) (*dsecv1.Sandbox, error) {
	ctx, cancel := callContext(ctx, createTimeout)
	defer cancel()
	resp, err := s.edges.get(res.url).CreateOnEdge(ctx, connect.NewRequest(&dsecv1.EdgeCreateRequest{
		Caller: callerOf(p), SandboxId: res.id, Spec: prep.edge, Limits: prep.limits.Proto(), Resolved: prep.resolved,
	}))
	if err != nil {
		return nil, err
	}
	sb := resp.Msg.GetSandbox()
	if sb == nil {
		return nil, errf(connect.CodeInternal, "node %s returned no sandbox for %s", res.node, res.id)
	}
	return toUser(sb), nil
}

func (ss *sandboxService) Create(ctx context.Context, req *connect.Request[dsecv1.CreateSandboxRequest]) (*connect.Response[dsecv1.CreateSandboxResponse], error) {
	s := ss.s
	sb, err := func() (*dsecv1.Sandbox, error) {
		p, err := principal(ctx)
		if err != nil {
			return nil, err
		}
		prep, quota, res, err := s.admit(ctx, p, req.Msg.GetSpec())
		if err != nil {
			return nil, err
		}
		return s.create(ctx, p, quota, prep, res)
	}()
	if err != nil {
		s.metrics.fail("create", err)
		return nil, err
	}
	return connect.NewResponse(&dsecv1.CreateSandboxResponse{Sandbox: sb}), nil
}

func (ss *sandboxService) BatchCreate(ctx context.Context, req *connect.Request[dsecv1.BatchCreateSandboxesRequest]) (*connect.Response[dsecv1.BatchCreateSandboxesResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	results, err := ss.s.batchCreate(ctx, p, req.Msg.GetSpec(), req.Msg.GetCount())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.BatchCreateSandboxesResponse{Results: results}), nil
}

// batchCreate creates count sandboxes of one spec (BatchCreate, Acquire).
func (s *Server) batchCreate(ctx context.Context, p iam.Principal, spec *dsecv1.SandboxSpec, count int32) ([]*dsecv1.BatchCreateResult, error) {
	n := int(count)
	if n < 1 || n > maxBatch {
		return nil, errf(connect.CodeInvalidArgument, "count: %d is outside [1, %d]", count, maxBatch)
	}
	prep, err := s.prepare(ctx, p, spec)
	if err != nil {
		return nil, err
	}
	quota, err := s.quotaOf(ctx, p)
	if err != nil {
		return nil, err
	}
	reqs := make([]placeReq, n)
	for i := range reqs {
		reqs[i] = prep.placeReq(p, quota, 0)
	}
	// One placement call for the whole batch spreads it over the nodes.
	placed, err := s.reg.reserve(reqs)
	if err != nil {
		return nil, errf(connect.CodeInternal, "placement: %w", err)
	}
	results := make([]*dsecv1.BatchCreateResult, n)
	sem := make(chan struct{}, fanout)
	var wg sync.WaitGroup
	for i, res := range placed {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if res.err != nil {
				// Nothing had room at once: wait for room like a single
				// create (bounded queue, deadline).
				var err error
				if res, err = s.placeOrWait(ctx, p, quota, prep, res.err); err != nil {
					s.metrics.fail("create", err)
					results[i] = &dsecv1.BatchCreateResult{Error: s.itemError(err)}
					return
				}
			}
			sb, err := s.create(ctx, p, quota, prep, res)
			if err != nil {
				s.metrics.fail("create", err)
				results[i] = &dsecv1.BatchCreateResult{Error: s.itemError(err)}
				return
			}
			results[i] = &dsecv1.BatchCreateResult{Sandbox: sb}
		}()
	}
	wg.Wait()
	return results, nil
}

// visible reports whether p may see a sandbox owned by tenant.
func visible(p iam.Principal, tenant string) bool { return p.Admin || tenant == p.Tenant }

func notFound(id string) error { return errf(connect.CodeNotFound, "sandbox %q not found", id) }

// locate routes a sandbox ID for p. It returns NotFound for sandboxes p may
// not see and for unknown ones alike.
func (s *Server) locate(p iam.Principal, field, id string) (route, error) {
	if id == "" {
		return route{}, errf(connect.CodeInvalidArgument, "%s: required", field)
	}
	rt, err := s.reg.route(id)
	if err != nil {
		return route{}, errf(connect.CodeInvalidArgument, "%s: %w", field, err)
	}
	if rt.lostReason != "" && !visible(p, rt.summary.GetTenant()) {
		return route{}, notFound(id)
	}
	if rt.lostReason == "" && !rt.alive {
		// An unknown node, or a dead one that never reported this sandbox.
		return route{}, notFound(id)
	}
	return rt, nil
}

func lostView(node string, sum *dsecv1.SandboxSummary, reason string) *dsecv1.Sandbox {
	return summaryToSandbox(node, sum, string(spec.StateLost), reason)
}

func summaryToSandbox(node string, sum *dsecv1.SandboxSummary, state, reason string) *dsecv1.Sandbox {
	return &dsecv1.Sandbox{
		Id: sum.GetId(), Node: node, Tenant: sum.GetTenant(), State: state, Reason: reason,
		Spec: &dsecv1.SandboxSpec{
			Backend:   sum.GetBackend(),
			Labels:    sum.GetLabels(),
			Resources: &dsecv1.Resources{MilliCpu: sum.GetMilliCpu(), MemoryBytes: sum.GetMemoryBytes()},
		},
		// As last measured (a summary carries the figures, not when).
		Usage: sum.GetUsage(),
	}
}

// edgeFailure turns a transport failure of an edge call into Unavailable
// naming the node; answers from the edge pass through.
func edgeFailure(node string, err error) error {
	if unreachable(err) {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s", edgeFault(node, err)))
	}
	return err
}

func (ss *sandboxService) Get(ctx context.Context, req *connect.Request[dsecv1.GetSandboxRequest]) (*connect.Response[dsecv1.GetSandboxResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	rt, err := s.locate(p, "id", req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if rt.lostReason != "" {
		return connect.NewResponse(&dsecv1.GetSandboxResponse{Sandbox: lostView(rt.node, rt.summary, rt.lostReason)}), nil
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).GetOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: callerOf(p), SandboxId: req.Msg.GetId()}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(&dsecv1.GetSandboxResponse{Sandbox: toUser(resp.Msg.GetSandbox())}), nil
}

func labelsMatch(have, want map[string]string) bool {
	for k, v := range want {
		if hv, ok := have[k]; !ok || hv != v {
			return false
		}
	}
	return true
}

func (ss *sandboxService) List(ctx context.Context, req *connect.Request[dsecv1.ListSandboxesRequest]) (*connect.Response[dsecv1.ListSandboxesResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	want := req.Msg.GetLabels()
	live, lost := s.reg.snapshot()
	var (
		mu  sync.Mutex
		out []*dsecv1.Sandbox
		wg  sync.WaitGroup
	)
	for _, e := range live {
		wg.Go(func() {
			cctx, cancel := callContext(ctx, edgeCallTimeout)
			defer cancel()
			resp, err := s.edges.get(e.url).ListOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeListRequest{Caller: callerOf(p), Labels: want}))
			var got []*dsecv1.Sandbox
			if err != nil {
				// Better a heartbeat-old view of this node than a list
				// that silently misses its sandboxes.
				s.log.Warn("list: node did not answer; using its last heartbeat", "node", e.id, "err", err)
				for _, sum := range s.reg.liveSummaries(e.id) {
					if visible(p, sum.GetTenant()) && labelsMatch(sum.GetLabels(), want) {
						got = append(got, summaryToSandbox(e.id, sum, sum.GetState(), ""))
					}
				}
			} else {
				for _, sb := range resp.Msg.GetSandboxes() {
					if visible(p, sb.GetTenant()) && labelsMatch(sb.GetSpec().GetLabels(), want) {
						got = append(got, toUser(sb))
					}
				}
			}
			mu.Lock()
			out = append(out, got...)
			mu.Unlock()
		})
	}
	wg.Wait()
	for _, l := range lost {
		if visible(p, l.summary.GetTenant()) && labelsMatch(l.summary.GetLabels(), want) {
			out = append(out, lostView(l.node, l.summary, l.reason))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetId() < out[j].GetId() })
	return connect.NewResponse(&dsecv1.ListSandboxesResponse{Sandboxes: out}), nil
}

func infraResult(reason string) *dsecv1.ExecResult {
	return &dsecv1.ExecResult{Outcome: string(spec.OutcomeInfraError), InfraError: reason}
}

// validateExec checks an exec request as its edge will (limits.Exec), so
// that bad input is InvalidArgument naming the field before any node is
// involved.
func validateExec(r *dsecv1.ExecRequest) error { return limits.Exec("", r) }

// execContext bounds an exec by its own timeout plus slack for the round
// trip; without a timeout only the caller's context bounds it. The
// timeout was checked (limits.MaxExecTimeout), so the sum cannot
// overflow into a deadline in the past.
func execContext(ctx context.Context, r *dsecv1.ExecRequest) (context.Context, context.CancelFunc) {
	if d := r.GetTimeout().AsDuration(); r.GetTimeout() != nil && d > 0 && d <= limits.MaxExecTimeout {
		return context.WithTimeout(ctx, d+execSlack)
	}
	return context.WithCancel(ctx)
}

func (ss *sandboxService) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest]) (*connect.Response[dsecv1.ExecResponse], error) {
	s := ss.s
	start := time.Now()
	res, err := s.exec(ctx, req.Msg)
	if err != nil {
		s.metrics.fail("exec", err)
		return nil, err
	}
	s.metrics.execTime.WithLabelValues(res.GetOutcome()).Observe(time.Since(start).Seconds())
	return connect.NewResponse(&dsecv1.ExecResponse{Result: res}), nil
}

func (s *Server) exec(ctx context.Context, r *dsecv1.ExecRequest) (*dsecv1.ExecResult, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	// A numbered request goes to its node even when invalid: the node
	// records the refusal under its number (see edge.refuse).
	if err := validateExec(r); err != nil && r.GetSeq() == 0 {
		return nil, err
	}
	rt, err := s.locate(p, "sandbox_id", r.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if rt.lostReason != "" && !(rt.alive && r.GetSeq() != 0) {
		return infraResult(rt.lostReason), nil
	}
	cctx, cancel := execContext(ctx, r)
	defer cancel()
	resp, err := s.edges.get(rt.url).ExecOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeExecRequest{Caller: callerOf(p), Request: r}))
	if err != nil {
		if unreachable(err) && ctx.Err() == nil {
			return infraResult(edgeFault(rt.node, err)), nil
		}
		return nil, err
	}
	if resp.Msg.GetResult() == nil {
		return infraResult(fmt.Sprintf("node %s returned no exec result", rt.node)), nil
	}
	return resp.Msg.GetResult(), nil
}

func (ss *sandboxService) ExecStream(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], out *connect.ServerStream[dsecv1.ExecStreamResponse]) error {
	s := ss.s
	start := time.Now()
	outcome, err := s.execStream(ctx, req.Msg, out)
	if err != nil {
		s.metrics.fail("exec", err)
		return err
	}
	s.metrics.execTime.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	return nil
}

func (s *Server) execStream(ctx context.Context, r *dsecv1.ExecRequest, out *connect.ServerStream[dsecv1.ExecStreamResponse]) (string, error) {
	p, err := principal(ctx)
	if err != nil {
		return "", err
	}
	if err := validateExec(r); err != nil && r.GetSeq() == 0 {
		return "", err
	}
	rt, err := s.locate(p, "sandbox_id", r.GetSandboxId())
	if err != nil {
		return "", err
	}
	sendInfra := func(reason string) (string, error) {
		res := infraResult(reason)
		return res.Outcome, out.Send(&dsecv1.ExecStreamResponse{Event: &dsecv1.ExecStreamResponse_Result{Result: res}})
	}
	if rt.lostReason != "" && !(rt.alive && r.GetSeq() != 0) {
		return sendInfra(rt.lostReason)
	}
	cctx, cancel := execContext(ctx, r)
	defer cancel()
	stream, err := s.edges.get(rt.url).ExecStreamOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeExecRequest{Caller: callerOf(p), Request: r}))
	if err != nil {
		if unreachable(err) && ctx.Err() == nil {
			return sendInfra(edgeFault(rt.node, err))
		}
		return "", err
	}
	defer stream.Close()
	outcome := ""
	for stream.Receive() {
		msg := stream.Msg()
		if res := msg.GetResult(); res != nil {
			outcome = res.GetOutcome()
		}
		if err := out.Send(msg); err != nil {
			return "", err
		}
	}
	err = stream.Err()
	switch {
	case outcome != "":
		return outcome, nil
	case err != nil && !unreachable(err):
		return "", err
	case ctx.Err() != nil:
		return "", toConnect(ctx.Err())
	case err != nil:
		return sendInfra(fmt.Sprintf("node %s stopped answering mid-exec: %v", rt.node, err))
	default:
		return sendInfra(fmt.Sprintf("node %s ended the exec stream without a result", rt.node))
	}
}

// live routes a call that needs a running sandbox: lost sandboxes are
// Unavailable (there is nothing to act on), unless the call carries a
// sequence number and the node is up, since a recorded number is answered
// from the sandbox's trajectory.
func (s *Server) live(p iam.Principal, id string, seq uint64) (route, error) {
	rt, err := s.locate(p, "sandbox_id", id)
	if err != nil {
		return route{}, err
	}
	if rt.lostReason != "" && !(rt.alive && seq != 0) {
		return route{}, errf(connect.CodeUnavailable, "sandbox %q is lost: %s", id, rt.lostReason)
	}
	return rt, nil
}

func (ss *sandboxService) WriteFile(ctx context.Context, req *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	// As for Exec, a numbered request goes to its node even when invalid.
	if err := limits.WriteFile("", req.Msg); err != nil && req.Msg.GetSeq() == 0 {
		return nil, err
	}
	rt, err := s.live(p, req.Msg.GetSandboxId(), req.Msg.GetSeq())
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).WriteFileOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeWriteFileRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (ss *sandboxService) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if err := limits.ReadFile("", req.Msg); err != nil && req.Msg.GetSeq() == 0 {
		return nil, err
	}
	rt, err := s.live(p, req.Msg.GetSandboxId(), req.Msg.GetSeq())
	if err != nil {
		return nil, err
	}
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	resp, err := s.edges.get(rt.url).ReadFileOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeReadFileRequest{Caller: callerOf(p), Request: req.Msg}))
	if err != nil {
		return nil, edgeFailure(rt.node, err)
	}
	return connect.NewResponse(resp.Msg), nil
}

func (s *Server) destroy(ctx context.Context, p iam.Principal, id string) error {
	rt, err := s.locate(p, "id", id)
	if err != nil {
		return err
	}
	if rt.lostReason != "" && !rt.alive {
		return errf(connect.CodeUnavailable, "sandbox %q is lost: %s", id, rt.lostReason)
	}
	// A lost sandbox on a live node (it restarted) has nothing left to
	// tear down, but its node marks it destroyed and ends its trajectory.
	cctx, cancel := callContext(ctx, edgeCallTimeout)
	defer cancel()
	_, err = s.edges.get(rt.url).DestroyOnEdge(cctx, connect.NewRequest(&dsecv1.EdgeSandboxRequest{Caller: callerOf(p), SandboxId: id}))
	if err != nil && !(rt.lostReason != "" && connect.CodeOf(err) == connect.CodeNotFound) {
		return edgeFailure(rt.node, err)
	}
	s.reg.forget(id)
	s.metrics.destroys.Inc()
	return nil
}

func (ss *sandboxService) Destroy(ctx context.Context, req *connect.Request[dsecv1.DestroySandboxRequest]) (*connect.Response[dsecv1.DestroySandboxResponse], error) {
	s := ss.s
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.destroy(ctx, p, req.Msg.GetId()); err != nil {
		s.metrics.fail("destroy", err)
		return nil, err
	}
	return connect.NewResponse(&dsecv1.DestroySandboxResponse{}), nil
}

func (ss *sandboxService) BatchDestroy(ctx context.Context, req *connect.Request[dsecv1.BatchDestroySandboxesRequest]) (*connect.Response[dsecv1.BatchDestroySandboxesResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	results, err := ss.s.batchDestroy(ctx, p, req.Msg.GetIds())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.BatchDestroySandboxesResponse{Results: results}), nil
}
