// Package aether is DSec's egress: a sandbox has loopback only, and every
// connection it makes outward goes through the agent's HTTP(S) proxy to
// the edge, which decides it here against the sandbox's policy.
//
// A policy is default deny: a list of allow and deny rules, each naming an
// ecosystem of the rule table (Ecosystems), a host pattern (with an
// optional port) or an address range. A deny that matches wins over any
// allow. Names are decided before they are resolved, and every address
// the edge resolved is checked again (Decide with Request.Addr): a name a
// policy allows must not lead to an address it denies, nor, unless the
// address came from the operator's hosts file or a CIDR rule allows it,
// to a loopback, private or link-local address (DNS rebinding onto the
// node or its metadata service).
package aether

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Action is what a rule does to the requests it matches.
type Action bool

// The two actions.
const (
	Deny  Action = false
	Allow Action = true
)

func (a Action) String() string {
	if a == Allow {
		return "allow"
	}
	return "deny"
}

// Rule is one entry of a policy. Exactly one of Name, Host or Prefix is set.
type Rule struct {
	Action Action
	// Name is an ecosystem of the rule table.
	Name string
	// Host is a lower-case name or "*.name" (any name below it); Port is
	// the only port it matches, 0 for any.
	Host string
	Port int
	// Prefix is an address range (an address alone is a /32 or /128).
	Prefix netip.Prefix
}

// Target is the rule as written, without its action: "pypi",
// "example.org:443", "10.0.0.0/8".
func (r Rule) Target() string {
	switch {
	case r.Name != "":
		return r.Name
	case r.Host != "":
		if r.Port != 0 {
			return r.Host + ":" + strconv.Itoa(r.Port)
		}
		return r.Host
	default:
		return r.Prefix.String()
	}
}

func (r Rule) String() string { return r.Action.String() + " " + r.Target() }

// ParseRule parses one rule target as the CLI and the API take it: an
// ecosystem name, a host ("pypi.org", "*.example.org", with ":PORT" for
// one port only), an address or a CIDR ("10.0.0.0/8"). The error says
// what is wrong with the target.
func ParseRule(action Action, s string) (Rule, error) {
	r := Rule{Action: action}
	t := strings.ToLower(strings.TrimSpace(s))
	if t == "" {
		return r, errors.New("empty rule")
	}
	if _, ok := Ecosystems[t]; ok {
		r.Name = t
		return r, nil
	}
	if p, err := netip.ParsePrefix(t); err == nil {
		r.Prefix = p.Masked()
		return r, nil
	}
	if a, err := netip.ParseAddr(strings.Trim(t, "[]")); err == nil {
		r.Prefix = netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen())
		return r, nil
	}
	host := t
	if h, p, err := splitHostPort(t); err == nil {
		host = h
		r.Port = p
	} else if strings.Contains(t, ":") {
		return r, fmt.Errorf("rule %q: %v", s, err)
	}
	if _, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		return r, fmt.Errorf("rule %q: an address with a port is not a rule: write the address or a CIDR (any port)", s)
	}
	pattern := strings.TrimSuffix(host, ".")
	name := strings.TrimPrefix(pattern, "*.")
	if err := checkHostname(name); err != nil {
		if !strings.Contains(name, ".") && !strings.Contains(name, "*") {
			return r, fmt.Errorf("rule %q: not a named rule (%s) nor a host: %v", s, strings.Join(EcosystemNames(), ", "), err)
		}
		return r, fmt.Errorf("rule %q: %v", s, err)
	}
	if !strings.Contains(pattern, ".") {
		// A typo of a named rule ("pipy") must not become a host rule
		// that silently matches nothing.
		return r, fmt.Errorf("rule %q: not a named rule (%s) nor a host name with a dot", s, strings.Join(EcosystemNames(), ", "))
	}
	r.Host = pattern
	return r, nil
}

func splitHostPort(t string) (string, int, error) {
	i := strings.LastIndexByte(t, ':')
	if i < 0 {
		return "", 0, errors.New("no port")
	}
	p, err := strconv.Atoi(t[i+1:])
	if err != nil || p < 1 || p > 65535 {
		return "", 0, fmt.Errorf("port %q is not a number from 1 to 65535", t[i+1:])
	}
	return t[:i], p, nil
}

// checkHostname accepts letters, digits and hyphens in dot-separated
// labels of 1–63 bytes, 253 bytes in all: names a resolver can be asked
// for. A "*" anywhere in it is refused (only a leading "*." is a pattern).
func checkHostname(h string) error {
	if h == "" || len(h) > 253 {
		return fmt.Errorf("host name of %d bytes (1 to 253)", len(h))
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 {
			return fmt.Errorf("host name %q has an empty label or one over 63 bytes", h)
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return fmt.Errorf("host name %q: %q is not allowed (letters, digits, '-', and a leading '*.' only)", h, c)
			}
		}
	}
	return nil
}

// Policy is a sandbox's egress policy: default deny, a matching deny
// wins over a matching allow. The zero Policy denies everything.
type Policy struct {
	Rules []Rule
}

// ParsePolicy builds a policy from rule targets to allow and to deny.
func ParsePolicy(allow, deny []string) (Policy, error) {
	var p Policy
	for _, s := range allow {
		r, err := ParseRule(Allow, s)
		if err != nil {
			return Policy{}, err
		}
		p = p.With(r)
	}
	for _, s := range deny {
		r, err := ParseRule(Deny, s)
		if err != nil {
			return Policy{}, err
		}
		p = p.With(r)
	}
	return p, nil
}

// With returns p with r added: a rule already there for the same target
// is replaced, so "allow pypi" after "deny pypi" allows it (a change of
// phase), while a deny of another target covering it still wins.
func (p Policy) With(r Rule) Policy {
	rules := slices.DeleteFunc(slices.Clone(p.Rules), func(o Rule) bool { return o.Target() == r.Target() })
	return Policy{Rules: append(rules, r)}
}

// Lists returns the policy's targets to allow and to deny, in order: the
// form the API and the CLI carry.
func (p Policy) Lists() (allow, deny []string) {
	for _, r := range p.Rules {
		if r.Action == Allow {
			allow = append(allow, r.Target())
		} else {
			deny = append(deny, r.Target())
		}
	}
	return allow, deny
}

// Request is one outward connection or plain-HTTP request a sandbox asks for.
type Request struct {
	// Host is the name asked for (CONNECT's host, a request's Host), or an
	// address literal.
	Host string
	Port int
	// Method is "CONNECT" for a tunnel, else the HTTP method.
	Method string
	// Addr is the address the edge resolved Host to, once it has; a
	// literal Host is its own address.
	Addr netip.Addr
	// Trusted says Addr came from the operator's hosts file, not DNS: it
	// may be loopback or private (test upstreams, a node-local mirror).
	Trusted bool
}

// Decision is the policy's answer, with what decided it for the record.
type Decision struct {
	Allowed bool
	// Rule is the rule that decided ("allow pypi", "deny *.example.org"),
	// or a reason when none did ("default deny", "private address").
	Rule string
}

// Decide answers a request. Call it once before resolving (Addr unset,
// unless Host is an address) and once per resolved address.
func (p Policy) Decide(q Request) Decision {
	host := strings.TrimSuffix(strings.ToLower(q.Host), ".")
	if a, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil {
		q.Addr, host = a.Unmap(), ""
	}
	q.Addr = q.Addr.Unmap()
	var allow *Rule
	for i := range p.Rules {
		r := &p.Rules[i]
		if !r.matches(host, q) {
			continue
		}
		if r.Action == Deny {
			return Decision{Rule: r.String()}
		}
		if allow == nil {
			allow = r
		}
	}
	if allow == nil {
		if host == "" {
			return Decision{Rule: "default deny (an address is allowed only by an address rule)"}
		}
		return Decision{Rule: "default deny"}
	}
	// A name rule vouches for the name, not for whatever DNS answers: an
	// address inside the node's own networks needs a rule of its own.
	if allow.Prefix == (netip.Prefix{}) && q.Addr.IsValid() && !q.Trusted && special(q.Addr) {
		if !p.allowsAddr(q.Addr) {
			return Decision{Rule: fmt.Sprintf("deny %s: %s resolves to a loopback, private or link-local address", allow.Target(), q.Addr)}
		}
	}
	return Decision{Allowed: true, Rule: allow.String()}
}

func (p Policy) allowsAddr(a netip.Addr) bool {
	for _, r := range p.Rules {
		if r.Action == Allow && r.Prefix.IsValid() && r.Prefix.Contains(a) {
			return true
		}
	}
	return false
}

func special(a netip.Addr) bool {
	return a.IsLoopback() || a.IsPrivate() || a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() ||
		a.IsUnspecified() || a.IsMulticast() || a.IsInterfaceLocalMulticast() ||
		netip.MustParsePrefix("100.64.0.0/10").Contains(a) // carrier-grade NAT, cloud metadata neighbours
}

// matches says whether r applies to a request for host (empty when the
// request names an address) and q.Addr (unset before resolution).
func (r *Rule) matches(host string, q Request) bool {
	switch {
	case r.Prefix.IsValid():
		return q.Addr.IsValid() && r.Prefix.Contains(q.Addr)
	case r.Host != "":
		return host != "" && (r.Port == 0 || r.Port == q.Port) && hostMatches(r.Host, host)
	default:
		e := Ecosystems[r.Name]
		if host == "" || !slices.ContainsFunc(e.Hosts, func(p string) bool { return hostMatches(p, host) }) {
			return false
		}
		// A deny of an ecosystem covers its hosts whatever the port or
		// method; an allow grants only what its tools need.
		return r.Action == Deny ||
			slices.Contains(e.Ports, q.Port) && slices.Contains(e.Methods, strings.ToUpper(q.Method))
	}
}

func hostMatches(pattern, host string) bool {
	if rest, ok := strings.CutPrefix(pattern, "*."); ok {
		return strings.HasSuffix(host, "."+rest)
	}
	return pattern == host
}
