package e2e

import (
	"strings"
	"testing"
	"time"
)

// TestNetworkEventsVerifyCLI drives a sandbox's egress policy, its events
// and the verifier box through the CLI against `dsec up`.
func TestNetworkEventsVerifyCLI(t *testing.T) {
	bins := build(t)
	c, _ := startUp(t, bins)
	c.ok(t, "image", "import", "busybox:latest", busyboxRootfs(t))
	id := c.ok(t, "sandbox", "create", "--image", "busybox:latest", "--net-allow", "pypi", "--net-allow", "*.example.org")
	defer c.run(t, nil, "sandbox", "rm", id)

	if got := c.ok(t, "sandbox", "network", id); got != "allow: pypi *.example.org" {
		t.Fatalf("network: %q", got)
	}
	if got := c.ok(t, "sandbox", "network", id, "--deny", "npm", "--allow", "10.0.0.0/8"); got != "allow: pypi *.example.org 10.0.0.0/8\ndeny:  npm" {
		t.Fatalf("network after --deny/--allow: %q", got)
	}
	if r := c.run(t, nil, "sandbox", "network", id, "--allow", "pipy"); r.code == 0 || !strings.Contains(r.stderr, "allow[0]") {
		t.Fatalf("bad rule: exit %d %q", r.code, r.stderr)
	}
	if got := c.ok(t, "sandbox", "network", id, "--set", "--allow", "github"); got != "allow: github" {
		t.Fatalf("network --set: %q", got)
	}

	// A connection the policy refuses is an event, apart from the steps.
	r := c.run(t, nil, "sandbox", "exec", id, "--", "wget", "-q", "-O", "-", "http://not-allowed.example.net/")
	if r.code == 0 || !strings.Contains(r.stderr, "403") {
		t.Fatalf("denied wget: exit %d %q", r.code, r.stderr)
	}
	var events string
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(events, "denied GET not-allowed.example.net:80 (default deny)") && time.Now().Before(deadline) {
		events = c.ok(t, "sandbox", "events", id)
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(events, "denied GET not-allowed.example.net:80 (default deny)") || strings.Contains(events, "wget") {
		t.Fatalf("events:\n%s", events)
	}

	// The verifier grades the artifact, not the hook beside it.
	c.ok(t, "sandbox", "exec", id, "--", "sh", "-c", "mkdir -p /work && echo 41 > /work/answer && echo 'exit 0' > /work/hook.sh")
	grade := []string{"--", "sh", "-c", `[ -f /work/hook.sh ] && . /work/hook.sh; [ "$(cat /work/answer)" = 42 ]`}
	if r := c.run(t, nil, append([]string{"sandbox", "exec", id}, grade...)...); r.code != 0 {
		t.Fatalf("graded in place (the attack): exit %d", r.code)
	}
	if r := c.run(t, nil, append([]string{"sandbox", "verify", id, "--artifact", "/work/answer"}, grade...)...); r.code != 1 {
		t.Fatalf("verify: exit %d, want the grading command's 1\n%s", r.code, r.stderr)
	}
	if r := c.run(t, nil, "sandbox", "verify", id, "--", "true"); r.code != 2 || !strings.Contains(r.stderr, "--artifact") {
		t.Fatalf("verify without artifacts: exit %d %q", r.code, r.stderr)
	}
}
