package dsec

import (
	"context"
	"fmt"
	"slices"

	"connectrpc.com/connect"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// Network is a sandbox's egress policy, default deny: its sandbox's tools
// reach what Allow names through the proxy every exec is pointed at
// (http_proxy, https_proxy), except what Deny names (a deny wins). A rule
// is a named rule ("pypi", "npm", "crates", "goproxy", "debian", "ubuntu",
// "github", "huggingface"), a host ("example.org", "*.example.org",
// "example.org:443"), an address or a CIDR.
type Network struct {
	Allow []string
	Deny  []string
}

// Rules builds a policy from named rules switched on or off, the form
// trainers write: Rules(map[string]bool{"pypi": true, "npm": false}).
func Rules(rules map[string]bool) Network {
	var n Network
	for r, on := range rules {
		if on {
			n.Allow = append(n.Allow, r)
		} else {
			n.Deny = append(n.Deny, r)
		}
	}
	slices.Sort(n.Allow)
	slices.Sort(n.Deny)
	return n
}

func (n Network) proto() *dsecv1.NetworkPolicy {
	if len(n.Allow)+len(n.Deny) == 0 {
		return nil
	}
	return &dsecv1.NetworkPolicy{Allow: n.Allow, Deny: n.Deny}
}

func networkFromProto(p *dsecv1.NetworkPolicy) Network {
	return Network{Allow: p.GetAllow(), Deny: p.GetDeny()}
}

// SetNetwork adds n's rules to the sandbox's egress policy (a rule for a
// target already there replaces it: allowing "pypi" after denying it
// allows it). New connections follow the new policy at once; open ones it
// no longer allows are closed. It returns the whole policy.
func (s *Sandbox) SetNetwork(ctx context.Context, n Network) (Network, error) {
	return s.network(ctx, n, false)
}

// ReplaceNetwork makes n the sandbox's whole egress policy.
func (s *Sandbox) ReplaceNetwork(ctx context.Context, n Network) (Network, error) {
	return s.network(ctx, n, true)
}

// Network returns the sandbox's egress policy as it is now.
func (s *Sandbox) Network(ctx context.Context) (Network, error) {
	return s.network(ctx, Network{}, false)
}

func (s *Sandbox) network(ctx context.Context, n Network, replace bool) (Network, error) {
	resp, err := s.c.sandboxes.SetNetwork(ctx, connect.NewRequest(&dsecv1.SetNetworkRequest{
		SandboxId: s.ID, Allow: n.Allow, Deny: n.Deny, Replace: replace,
	}))
	if err != nil {
		return Network{}, fmt.Errorf("network of sandbox %s: %w", s.ID, err)
	}
	return networkFromProto(resp.Msg.GetNetwork()), nil
}
