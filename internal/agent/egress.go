package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// The agent's half of egress (internal/aether holds the edge's): a plain
// TCP relay. The agent parses nothing a workload sends; it hands each
// connection made to its listener to the edge, which reads the proxy
// request, decides it against the sandbox's policy and dials. So PID 1
// holds per connection one 32 KiB read buffer and at most a flow-control
// Window of bytes from the edge, and the number of connections is the
// number of EgressAccept streams the edge keeps open: a workload cannot
// make it allocate without bound (connections beyond that wait in the
// listener's backlog, then are refused by the kernel).

// egressListeners are the server's proxy listeners by address, made by
// the first EgressAccept that names one and kept until Serve returns. Each
// has one goroutine accepting and handing connections over unbuffered, so
// at most one accepted connection waits for a stream to take it. They are
// made with plain system calls: the agent runs in every sandbox and does
// not link package net (its init and resolver) for one loopback socket.
type egressListeners struct {
	mu     sync.Mutex
	closed bool
	by     map[string]*egressListener
}

type egressListener struct {
	fd    int
	conns chan *os.File
}

func (e *egressListeners) get(addr string) (*egressListener, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().IsLoopback() || ap.Port() == 0 {
		return nil, errorf(CodeInvalidArgument, "egress accept: listen address %q is not a loopback address with a port", addr)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errCanceled
	}
	if l := e.by[addr]; l != nil {
		return l, nil
	}
	fd, err := listenTCP(ap)
	if err != nil {
		// Most likely the workload bound the port first: its own sandbox
		// loses egress, nothing else does.
		return nil, errorf(CodeFailedPrecondition, "egress accept: listen on %s: %v", addr, err)
	}
	l := &egressListener{fd: fd, conns: make(chan *os.File)}
	go func() {
		defer close(l.conns)
		for {
			// A blocking accept on its own thread: one per listener.
			cfd, _, err := unix.Accept4(fd, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
			switch {
			case err == unix.EINTR || err == unix.ECONNABORTED:
				continue
			case err != nil:
				return // shut down by close, or broken
			}
			l.conns <- os.NewFile(uintptr(cfd), "egress")
		}
	}()
	if e.by == nil {
		e.by = map[string]*egressListener{}
	}
	e.by[addr] = l
	return l, nil
}

// listenTCP makes a blocking listening socket on ap.
func listenTCP(ap netip.AddrPort) (int, error) {
	var sa unix.Sockaddr
	family := unix.AF_INET
	if ap.Addr().Is4() {
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	} else {
		family = unix.AF_INET6
		sa = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.Bind(fd, sa); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.Listen(fd, 128); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// close closes every listener and the connections waiting in hand-over.
func (e *egressListeners) close() {
	e.mu.Lock()
	e.closed = true
	by := e.by
	e.by = nil
	e.mu.Unlock()
	for _, l := range by {
		// Shutdown wakes the blocked accept (EINVAL); then the fd goes.
		unix.Shutdown(l.fd, unix.SHUT_RDWR)
		go func() {
			for c := range l.conns {
				c.Close()
			}
			unix.Close(l.fd)
		}()
	}
}

// shutdown half-closes the socket f (unix.SHUT_RD or SHUT_WR).
func shutdown(f *os.File, how int) {
	if rc, err := f.SyscallConn(); err == nil {
		rc.Control(func(fd uintptr) { unix.Shutdown(int(fd), how) })
	}
}

// egressAccept relays the next connection to the listener over s.
func (srv *server) egressAccept(s *stream, r *egressAcceptRequest) error {
	l, err := srv.egress.get(r.listen)
	if err != nil {
		return err
	}
	var c *os.File
	select {
	case c = <-l.conns:
		if c == nil {
			return errCanceled
		}
	case <-s.ctx.Done():
		return errCanceled
	}
	defer c.Close()
	// A Cancel ends the connection: reading from the workload stops at
	// once, and what the edge sent before it (a reply, then its end) is
	// still written out, as the frames arrived in order; without that end
	// the inbound copy fails on the canceled context and closes c.
	stop := context.AfterFunc(s.ctx, func() { shutdown(c, unix.SHUT_RD) })
	defer stop()
	if err := s.sendData(s.ctx, chBody, nil, false); err != nil {
		return nil // the edge is gone; nobody to answer
	}

	inbound := make(chan struct{})
	go func() {
		defer close(inbound)
		_, err := io.Copy(c, &bodyReader{ctx: s.ctx, s: s})
		if err == nil {
			shutdown(c, unix.SHUT_WR)
		} else {
			c.Close()
		}
	}()
	buf := make([]byte, MaxChunk)
	for {
		n, rerr := c.Read(buf)
		if n > 0 {
			if err := s.sendData(s.ctx, chBody, buf[:n], false); err != nil {
				c.Close()
				break
			}
		}
		if rerr != nil {
			// EOF or a reset: either way this direction is over.
			_ = s.sendData(s.ctx, chBody, nil, true)
			break
		}
	}
	<-inbound
	return nil
}

// EgressConn is one connection a workload made to its sandbox's egress
// proxy, relayed by the agent: the edge reads what the workload sent and
// writes what it should receive. Close ends it on both sides.
type EgressConn struct {
	c    *Client
	s    *stream
	ctx  context.Context
	stop context.CancelFunc
	r    bodyReader

	wmu    sync.Mutex
	closed bool
}

// AcceptEgress waits for the next connection a workload makes to
// listen (a loopback address and port inside the sandbox; the agent starts
// listening there on the first call). Cancel ctx to stop waiting; once it
// returns, the connection lives until Close, whatever ctx does.
func (c *Client) AcceptEgress(ctx context.Context, listen string) (*EgressConn, error) {
	op := "egress accept"
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("agent %s: %w", op, err)
	}
	s, err := c.open(op, &request{egress: &egressAcceptRequest{listen: listen}})
	if err != nil {
		return nil, err
	}
	it, err := s.next(ctx)
	if err != nil {
		c.cancel(s)
		c.m.remove(s)
		if ctx.Err() != nil {
			return nil, fmt.Errorf("agent %s: %w", op, ctx.Err())
		}
		return nil, c.wrap(op, err)
	}
	if it.resp != nil {
		c.m.remove(s)
		if err := fromWire(it.resp.err); err != nil {
			return nil, err
		}
		return nil, goneError(op, io.EOF)
	}
	sctx, stop := context.WithCancel(context.Background())
	e := &EgressConn{c: c, s: s, ctx: sctx, stop: stop}
	e.r = bodyReader{ctx: sctx, s: s, cur: it.data.chunk, eof: it.data.eof}
	s.consumed(len(it.data.chunk))
	return e, nil
}

// Read reads what the workload sent; io.EOF once it half-closed.
func (e *EgressConn) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if errors.Is(err, errStreamDone) {
		err = io.EOF
	}
	return n, err
}

// Write sends p to the workload.
func (e *EgressConn) Write(p []byte) (int, error) {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	if e.closed {
		return 0, os.ErrClosed
	}
	if err := e.s.sendData(e.ctx, chBody, p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// CloseWrite tells the workload no more bytes come (its read sees EOF).
func (e *EgressConn) CloseWrite() error {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	return e.s.sendData(e.ctx, chBody, nil, true)
}

// Close ends the connection: the agent closes the workload's socket.
func (e *EgressConn) Close() error {
	e.wmu.Lock()
	e.closed = true
	e.wmu.Unlock()
	e.c.cancel(e.s)
	e.stop()
	e.c.m.remove(e.s)
	return nil
}
