package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// scrape returns the value of the metric line starting with prefix, read
// with the metrics token of the daemon whose data dir is dataDir.
func scrape(base, dataDir, prefix string) (string, bool) {
	tok, err := os.ReadFile(filepath.Join(dataDir, "metrics.token"))
	if err != nil {
		return "", false
	}
	r, err := http.NewRequest(http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return "", false
	}
	r.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(tok)))
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		return "", false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), prefix+" "); ok {
			return v, true
		}
	}
	return "", false
}

// TestThreeEdges runs one server and three edges as separate processes
// sharing a blob store, spreads sandboxes over them, kills one edge with
// SIGKILL and checks that its sandboxes are reported lost (exec answers
// infra_error at once) while creates keep succeeding on the other two.
func TestThreeEdges(t *testing.T) {
	bins := build(t)
	root := t.TempDir()
	store := "dir://" + filepath.Join(root, "store")
	serverData := filepath.Join(root, "server")
	tokenFile := filepath.Join(root, "cluster.token")
	addr := freeAddr(t)
	endpoint := "http://" + addr
	srv := startDaemon(t, "server", bins.dsec, "server", "--data-dir", serverData, "--listen", addr,
		"--store", store, "--cluster-token-file", tokenFile, "--node-timeout", "2s", "--log-level", "warn")
	srv.waitHealthy(t, endpoint)

	type edgeProc struct {
		node, url string
		args      []string
		d         *daemon
	}
	var edges []*edgeProc
	for _, node := range []string{"edge-a", "edge-b", "edge-c"} {
		eaddr := freeAddr(t)
		e := &edgeProc{node: node, url: "http://" + eaddr}
		e.args = []string{"edge", "--server", endpoint, "--listen", eaddr, "--node-id", node,
			"--data-dir", filepath.Join(root, node), "--store", store, "--cluster-token-file", tokenFile,
			"--agent", bins.agent, "--heartbeat-interval", "250ms", "--log-level", "warn"}
		e.d = startDaemon(t, node, bins.dsec, e.args...)
		edges = append(edges, e)
	}
	for _, e := range edges {
		e.d.waitHealthy(t, e.url)
	}
	poll(t, 30*time.Second, "three live nodes", func() (bool, error) {
		v, _ := scrape(endpoint, serverData, `dsec_server_nodes{alive="true"}`)
		return v == "3", nil
	})

	c := cli{bin: bins.dsec, endpoint: endpoint, token: readToken(t, filepath.Join(serverData, "admin.token"))}
	c.ok(t, "image", "import", "busybox:latest", busyboxRootfs(t))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cl := dsec.New(endpoint, c.token)

	// Least-loaded placement spreads a batch over every node.
	sbs, err := cl.CreateMany(ctx, dsec.Spec{Image: "busybox:latest", Labels: map[string]string{"e2e": "edges"}}, 9)
	if err != nil {
		t.Fatalf("CreateMany: %v", err)
	}
	perNode := map[string][]*dsec.Sandbox{}
	for _, sb := range sbs {
		perNode[sb.Node] = append(perNode[sb.Node], sb)
	}
	for _, e := range edges {
		if len(perNode[e.node]) == 0 {
			t.Fatalf("no sandbox placed on %s: %v", e.node, perNode)
		}
	}
	for _, sb := range sbs {
		res, err := sb.Exec(ctx, "hostname")
		if err != nil || !res.OK() {
			t.Fatalf("exec on %s: %+v, %v", sb.ID, res, err)
		}
	}

	// SIGKILL one edge: no goodbye, its sandboxes are simply cut off.
	victim := edges[1]
	if err := victim.d.stop(syscall.SIGKILL, time.Minute); err != nil {
		t.Fatal(err)
	}
	// The killed edge left processes, cgroups, mounts and state behind.
	// Restarting it on the same data dir removes them (the container
	// backend and the layer cache clean stale state at start); registered
	// now so that it runs however the test ends.
	t.Cleanup(func() { restartToClean(t, bins.dsec, victim.node, victim.url, victim.args) })
	lostOnes := perNode[victim.node]
	poll(t, 30*time.Second, "sandboxes of "+victim.node+" reported lost", func() (bool, error) {
		for _, sb := range lostOnes {
			got, err := cl.Get(ctx, sb.ID)
			if dsec.IsUnavailable(err) {
				return false, nil // the node is silent but not yet declared lost
			}
			if err != nil {
				return false, fmt.Errorf("get %s: %w", sb.ID, err)
			}
			if got.State != dsec.StateLost {
				return false, nil
			}
		}
		return true, nil
	})
	for _, sb := range lostOnes {
		// The deadline guards against a hang: exec must answer at once.
		ectx, ecancel := context.WithTimeout(ctx, 20*time.Second)
		res, err := sb.Exec(ectx, "true")
		ecancel()
		if err != nil {
			t.Fatalf("exec on lost sandbox %s: %v; want an infra_error result", sb.ID, err)
		}
		if res.Outcome != dsec.OutcomeInfraError || res.InfraError == "" {
			t.Fatalf("exec on lost sandbox %s: %+v; want outcome infra_error with a reason", sb.ID, res)
		}
	}
	// The CLI reports the same with its infrastructure exit code.
	if r := c.run(t, nil, "sandbox", "exec", lostOnes[0].ID, "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "infra_error") {
		t.Fatalf("CLI exec on a lost sandbox: %+v, want exit 125 and infra_error", r)
	}
	// Sandboxes on the survivors still work, and new ones go only there.
	for _, e := range []*edgeProc{edges[0], edges[2]} {
		res, err := perNode[e.node][0].Exec(ctx, "echo", "alive")
		if err != nil || string(res.Stdout) != "alive\n" {
			t.Fatalf("exec on %s after %s died: %+v, %v", e.node, victim.node, res, err)
		}
	}
	more, err := cl.CreateMany(ctx, dsec.Spec{Image: "busybox:latest", Labels: map[string]string{"e2e": "edges"}}, 4)
	if err != nil {
		t.Fatalf("CreateMany after %s died: %v", victim.node, err)
	}
	for _, sb := range more {
		if sb.Node == victim.node {
			t.Fatalf("sandbox %s placed on dead node %s", sb.ID, victim.node)
		}
	}
	var live []string
	for _, sb := range append(sbs, more...) {
		if sb.Node != victim.node {
			live = append(live, sb.ID)
		}
	}
	if err := cl.DestroyMany(ctx, live...); err != nil {
		t.Fatalf("DestroyMany: %v", err)
	}
}

// restartToClean runs the edge with args until it serves, then stops it
// cleanly: at start it removes what its killed predecessor left behind.
func restartToClean(t *testing.T, bin, node, url string, args []string) {
	cmd := exec.Command(bin, args...)
	var log syncBuffer
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Errorf("restart %s to clean up: %v", node, err)
		return
	}
	deadline := time.Now().Add(30 * time.Second)
	for delay := 10 * time.Millisecond; time.Now().Before(deadline); delay = min(delay*2, 250*time.Millisecond) {
		if resp, err := http.Get(url + "/healthz"); err == nil {
			resp.Body.Close()
			break
		}
		time.Sleep(delay)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Errorf("restarted %s: %v\n%s", node, err, log.String())
	}
}
