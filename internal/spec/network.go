package spec

import (
	"cmp"
	"fmt"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/aether"
)

// MaxNetworkRules bounds a sandbox's egress policy (allow and deny
// together): every connection is checked against each rule.
const MaxNetworkRules = 256

// Network parses an egress policy's rules; errors name the rule's field
// under prefix ("spec.network", "request", or "" for a request's own
// fields), e.g. spec.network.allow[2].
func Network(prefix string, allow, deny []string) (aether.Policy, error) {
	if len(allow)+len(deny) > MaxNetworkRules {
		return aether.Policy{}, fieldErr(cmp.Or(prefix, "allow, deny"), "%d rules, more than %d", len(allow)+len(deny), MaxNetworkRules)
	}
	var p aether.Policy
	for _, l := range []struct {
		name  string
		rules []string
		act   aether.Action
	}{{"allow", allow, aether.Allow}, {"deny", deny, aether.Deny}} {
		for i, s := range l.rules {
			r, err := aether.ParseRule(l.act, s)
			if err != nil {
				field := fmt.Sprintf("%s[%d]", l.name, i)
				if prefix != "" {
					field = prefix + "." + field
				}
				return aether.Policy{}, fieldErr(field, "%v", err)
			}
			p = p.With(r)
		}
	}
	return p, nil
}

// NetworkProto is p in the API's form.
func NetworkProto(p aether.Policy) *dsecv1.NetworkPolicy {
	allow, deny := p.Lists()
	if len(allow)+len(deny) == 0 {
		return nil
	}
	return &dsecv1.NetworkPolicy{Allow: allow, Deny: deny}
}
