package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"
)

func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// dialEventually dials addr until the agent listens there (it starts
// listening when the first EgressAccept arrives).
func dialEventually(t *testing.T, addr string) net.Conn {
	t.Helper()
	var c net.Conn
	eventually(t, "agent listening on "+addr, func() bool {
		var err error
		c, err = net.Dial("tcp", addr)
		return err == nil
	})
	return c
}

// TestEgressRelay: bytes a workload writes to the proxy listener reach the
// edge and the edge's reach the workload, each direction half-closes on
// its own, and the stream ends once both are done.
func TestEgressRelay(t *testing.T) {
	c := startAgent(t, Options{})
	addr := freeLoopbackAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	type acc struct {
		e   *EgressConn
		err error
	}
	got := make(chan acc, 1)
	go func() {
		e, err := c.AcceptEgress(ctx, addr)
		got <- acc{e, err}
	}()
	w := dialEventually(t, addr)
	defer w.Close()
	a := <-got
	if a.err != nil {
		t.Fatal(a.err)
	}
	e := a.e
	defer e.Close()

	// More than a window each way, so flow control is exercised.
	up := bytes.Repeat([]byte("workload->edge "), 3*Window/15)
	down := bytes.Repeat([]byte("edge->workload "), 3*Window/15)
	errc := make(chan error, 2)
	go func() {
		_, err := w.Write(up)
		if err == nil {
			err = w.(*net.TCPConn).CloseWrite()
		}
		errc <- err
	}()
	go func() {
		_, err := e.Write(down)
		if err == nil {
			err = e.CloseWrite()
		}
		errc <- err
	}()
	gotUp, err := io.ReadAll(e)
	if err != nil {
		t.Fatalf("edge read: %v", err)
	}
	gotDown, err := io.ReadAll(w)
	if err != nil {
		t.Fatalf("workload read: %v", err)
	}
	for range 2 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(gotUp, up) || !bytes.Equal(gotDown, down) {
		t.Fatalf("relay changed the bytes: up %d/%d, down %d/%d", len(gotUp), len(up), len(gotDown), len(down))
	}
}

// TestEgressClose: the edge's Close (a policy that now forbids the
// connection) closes the workload's socket.
func TestEgressClose(t *testing.T) {
	c := startAgent(t, Options{})
	addr := freeLoopbackAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got := make(chan *EgressConn, 1)
	go func() {
		e, err := c.AcceptEgress(ctx, addr)
		if err != nil {
			t.Error(err)
		}
		got <- e
	}()
	w := dialEventually(t, addr)
	defer w.Close()
	e := <-got
	if e == nil {
		t.FailNow()
	}
	if _, err := w.Write([]byte("GET / HTTP/1.1\r\n")); err != nil {
		t.Fatal(err)
	}
	e.Close()
	w.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := w.Read(make([]byte, 1)); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("workload's read after Close = %v; want EOF or reset", err)
	}
	// The agent still serves: a ping answers.
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestEgressBounded: the agent relays only as many connections as the
// edge has EgressAccept streams open; the rest wait in the backlog
// unserved, and a canceled accept leaves the agent serving.
func TestEgressBounded(t *testing.T) {
	c := startAgent(t, Options{})
	addr := freeLoopbackAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got := make(chan *EgressConn, 1)
	go func() {
		e, _ := c.AcceptEgress(ctx, addr)
		got <- e
	}()
	w1 := dialEventually(t, addr)
	defer w1.Close()
	e1 := <-got
	if e1 == nil {
		t.Fatal("first accept failed")
	}
	defer e1.Close()
	// A second connection has no stream: whatever it sends, no reply.
	w2, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer w2.Close()
	w2.Write([]byte("hello"))
	w2.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, err := w2.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("unrelayed connection read %d bytes, %v", n, err)
	}
	// An accept whose context ends returns without a connection...
	short, cancelShort := context.WithCancel(ctx)
	cancelShort()
	if _, err := c.AcceptEgress(short, addr); err == nil {
		t.Fatal("canceled accept returned a connection")
	}
	// ...and the waiting connection is handed to the next accept.
	e2, err := c.AcceptEgress(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	buf := make([]byte, 5)
	if _, err := io.ReadFull(e2, buf); err != nil || string(buf) != "hello" {
		t.Fatalf("second connection relayed %q, %v", buf, err)
	}
}

func TestEgressListenAddress(t *testing.T) {
	c := startAgent(t, Options{})
	ctx := context.Background()
	for _, a := range []string{"0.0.0.0:3128", "10.0.0.1:3128", "127.0.0.1", "localhost:3128", "127.0.0.1:0"} {
		_, err := c.AcceptEgress(ctx, a)
		var ae *Error
		if !errors.As(err, &ae) || ae.Code != CodeInvalidArgument {
			t.Errorf("AcceptEgress(%q) = %v; want InvalidArgument", a, err)
		}
	}
	// A port the workload took first: a failed precondition, not a crash.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	p, _ := strconv.Atoi(port)
	_, err = c.AcceptEgress(ctx, "127.0.0.1:"+strconv.Itoa(p))
	var ae *Error
	if !errors.As(err, &ae) || ae.Code != CodeFailedPrecondition {
		t.Errorf("AcceptEgress on a taken port = %v; want FailedPrecondition", err)
	}
}
