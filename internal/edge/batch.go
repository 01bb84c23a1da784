package edge

import (
	"context"
	"sync"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// batchFanout bounds how many items of one batch run at once on a node:
// enough to keep both cores busy while a few items wait on I/O, without one
// batch crowding out every other caller.
const batchFanout = 32

// each runs f for every index in [0, n), batchFanout at a time, and waits.
func each(n int, f func(i int)) {
	sem := make(chan struct{}, batchFanout)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			f(i)
		}()
	}
	wg.Wait()
}

// batchExec runs each request as Exec would; one item's failure is that
// item's result only.
func (e *Edge) batchExec(ctx context.Context, caller *dsecv1.Caller, reqs []*dsecv1.ExecRequest) []*dsecv1.BatchExecItem {
	out := make([]*dsecv1.BatchExecItem, len(reqs))
	each(len(reqs), func(i int) {
		item := &dsecv1.BatchExecItem{SandboxId: reqs[i].GetSandboxId()}
		if reqs[i] == nil {
			item.Error = e.itemError(invalid("requests[%d] is empty", i))
		} else if res, err := e.exec(ctx, caller, reqs[i], nil); err != nil {
			item.Error = e.itemError(err)
		} else {
			item.Result = res
		}
		out[i] = item
	})
	return out
}

// batchRollback rolls each sandbox back as Rollback would.
func (e *Edge) batchRollback(ctx context.Context, caller *dsecv1.Caller, reqs []*dsecv1.RollbackRequest) []*dsecv1.BatchRollbackItem {
	out := make([]*dsecv1.BatchRollbackItem, len(reqs))
	each(len(reqs), func(i int) {
		item := &dsecv1.BatchRollbackItem{SandboxId: reqs[i].GetSandboxId()}
		if reqs[i] == nil {
			item.Error = e.itemError(invalid("requests[%d] is empty", i))
		} else if res, err := e.rollback(ctx, caller, reqs[i]); err != nil {
			item.Error = e.itemError(err)
		} else {
			item.Result = res
		}
		out[i] = item
	})
	return out
}

func (s *service) BatchExecOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeBatchExecRequest]) (*connect.Response[dsecv1.BatchExecResponse], error) {
	if req.Msg.Caller == nil {
		return nil, invalid("caller is required")
	}
	return connect.NewResponse(&dsecv1.BatchExecResponse{
		Results: s.e.batchExec(ctx, req.Msg.Caller, req.Msg.GetRequest().GetRequests()),
	}), nil
}

func (s *service) BatchRollbackOnEdge(ctx context.Context, req *connect.Request[dsecv1.EdgeBatchRollbackRequest]) (*connect.Response[dsecv1.BatchRollbackResponse], error) {
	if req.Msg.Caller == nil {
		return nil, invalid("caller is required")
	}
	return connect.NewResponse(&dsecv1.BatchRollbackResponse{
		Results: s.e.batchRollback(ctx, req.Msg.Caller, req.Msg.GetRequest().GetRequests()),
	}), nil
}
