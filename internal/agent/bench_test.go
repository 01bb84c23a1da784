package agent

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkExecTrue compares an exec round trip of /bin/true through the
// agent (request, fork+exec, wait, response) with a bare os/exec on the
// host; the design target is within 2x.
func BenchmarkExecTrue(b *testing.B) {
	b.Run("bare-os-exec", func(b *testing.B) {
		for b.Loop() {
			if err := exec.Command("/bin/true").Run(); err != nil {
				b.Fatal(err)
			}
		}
	})
	run := func(b *testing.B, c *Client) {
		req := ExecRequest{Argv: []string{"/bin/true"}}
		for b.Loop() {
			res, err := c.Exec(context.Background(), req, nil)
			if err != nil || res.ExitCode != 0 {
				b.Fatal(res, err)
			}
		}
	}
	// /bin/true's pipes close when it exits, so the output grace never
	// comes into play here.
	b.Run("agent-in-process", func(b *testing.B) {
		run(b, startAgent(b, Options{}))
	})
	b.Run("agent-binary-pid1", func(b *testing.B) {
		c, _ := startBinaryAgent(b)
		run(b, c)
	})
}

// BenchmarkIdleMemory reports the memory of a dsec-agent (PID 1 of its
// namespace) gone idle after serving pings and execs: what 1,000 idle
// sandboxes pay 1,000 times. Anonymous is the per-sandbox part; the rest of
// Rss is the binary's pages, shared through the page cache by every
// sandbox that runs the same agent file (a freshly built binary's pages
// still show as dirty until written back).
func BenchmarkIdleMemory(b *testing.B) {
	c, cmd := startBinaryAgent(b)
	for b.Loop() {
		if err := c.Ping(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
	for range 20 {
		if _, err := c.Exec(context.Background(), ExecRequest{Shell: "head -c 1000000 /dev/zero"}, nil); err != nil {
			b.Fatal(err)
		}
	}
	// dsec-agent returns free memory to the kernel after a second idle.
	time.Sleep(2 * time.Second)
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/smaps_rollup")
	if err != nil {
		b.Fatal(err)
	}
	for _, key := range []string{"Rss:", "Pss:", "Anonymous:", "Private_Dirty:"} {
		if f := statusField(raw, key); len(f) > 0 {
			kb, _ := strconv.Atoi(f[0])
			b.ReportMetric(float64(kb), strings.TrimSuffix(key, ":")+"-KiB")
		}
	}
}
