package edge

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/fail"
	"github.com/dsec-dev/dsec/internal/limits"
	"github.com/dsec-dev/dsec/internal/pool"
	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
	"github.com/dsec-dev/dsec/internal/spec"
)

// fncall on the edge (issue 6): each (image, resources) key has a pool of
// container sandboxes; a call takes a clean one, runs in it (package
// fncall), and hands it back to be reset. Calls that find the pool at its
// bound wait in the pool's bounded queue within their deadline.

// Defaults of the fncall pools (Config.FnWarm, FnMax, FnQueue, FnPools).
const (
	DefaultFnWarm  = 2
	DefaultFnMax   = 16
	DefaultFnQueue = 1024
	// DefaultFnPools bounds the images a node keeps fncall pools for: a
	// call may name any image it can see (RunCodeRequest.image), and
	// fncall sandboxes are charged to no tenant and to no capacity, so
	// without it a tenant with many images would hold FnMax sandboxes
	// per image.
	DefaultFnPools = 8
)

// fnBase is what an fncall sandbox gets between calls; a call's own memory
// limit is set for its duration only. CPU and the writable layer take the
// node's defaults: fncall sandboxes are the node's, charged to no tenant,
// and bounded by FnMax per image.
var fnBase = spec.Resources{MemoryBytes: 2 << 30, Pids: 1024}

// fnResources is what an fncall sandbox of this node gets.
func (e *Edge) fnResources() runtime.Resources {
	r := fnBase.Or(e.cfg.Defaults)
	return runtime.Resources{MilliCPU: r.MilliCPU, MemoryBytes: r.MemoryBytes, Pids: r.Pids, DiskBytes: r.DiskBytes}
}

// fnPool is one fncall pool.
type fnPool struct {
	p *pool.Pool
	n atomic.Int64
	// used is when a call last asked for the pool (unix nanoseconds).
	used atomic.Int64
}

// fnPoolFor returns the fncall pool of image's layers, creating it on first
// use.
func (e *Edge) fnPoolFor(ctx context.Context, imageRef string) (*fnPool, error) {
	spec := &dsecv1.SandboxSpec{Backend: string(runtime.KindContainer), Image: imageRef}
	rspec, digests, err := e.resolveSpec(ctx, e.cfg.NodeID+"-fn", spec, nil)
	if err != nil {
		return nil, err
	}
	rspec.Resources = e.fnResources()
	key := PoolKey("fncall", digests, nil, nil)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, fail.New(fail.Unavailable, fmt.Errorf("node %q is shutting down", e.cfg.NodeID))
	}
	if fp := e.fnPools[key]; fp != nil {
		fp.used.Store(time.Now().UnixNano())
		return fp, nil
	}
	backend := e.cfg.Backends[runtime.KindContainer]
	if backend == nil {
		return nil, fail.New(fail.FailedPrecondition, fmt.Errorf("node %q has no container backend for fncall", e.cfg.NodeID))
	}
	if len(e.fnPools) >= e.cfg.FnPools {
		// Make room: the least recently asked-for pool that nobody
		// uses or waits for goes (its ready sandboxes are destroyed).
		var victim string
		for k, fp := range e.fnPools {
			st := fp.p.Stats()
			if st.InUse == 0 && st.Waiting == 0 && (victim == "" || fp.used.Load() < e.fnPools[victim].used.Load()) {
				victim = k
			}
		}
		if victim == "" {
			return nil, fail.New(fail.Unavailable, fmt.Errorf("node %q: every one of its %d fncall pools (one per image) is busy; retry later", e.cfg.NodeID, e.cfg.FnPools))
		}
		old := e.fnPools[victim]
		delete(e.fnPools, victim)
		e.wg.Add(1) // Close waits for it
		go func() {
			defer e.wg.Done()
			old.p.Close(context.WithoutCancel(ctx))
		}()
	}
	fp := &fnPool{}
	fp.used.Store(time.Now().UnixNano())
	prefix := fmt.Sprintf("%s-fn%s", e.cfg.NodeID, key[:8])
	fp.p = pool.New(pool.Options{
		New: func(ctx context.Context) (runtime.Sandbox, error) {
			s := rspec
			s.ID = fmt.Sprintf("%s-%d", prefix, fp.n.Add(1))
			return backend.Create(ctx, s)
		},
		Size: e.cfg.FnWarm, Max: e.cfg.FnMax, MaxWaiters: e.cfg.FnQueue,
		IdleShrink: defaultIdleShrink, Fill: poolFillConcurrent,
		Logger: e.log.With("fnpool", prefix),
	})
	e.fnPools[key] = fp
	return fp, nil
}

// closeFnPools closes the fncall pools (node shutdown).
func (e *Edge) closeFnPools(ctx context.Context) {
	e.mu.Lock()
	pools := e.fnPools
	e.fnPools = map[string]*fnPool{}
	e.mu.Unlock()
	for _, fp := range pools {
		fp.p.Close(ctx)
	}
}

// fnQueued is how many calls wait for a sandbox on this node.
func (e *Edge) fnQueued() int32 {
	e.mu.Lock()
	defer e.mu.Unlock()
	var n int32
	for _, fp := range e.fnPools {
		n += int32(fp.p.Stats().Waiting)
	}
	return n
}

func fnRequest(r *dsecv1.RunCodeRequest) fncall.Request {
	return fncall.Request{
		Code: r.Code, Language: r.Language,
		CompileTimeout: r.CompileTimeout.AsDuration(), RunTimeout: r.RunTimeout.AsDuration(),
		MemoryLimitMB: r.MemoryLimitMb, Stdin: r.Stdin, Files: r.Files, FetchFiles: r.FetchFiles,
		Args: r.Args, MaxOutputBytes: limits.Output(r.MaxOutputBytes), Image: r.Image,
	}
}

func commandProto(c *fncall.CommandResult) *dsecv1.CommandResult {
	if c == nil {
		return nil
	}
	return &dsecv1.CommandResult{
		Status: c.Status, ExecutionTime: c.ExecutionTime.Seconds(), ReturnCode: int32(c.ReturnCode),
		Stdout: c.Stdout, Stderr: c.Stderr, StdoutTruncated: c.StdoutTruncated, StderrTruncated: c.StderrTruncated,
		OomKilled: c.OOMKilled, Signal: int32(c.Signal),
	}
}

// runCode runs one call in a clean sandbox of imageRef's pool.
func (e *Edge) runCode(ctx context.Context, caller *dsecv1.Caller, r *dsecv1.RunCodeRequest, imageRef string) (*dsecv1.RunCodeResponse, error) {
	if caller == nil {
		return nil, invalid("caller is required")
	}
	if r == nil {
		return nil, invalid("request is required")
	}
	if err := checkDuration("compile_timeout", r.CompileTimeout); err != nil {
		return nil, err
	}
	if err := checkDuration("run_timeout", r.RunTimeout); err != nil {
		return nil, err
	}
	req := fnRequest(r)
	if err := req.Validate(); err != nil {
		return nil, fail.New(fail.InvalidArgument, err)
	}
	lang, err := fncall.Lookup(r.Language)
	if err != nil {
		return nil, fail.New(fail.InvalidArgument, err)
	}
	if imageRef == "" {
		imageRef = lang.Image
	}
	fp, err := e.fnPoolFor(ctx, imageRef)
	if err != nil {
		return nil, err
	}
	sb, err := fp.p.Take(ctx)
	switch {
	case errors.Is(err, pool.ErrQueueFull):
		ra := fp.p.RetryAfter()
		return nil, fail.RetryAfter(fail.Unavailable, fmt.Errorf("node %q: every fncall sandbox is busy and the queue is full; retry after %s", e.cfg.NodeID, ra), ra)
	case err != nil && ctx.Err() != nil:
		return nil, fail.New(fail.DeadlineExceeded, fmt.Errorf("waiting for an fncall sandbox on node %q: %w", e.cfg.NodeID, err))
	case err != nil:
		return nil, fail.New(fail.Unavailable, fmt.Errorf("fncall sandbox on node %q: %w", e.cfg.NodeID, err))
	}
	res := fncall.Call(ctx, sb, lang, req, e.fnResources())
	if res.Status == fncall.StatusSandboxError {
		fp.p.Discard(sb)
	} else {
		fp.p.Put(sb)
	}
	e.metrics.fncalls.WithLabelValues(lang.Name, res.Status).Inc()
	return &dsecv1.RunCodeResponse{
		Status: res.Status, Message: res.Message,
		CompileResult: commandProto(res.Compile), RunResult: commandProto(res.Run), Files: res.Files,
	}, nil
}

func (s *service) RunCodeOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeRunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	res, err := s.e.runCode(ctx, req.Msg.Caller, req.Msg.Request, req.Msg.Image)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(res), nil
}
