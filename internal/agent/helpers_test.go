package agent

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// socketPair returns the two ends of a connected unix stream socket as
// pollable files (the agent and the edge side).
func socketPair(t testing.TB) (*os.File, *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		t.Fatalf("socketpair: %v", err)
	}
	return os.NewFile(uintptr(fds[0]), "agent-end"), os.NewFile(uintptr(fds[1]), "edge-end")
}

// startAgent runs Serve in-process over a socket pair and returns a client.
// Cleanup closes the client and waits for Serve to return.
func startAgent(t testing.TB, opts Options) *Client {
	t.Helper()
	a, e := socketPair(t)
	done := make(chan error, 1)
	go func() { done <- Serve(context.Background(), a, opts) }()
	c := NewClient(e)
	t.Cleanup(func() {
		c.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return c
}

var markerSeq atomic.Int64

// marker returns a sleep duration that is unique to this test run, so the
// processes of one test can be found in /proc by their command line.
func marker() string {
	return fmt.Sprintf("1000.%d%06d", os.Getpid(), markerSeq.Add(1))
}

// liveWithMarker returns the pids of live processes whose command line
// contains m (zombies have an empty command line).
func liveWithMarker(t testing.TB, m string) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil {
			continue
		}
		if strings.Contains(string(b), m) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// killMarked kills leftovers of a test (only used in cleanup).
func killMarked(t testing.TB, m string) {
	for _, pid := range liveWithMarker(t, m) {
		unix.Kill(pid, unix.SIGKILL)
	}
}

// eventually polls cond until it holds or a generous bound passes; it is
// for conditions that settle asynchronously (a reaper's work), not a timer.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: still not true after 20s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
