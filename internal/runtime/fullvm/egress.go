package fullvm

import (
	"context"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// AcceptEgress relays the next connection to the guest's egress proxy
// listener (runtime.Egress): the guest agent listens inside the guest,
// and the edge decides where the connection may go.
func (s *Sandbox) AcceptEgress(ctx context.Context, listen string) (runtime.EgressConn, error) {
	c, err := s.client.AcceptEgress(ctx, listen)
	if err != nil {
		return nil, s.err(err)
	}
	return c, nil
}
