package microvm

import (
	"context"

	"github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/agentconv"
)

// AcceptEgress relays the next connection to the guest's egress proxy
// listener (runtime.Egress): the guest agent listens inside the guest,
// and the edge decides where the connection may go.
func (s *sandbox) AcceptEgress(ctx context.Context, listen string) (runtime.EgressConn, error) {
	c, err := s.client.AcceptEgress(ctx, listen)
	if err != nil {
		return nil, s.gone(agentconv.Err(err))
	}
	return c, nil
}
