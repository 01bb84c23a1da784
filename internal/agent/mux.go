package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
)

// Protocol limits. Both ends use the same constants; they are part of the
// protocol, so changing them is a protocol change.
const (
	// Window is the per-stream, per-direction flow-control window: the most
	// Data chunk bytes a sender may have in flight before the receiver
	// returns credit. It is also the bound on what a receiver buffers for a
	// stream whose consumer is slow, so a slow consumer costs at most this
	// much memory and stalls only its own stream (the producer, e.g. the
	// process writing to a pipe, blocks instead).
	Window = 256 << 10
	// MaxChunk is the largest Data chunk in one frame, so one stream's bulk
	// transfer delays the frames of other streams by at most this much.
	MaxChunk = 32 << 10
	// MaxFrame bounds one encoded frame. Only request headers (argv, env,
	// a shell script) can come near it; ARG_MAX is 2 MiB anyway.
	MaxFrame = 4 << 20
)

var (
	errStreamDone = errors.New("stream finished")
	errWindow     = errors.New("peer overran the flow-control window")
)

// item is one inbound frame queued on a stream, in arrival order.
type item struct {
	data *dataMsg
	resp *response
}

// stream is one operation on a mux. Its lock (stream.mu) is never held while
// taking mux.mu or mux.wmu, and no lock is held across a conn write except
// mux.wmu itself.
type stream struct {
	id uint64
	m  *mux

	// Set by the server before the handler starts; canceled by a Cancel
	// frame or when the connection ends.
	ctx    context.Context
	cancel context.CancelFunc
	// bg tracks a handler's goroutines that may outlive its response
	// (an exec's stdin feeder); they end once the stream is removed.
	bg sync.WaitGroup

	mu          sync.Mutex
	queue       []item
	outstanding int // Data bytes received and not yet returned as credit
	taken       int // Data bytes consumed and not yet returned as credit
	credit      int // Data bytes we may still send
	finished    bool

	dataWake   chan struct{} // cap 1: queue grew
	creditWake chan struct{} // cap 1: credit grew
	done       chan struct{} // closed when the stream is removed
}

func wake(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// mux runs framed, multiplexed streams over one byte stream. The read loop
// never writes and never waits for a consumer (it only queues, bounded by
// Window per stream), so two muxes talking to each other cannot deadlock
// even over an unbuffered pipe.
type mux struct {
	rw io.ReadWriteCloser
	// onRequest is set on the agent side; it runs on the read loop and must
	// not block.
	onRequest func(s *stream, req *request)

	wmu sync.Mutex // serialises frame writes

	mu      sync.Mutex
	streams map[uint64]*stream

	closeOnce sync.Once
	closed    chan struct{}
	err       error // why the connection ended; set before closed is closed
}

func newMux(rw io.ReadWriteCloser) *mux {
	return &mux{rw: rw, streams: make(map[uint64]*stream), closed: make(chan struct{})}
}

// fail ends the connection with err; every waiter on it returns.
func (m *mux) fail(err error) {
	m.closeOnce.Do(func() {
		if err == nil {
			err = io.EOF
		}
		m.err = err
		close(m.closed)
		m.rw.Close()
	})
}

// connErr reports why the connection ended.
func (m *mux) connErr() error {
	<-m.closed
	return m.err
}

func (m *mux) register(id uint64) (*stream, error) {
	s := &stream{
		id:         id,
		m:          m,
		credit:     Window,
		dataWake:   make(chan struct{}, 1),
		creditWake: make(chan struct{}, 1),
		done:       make(chan struct{}),
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, dup := m.streams[id]; dup {
		return nil, fmt.Errorf("stream %d opened twice", id)
	}
	m.streams[id] = s
	return s, nil
}

func (m *mux) lookup(id uint64) *stream {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.streams[id]
}

// remove forgets the stream; frames that still arrive for it are dropped.
func (m *mux) remove(s *stream) {
	m.mu.Lock()
	if m.streams[s.id] == s {
		delete(m.streams, s.id)
	}
	m.mu.Unlock()
	s.mu.Lock()
	if !s.finished {
		s.finished = true
		close(s.done)
	}
	s.mu.Unlock()
}

var framePool = sync.Pool{New: func() any { b := make([]byte, 0, MaxChunk+256); return &b }}

// send writes one frame. A write error ends the connection.
func (m *mux) send(f *frame) error {
	if err := f.checkUTF8(); err != nil {
		if f.request != nil { // the caller's input
			return errorf(CodeInvalidArgument, "request: %v", err)
		}
		return fmt.Errorf("encode frame for stream %d: %w", f.stream, err)
	}
	bp := framePool.Get().(*[]byte)
	b := appendFrame(append((*bp)[:0], 0, 0, 0, 0), f)
	if len(b)-4 > MaxFrame {
		if f.request != nil {
			// Only a request's header (argv, env, a shell script) can be
			// this large: the caller's input, refused before it is sent.
			return errorf(CodeInvalidArgument, "request is %d bytes encoded, more than the %d byte limit (argv, env and shell together)", len(b)-4, MaxFrame)
		}
		return fmt.Errorf("frame for stream %d is %d bytes, more than the %d byte limit", f.stream, len(b)-4, MaxFrame)
	}
	var err error
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	m.wmu.Lock()
	select {
	case <-m.closed:
		err = m.err
	default:
		_, err = m.rw.Write(b)
	}
	m.wmu.Unlock()
	if cap(b) <= 2*(MaxChunk+256) {
		*bp = b[:0]
		framePool.Put(bp)
	}
	if err != nil {
		m.fail(err)
		return m.connErr()
	}
	return nil
}

// readLoop reads frames until the connection fails and returns why.
func (m *mux) readLoop() error {
	var hdr [4]byte
	buf := make([]byte, 0, 4096)
	for {
		if _, err := io.ReadFull(m.rw, hdr[:]); err != nil {
			return err
		}
		n := binary.BigEndian.Uint32(hdr[:])
		if n > MaxFrame {
			return fmt.Errorf("peer sent a %d byte frame, more than the %d byte limit", n, MaxFrame)
		}
		if cap(buf) < int(n) {
			buf = make([]byte, n)
		}
		buf = buf[:n]
		if _, err := io.ReadFull(m.rw, buf); err != nil {
			return err
		}
		// unmarshalFrame copies bytes fields, so buf can be reused.
		f, err := unmarshalFrame(buf)
		if err != nil {
			return fmt.Errorf("decode frame: %w", err)
		}
		if cap(buf) > 2*MaxChunk {
			buf = make([]byte, 0, 4096) // do not pin a large request's buffer
		}
		if err := m.dispatch(f); err != nil {
			return err
		}
	}
}

func (m *mux) dispatch(f *frame) error {
	id := f.stream
	switch {
	case f.request != nil:
		if m.onRequest == nil {
			return fmt.Errorf("peer sent a request on stream %d to a client", id)
		}
		s, err := m.register(id)
		if err != nil {
			return err
		}
		m.onRequest(s, f.request)
	case f.data != nil:
		if s := m.lookup(id); s != nil {
			return s.pushData(f.data)
		}
	case f.window != nil:
		if s := m.lookup(id); s != nil {
			s.addCredit(int(f.window.bytes))
		}
	case f.cancel != nil:
		if s := m.lookup(id); s != nil && s.cancel != nil {
			s.cancel()
		}
	case f.response != nil:
		if s := m.lookup(id); s != nil {
			s.mu.Lock()
			s.queue = append(s.queue, item{resp: f.response})
			s.mu.Unlock()
			wake(s.dataWake)
			m.remove(s)
		}
	default:
		return fmt.Errorf("peer sent an empty or unknown frame on stream %d", id)
	}
	return nil
}

func (s *stream) pushData(d *dataMsg) error {
	s.mu.Lock()
	if s.finished {
		s.mu.Unlock()
		return nil
	}
	s.outstanding += len(d.chunk)
	if s.outstanding > Window {
		s.mu.Unlock()
		return fmt.Errorf("stream %d: %w", s.id, errWindow)
	}
	s.queue = append(s.queue, item{data: d})
	s.mu.Unlock()
	wake(s.dataWake)
	return nil
}

func (s *stream) addCredit(n int) {
	s.mu.Lock()
	s.credit += n
	s.mu.Unlock()
	wake(s.creditWake)
}

// next returns the next inbound item. Queued items are returned even after
// the connection failed, so a response that arrived is never lost.
func (s *stream) next(ctx context.Context) (item, error) {
	for {
		s.mu.Lock()
		if len(s.queue) > 0 {
			it := s.queue[0]
			s.queue[0] = item{}
			s.queue = s.queue[1:]
			if len(s.queue) == 0 {
				s.queue = s.queue[:0:0]
			}
			s.mu.Unlock()
			return it, nil
		}
		s.mu.Unlock()
		var endErr error
		select {
		case <-s.dataWake:
			continue
		case <-s.done:
			endErr = errStreamDone
		case <-s.m.closed:
			endErr = s.m.connErr()
		case <-ctx.Done():
			return item{}, ctx.Err()
		}
		// Re-check the queue once: the last item may have raced the end.
		s.mu.Lock()
		empty := len(s.queue) == 0
		s.mu.Unlock()
		if empty {
			return item{}, endErr
		}
	}
}

// consumed returns credit for n Data bytes the consumer has taken. Credit
// goes back in batches of at least half a window to keep WindowUpdate
// frames rare; the sender can still never stall on a drained receiver
// because it stops only when a whole window is outstanding.
func (s *stream) consumed(n int) {
	if n == 0 {
		return
	}
	s.mu.Lock()
	s.taken += n
	grant := 0
	if s.taken >= Window/2 && !s.finished {
		grant = s.taken
		s.taken = 0
		s.outstanding -= grant
	}
	s.mu.Unlock()
	if grant > 0 {
		// A failed write ends the connection; callers notice there.
		_ = s.m.send(&frame{stream: s.id, window: &windowUpdate{bytes: uint32(grant)}})
	}
}

func (s *stream) takeCredit(ctx context.Context, want int) (int, error) {
	for {
		s.mu.Lock()
		if s.credit > 0 {
			n := min(want, s.credit)
			s.credit -= n
			more := s.credit > 0
			s.mu.Unlock()
			if more {
				wake(s.creditWake) // pass the wake on to another sender
			}
			return n, nil
		}
		s.mu.Unlock()
		select {
		case <-s.creditWake:
		case <-s.done:
			return 0, errStreamDone
		case <-s.m.closed:
			return 0, s.m.connErr()
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// sendData sends p on channel ch in chunks, waiting for credit; eof marks
// the end of the body (sent even when p is empty).
func (s *stream) sendData(ctx context.Context, ch channel, p []byte, eof bool) error {
	for {
		n := 0
		if len(p) > 0 {
			var err error
			if n, err = s.takeCredit(ctx, min(len(p), MaxChunk)); err != nil {
				return err
			}
		} else {
			select {
			case <-s.done:
				return errStreamDone
			default:
			}
		}
		last := eof && n == len(p)
		err := s.m.send(&frame{stream: s.id, data: &dataMsg{channel: ch, chunk: p[:n], eof: last}})
		if err != nil {
			return err
		}
		p = p[n:]
		if len(p) == 0 && (last || !eof) {
			return nil
		}
	}
}

// bodyReader reads a stream's BODY data as an io.Reader, returning credit
// as it goes.
type bodyReader struct {
	ctx context.Context
	s   *stream
	cur []byte
	eof bool
}

func (r *bodyReader) Read(p []byte) (int, error) {
	for len(r.cur) == 0 {
		if r.eof {
			return 0, io.EOF
		}
		it, err := r.s.next(r.ctx)
		if err != nil {
			return 0, err
		}
		if it.data == nil || it.data.channel != chBody {
			continue
		}
		r.cur = it.data.chunk
		r.eof = it.data.eof
		r.s.consumed(len(r.cur))
	}
	n := copy(p, r.cur)
	r.cur = r.cur[n:]
	return n, nil
}

// bodyWriter sends everything written as BODY data.
type bodyWriter struct {
	ctx context.Context
	s   *stream
}

func (w bodyWriter) Write(p []byte) (int, error) {
	if err := w.s.sendData(w.ctx, chBody, p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}
