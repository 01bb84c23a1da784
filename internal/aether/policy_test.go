package aether

import (
	"net/netip"
	"strings"
	"testing"
)

func TestParseRule(t *testing.T) {
	for _, c := range []struct {
		in, target, err string
	}{
		{"pypi", "pypi", ""},
		{" PyPI ", "pypi", ""},
		{"example.org", "example.org", ""},
		{"Example.ORG.", "example.org", ""},
		{"*.example.org", "*.example.org", ""},
		{"example.org:8443", "example.org:8443", ""},
		{"10.0.0.0/8", "10.0.0.0/8", ""},
		{"10.1.2.3/8", "10.0.0.0/8", ""},
		{"192.0.2.7", "192.0.2.7/32", ""},
		{"[2001:db8::1]", "2001:db8::1/128", ""},
		{"2001:db8::/32", "2001:db8::/32", ""},
		{"", "", "empty rule"},
		{"pipy", "", "not a named rule"},
		{"example.org:0", "", "port"},
		{"example.org:http", "", "port"},
		{"192.0.2.7:443", "", "address with a port"},
		{"ex*ample.org", "", "not allowed"},
		{"*.*.org", "", "not allowed"},
		{"a..b", "", "empty label"},
		{"exa mple.org", "", "not allowed"},
		{strings.Repeat("a", 64) + ".org", "", "over 63"},
	} {
		r, err := ParseRule(Allow, c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("ParseRule(%q) = %v, %v; want error containing %q", c.in, r, err, c.err)
			}
			continue
		}
		if err != nil || r.Target() != c.target {
			t.Errorf("ParseRule(%q) = %q, %v; want %q", c.in, r.Target(), err, c.target)
		}
	}
}

func mustPolicy(t *testing.T, allow, deny []string) Policy {
	t.Helper()
	p, err := ParsePolicy(allow, deny)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestDecide is the table of policies × requests: named rules with their
// ports and methods, wildcards, ports, deny over allow, address literals,
// DNS answers inside the node's networks, hosts-file answers.
func TestDecide(t *testing.T) {
	addr := netip.MustParseAddr
	pypi := mustPolicy(t, []string{"pypi"}, nil)
	for _, c := range []struct {
		name   string
		p      Policy
		q      Request
		ok     bool
		reason string
	}{
		{"zero policy denies", Policy{}, Request{Host: "pypi.org", Port: 443, Method: "CONNECT"}, false, "default deny"},
		{"pypi tunnel", pypi, Request{Host: "pypi.org", Port: 443, Method: "CONNECT"}, true, "allow pypi"},
		{"pypi files host", pypi, Request{Host: "files.pythonhosted.org", Port: 443, Method: "CONNECT"}, true, "allow pypi"},
		{"pypi name case and dot", pypi, Request{Host: "PyPI.org.", Port: 443, Method: "CONNECT"}, true, "allow pypi"},
		{"pypi plain GET", pypi, Request{Host: "pypi.org", Port: 80, Method: "GET"}, true, "allow pypi"},
		{"pypi plain POST refused", pypi, Request{Host: "pypi.org", Port: 80, Method: "POST"}, false, "default deny"},
		{"pypi other port", pypi, Request{Host: "pypi.org", Port: 22, Method: "CONNECT"}, false, "default deny"},
		{"pypi upload host not in rule", pypi, Request{Host: "upload.pypi.org", Port: 443, Method: "CONNECT"}, false, "default deny"},
		{"lookalike suffix", pypi, Request{Host: "evilpypi.org", Port: 443, Method: "CONNECT"}, false, "default deny"},
		{"github POST for git fetch", mustPolicy(t, []string{"github"}, nil), Request{Host: "github.com", Port: 80, Method: "POST"}, false, "default deny"},
		{"github tunnel", mustPolicy(t, []string{"github"}, nil), Request{Host: "codeload.github.com", Port: 443, Method: "CONNECT"}, true, "allow github"},
		{"npm denied", mustPolicy(t, []string{"pypi"}, []string{"npm"}), Request{Host: "registry.npmjs.org", Port: 443, Method: "CONNECT"}, false, "deny npm"},
		{"deny wins over allow", mustPolicy(t, []string{"*.example.org"}, []string{"bad.example.org"}), Request{Host: "bad.example.org", Port: 443, Method: "CONNECT"}, false, "deny bad.example.org"},
		{"deny of ecosystem covers any port", mustPolicy(t, []string{"*.npmjs.org"}, []string{"npm"}), Request{Host: "registry.npmjs.org", Port: 8080, Method: "CONNECT"}, false, "deny npm"},
		{"wildcard below", mustPolicy(t, []string{"*.example.org"}, nil), Request{Host: "a.b.example.org", Port: 8080, Method: "GET"}, true, "allow *.example.org"},
		{"wildcard not apex", mustPolicy(t, []string{"*.example.org"}, nil), Request{Host: "example.org", Port: 443, Method: "CONNECT"}, false, "default deny"},
		{"host any port", mustPolicy(t, []string{"example.org"}, nil), Request{Host: "example.org", Port: 5000, Method: "CONNECT"}, true, "allow example.org"},
		{"host:port exact", mustPolicy(t, []string{"example.org:443"}, nil), Request{Host: "example.org", Port: 443, Method: "CONNECT"}, true, "allow example.org:443"},
		{"host:port other port", mustPolicy(t, []string{"example.org:443"}, nil), Request{Host: "example.org", Port: 80, Method: "GET"}, false, "default deny"},
		{"direct IP without address rule", mustPolicy(t, []string{"example.org"}, nil), Request{Host: "93.184.216.34", Port: 443, Method: "CONNECT"}, false, "address is allowed only by an address rule"},
		{"direct IP with CIDR", mustPolicy(t, []string{"93.184.0.0/16"}, nil), Request{Host: "93.184.216.34", Port: 443, Method: "CONNECT"}, true, "allow 93.184.0.0/16"},
		{"mapped v6 literal", mustPolicy(t, []string{"93.184.0.0/16"}, nil), Request{Host: "[::ffff:93.184.216.34]", Port: 443, Method: "CONNECT"}, true, "allow 93.184.0.0/16"},
		{"name allowed, resolved address denied", mustPolicy(t, []string{"example.org"}, []string{"203.0.113.0/24"}), Request{Host: "example.org", Port: 443, Method: "CONNECT", Addr: addr("203.0.113.9")}, false, "deny 203.0.113.0/24"},
		{"DNS rebinding to loopback", pypi, Request{Host: "pypi.org", Port: 443, Method: "CONNECT", Addr: addr("127.0.0.1")}, false, "loopback, private or link-local"},
		{"DNS answer metadata service", pypi, Request{Host: "pypi.org", Port: 443, Method: "CONNECT", Addr: addr("169.254.169.254")}, false, "loopback, private or link-local"},
		{"DNS answer private", pypi, Request{Host: "pypi.org", Port: 443, Method: "CONNECT", Addr: addr("10.1.2.3")}, false, "loopback, private or link-local"},
		{"DNS answer v6 loopback", pypi, Request{Host: "pypi.org", Port: 443, Method: "CONNECT", Addr: addr("::1")}, false, "loopback, private or link-local"},
		{"DNS answer public", pypi, Request{Host: "pypi.org", Port: 443, Method: "CONNECT", Addr: addr("151.101.0.223")}, true, "allow pypi"},
		{"hosts file answer loopback", pypi, Request{Host: "pypi.org", Port: 443, Method: "CONNECT", Addr: addr("127.0.0.1"), Trusted: true}, true, "allow pypi"},
		{"private address allowed by CIDR", mustPolicy(t, []string{"pypi", "10.0.0.0/8"}, nil), Request{Host: "pypi.org", Port: 443, Method: "CONNECT", Addr: addr("10.1.2.3")}, true, "allow pypi"},
		{"loopback literal needs its rule", mustPolicy(t, []string{"*.org"}, nil), Request{Host: "127.0.0.1", Port: 80, Method: "GET"}, false, "address is allowed only"},
	} {
		d := c.p.Decide(c.q)
		if d.Allowed != c.ok || !strings.Contains(d.Rule, c.reason) {
			t.Errorf("%s: Decide(%+v) = %+v; want allowed=%v by %q", c.name, c.q, d, c.ok, c.reason)
		}
	}
}

// TestWith: adding a rule for a target already in the policy replaces it,
// which is how a task's phases open and close an ecosystem.
func TestWith(t *testing.T) {
	p := mustPolicy(t, []string{"pypi", "npm"}, []string{"github"})
	q := Request{Host: "pypi.org", Port: 443, Method: "CONNECT"}
	if !p.Decide(q).Allowed {
		t.Fatal("pypi should be allowed")
	}
	deny, _ := ParseRule(Deny, "pypi")
	p = p.With(deny)
	if d := p.Decide(q); d.Allowed || d.Rule != "deny pypi" {
		t.Fatalf("after deny pypi: %+v", d)
	}
	allow, _ := ParseRule(Allow, "PYPI")
	p = p.With(allow)
	if !p.Decide(q).Allowed {
		t.Fatal("allow pypi after deny pypi should allow it")
	}
	a, d := p.Lists()
	if strings.Join(a, ",") != "npm,pypi" || strings.Join(d, ",") != "github" {
		t.Fatalf("Lists = %v, %v", a, d)
	}
}

func TestEcosystemTable(t *testing.T) {
	for _, n := range []string{"pypi", "npm", "crates", "goproxy", "debian", "ubuntu", "github", "huggingface"} {
		e, ok := Ecosystems[n]
		if !ok {
			t.Errorf("named rule %q missing", n)
			continue
		}
		if len(e.Hosts) == 0 || len(e.Ports) == 0 || len(e.Methods) == 0 {
			t.Errorf("%s: %+v has empty hosts, ports or methods", n, e)
		}
		for _, h := range e.Hosts {
			if err := checkHostname(strings.TrimPrefix(h, "*.")); err != nil {
				t.Errorf("%s: %v", n, err)
			}
		}
	}
}
