package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"unicode/utf8"
)

// Init is the sandbox's configuration, sent by the backend as the first
// request on a new agent's channel (message Init in agent.proto, where the
// fields are described). The agent sets the sandbox up from it before it
// serves anything else: AcceptInit on the agent's side, Client.Init on the
// backend's. Message fields are pointers because the wire tells a message
// that is absent from one that is empty.
type Init struct {
	Hostname string
	// Env, Workdir and User are the defaults of every exec (Options).
	Env       []string
	Workdir   string
	User      string
	Resources *Resources
	// Layers are the read-only layers, top first (overlay order).
	Layers    []Source
	Writable  *Writable
	Container *ContainerInit
}

// Resources are the sandbox's limits as the guest should know them.
type Resources struct {
	MilliCPU    int64
	MemoryBytes int64
	Pids        int64
	DiskBytes   int64
}

// Source is where a file system comes from, as the agent sees it: a
// directory in its view (Path; the container backend's layers), or a device
// of a VM guest (Block, Pmem) holding a file system of type FSType. Exactly
// one of Path, Block and Pmem is set; an empty Path is no path.
type Source struct {
	Path   string
	Block  *BlockDevice
	Pmem   *PmemDevice
	FSType string
}

// BlockDevice is a virtio-blk disk named by its serial.
type BlockDevice struct {
	Serial string
}

// PmemDevice is a virtio-pmem device, /dev/pmem<Index>; DAX mounts its
// file system with dax=always.
type PmemDevice struct {
	Index uint32
	DAX   bool
}

// Writable is the writable layer: a file system holding the overlay's
// upper and work directories, named relative to its root.
type Writable struct {
	Source *Source
	Upper  string
	Work   string
}

// ContainerInit is the container backend's part of Init (see agent.proto
// and sandboxinit, which reads it).
type ContainerInit struct {
	Rootfs        string
	UserNS        bool
	Seccomp       []byte
	Caps          uint64 // bit c: capability c is kept
	NoLockdown    bool
	UserTasks     string
	UserCgroupDir string
	UserMoreTasks []string
	CgroupFiles   []string
}

// InitResult is what a successful Init reports.
type InitResult struct {
	Container *ContainerInitResult
}

// ContainerInitResult is the container backend's part of InitResult: the
// agent's descriptors the edge borrows (see agent.proto).
type ContainerInitResult struct {
	MqueueFD  int32
	CgroupFDs []int32
}

// Validate checks what every backend's init relies on, naming the field at
// fault.
func (in *Init) Validate() error {
	// The exec defaults reach execve and the hostname sethostname, where a
	// NUL byte would cut them short.
	for _, f := range []struct{ name, v string }{{"hostname", in.Hostname}, {"workdir", in.Workdir}, {"user", in.User}} {
		if strings.IndexByte(f.v, 0) >= 0 {
			return errorf(CodeInvalidArgument, "init: %s: contains a NUL byte", f.name)
		}
	}
	for i, kv := range in.Env {
		if strings.IndexByte(kv, 0) >= 0 {
			return errorf(CodeInvalidArgument, "init: env[%d]: contains a NUL byte", i)
		}
	}
	if len(in.Layers) == 0 {
		return errorf(CodeInvalidArgument, "init: layers: none")
	}
	for i := range in.Layers {
		if err := in.Layers[i].validate(); err != nil {
			return errorf(CodeInvalidArgument, "init: layers[%d]: %v", i, err)
		}
	}
	if w := in.Writable; w != nil {
		if w.Source == nil {
			return errorf(CodeInvalidArgument, "init: writable.source: none")
		}
		if err := w.Source.validate(); err != nil {
			return errorf(CodeInvalidArgument, "init: writable.source: %v", err)
		}
		for _, d := range []struct{ name, v string }{{"upper", w.Upper}, {"work", w.Work}} {
			if !filepath.IsLocal(d.v) {
				return errorf(CodeInvalidArgument, "init: writable.%s %q: must be a relative path inside the source", d.name, d.v)
			}
		}
	}
	return nil
}

func (s *Source) validate() error {
	n := 0
	if s.Path != "" {
		n++
	}
	if s.Block != nil {
		n++
		if s.Block.Serial == "" {
			return errors.New("block.serial: empty")
		}
	}
	if s.Pmem != nil {
		n++
	}
	switch {
	case n == 0:
		return errors.New("names no path, block or pmem device")
	case n > 1:
		return errors.New("names more than one of path, block and pmem")
	case s.Path == "" && s.FSType == "":
		return errors.New("fstype: empty for a device")
	}
	return nil
}

// Init sends the sandbox's configuration, which must be the first request
// on the connection, and waits for the agent to set the sandbox up. An
// error the agent reported is an *Error (the sandbox could not be built);
// ctx bounds the wait.
func (c *Client) Init(ctx context.Context, in *Init) (*InitResult, error) {
	s, err := c.open("init", &request{init: in})
	if err != nil {
		return nil, err
	}
	defer c.m.remove(s)
	resp, err := c.finish(ctx, "init", s, nil)
	if err != nil {
		return nil, err
	}
	if resp.init == nil {
		return &InitResult{}, nil
	}
	return resp.init, nil
}

// AcceptInit is the agent's side of Init: it reads the first request on
// conn, which must be an Init, calls setup with it and answers with what
// setup returned. It returns setup's error (already reported to the peer)
// or the reason the exchange failed; the agent must then exit, because a
// half-built sandbox must never serve. Call it before Serve, on the same
// conn: it reads exactly one frame.
func AcceptInit(conn io.ReadWriter, setup func(*Init) (*InitResult, error)) error {
	f, err := readFrame(conn, nil)
	if err != nil {
		return fmt.Errorf("read init: %w", err)
	}
	var res *InitResult
	if f.request == nil || f.request.init == nil {
		err = errorf(CodeInvalidArgument, "the first request on stream %d is not init", f.stream)
	} else if res, err = setup(f.request.init); err == nil && res == nil {
		res = &InitResult{}
	}
	resp := &response{init: res}
	if err != nil {
		resp = errResponse(err)
	}
	if werr := writeFrame(conn, &frame{stream: f.stream, response: resp}); werr != nil && err == nil {
		err = fmt.Errorf("answer init: %w", werr)
	}
	return err
}

// readFrame reads one length-prefixed frame from r into buf (grown as
// needed) and decodes it.
func readFrame(r io.Reader, buf []byte) (*frame, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > MaxFrame {
		return nil, fmt.Errorf("peer sent a %d byte frame, more than the %d byte limit", n, MaxFrame)
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		return nil, err
	}
	f, err := unmarshalFrame(buf)
	if err != nil {
		return nil, fmt.Errorf("decode frame: %w", err)
	}
	return f, nil
}

// writeFrame writes one frame outside a mux (AcceptInit, before Serve).
func writeFrame(w io.Writer, f *frame) error {
	if err := f.checkUTF8(); err != nil {
		return err
	}
	b := appendFrame(make([]byte, 4, 64), f)
	if len(b)-4 > MaxFrame {
		return fmt.Errorf("frame for stream %d is %d bytes, more than the %d byte limit", f.stream, len(b)-4, MaxFrame)
	}
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	_, err := w.Write(b)
	return err
}

// ---- codec (see wire.go) ----
//
// Init travels once per sandbox, so its nested messages are encoded into a
// scratch buffer to learn their length rather than sized beforehand.

func appendSub(b []byte, num int, sub []byte) []byte {
	b = appendMsgHeader(b, num, len(sub))
	return append(b, sub...)
}

func (in *Init) appendTo(b []byte) []byte {
	b = appendString(b, 1, in.Hostname, false)
	b = appendStrings(b, 2, in.Env)
	b = appendString(b, 3, in.Workdir, false)
	b = appendString(b, 4, in.User, false)
	if r := in.Resources; r != nil {
		var sub []byte
		sub = appendUint(sub, 1, uint64(r.MilliCPU))
		sub = appendUint(sub, 2, uint64(r.MemoryBytes))
		sub = appendUint(sub, 3, uint64(r.Pids))
		sub = appendUint(sub, 4, uint64(r.DiskBytes))
		b = appendSub(b, 5, sub)
	}
	for i := range in.Layers {
		b = appendSub(b, 6, in.Layers[i].appendTo(nil))
	}
	if w := in.Writable; w != nil {
		var sub []byte
		if w.Source != nil {
			sub = appendSub(sub, 1, w.Source.appendTo(nil))
		}
		sub = appendString(sub, 2, w.Upper, false)
		sub = appendString(sub, 3, w.Work, false)
		b = appendSub(b, 7, sub)
	}
	if c := in.Container; c != nil {
		var sub []byte
		sub = appendString(sub, 1, c.Rootfs, false)
		sub = appendUint(sub, 2, b2u(c.UserNS))
		if len(c.Seccomp) > 0 {
			sub = appendSub(sub, 3, c.Seccomp)
		}
		sub = appendUint(sub, 4, c.Caps)
		sub = appendUint(sub, 5, b2u(c.NoLockdown))
		sub = appendString(sub, 6, c.UserTasks, false)
		sub = appendString(sub, 7, c.UserCgroupDir, false)
		sub = appendStrings(sub, 8, c.UserMoreTasks)
		sub = appendStrings(sub, 9, c.CgroupFiles)
		b = appendSub(b, 8, sub)
	}
	return b
}

// appendTo writes fstype, then the first member of the oneof that is set:
// protobuf-go writes a message's oneof members after its other fields.
func (s *Source) appendTo(b []byte) []byte {
	b = appendString(b, 4, s.FSType, false)
	switch {
	case s.Path != "":
		b = appendString(b, 1, s.Path, true)
	case s.Block != nil:
		b = appendSub(b, 2, appendString(nil, 1, s.Block.Serial, false))
	case s.Pmem != nil:
		b = appendSub(b, 3, appendUint(appendUint(nil, 1, uint64(s.Pmem.Index)), 2, b2u(s.Pmem.DAX)))
	}
	return b
}

func (r *InitResult) appendTo(b []byte) []byte {
	if c := r.Container; c != nil {
		sub := appendUint(nil, 1, uint64(int64(c.MqueueFD)))
		if len(c.CgroupFDs) > 0 {
			// Packed, as proto3 writes repeated scalars.
			var packed []byte
			for _, fd := range c.CgroupFDs {
				packed = appendVarint(packed, uint64(int64(fd)))
			}
			sub = appendSub(sub, 2, packed)
		}
		b = appendSub(b, 1, sub)
	}
	return b
}

func (in *Init) strings() []string {
	ss := append([]string{in.Hostname, in.Workdir, in.User}, in.Env...)
	for i := range in.Layers {
		ss = append(ss, in.Layers[i].strings()...)
	}
	if w := in.Writable; w != nil {
		ss = append(ss, w.Upper, w.Work)
		if w.Source != nil {
			ss = append(ss, w.Source.strings()...)
		}
	}
	if c := in.Container; c != nil {
		ss = append(ss, c.Rootfs, c.UserTasks, c.UserCgroupDir)
		ss = append(ss, c.UserMoreTasks...)
		ss = append(ss, c.CgroupFiles...)
	}
	return ss
}

func (s *Source) strings() []string {
	ss := []string{s.Path, s.FSType}
	if s.Block != nil {
		ss = append(ss, s.Block.Serial)
	}
	return ss
}

func validUTF8(ss []string) bool {
	for _, s := range ss {
		if !utf8.ValidString(s) {
			return false
		}
	}
	return true
}

// strField decodes a string field into dst.
func strField(fd *field, dst *string) error {
	s, err := str(fd.b)
	if err == nil {
		*dst = s
	}
	return err
}

func (in *Init) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		if fd.wt != wtBytes {
			return nil
		}
		switch fd.num {
		case 1:
			return strField(fd, &in.Hostname)
		case 2:
			var s string
			if err := strField(fd, &s); err != nil {
				return err
			}
			in.Env = append(in.Env, s)
		case 3:
			return strField(fd, &in.Workdir)
		case 4:
			return strField(fd, &in.User)
		case 5:
			if in.Resources == nil {
				in.Resources = &Resources{}
			}
			r := in.Resources
			return eachField(fd.b, func(fd *field) error {
				if fd.wt != wtVarint {
					return nil
				}
				switch fd.num {
				case 1:
					r.MilliCPU = int64(fd.u)
				case 2:
					r.MemoryBytes = int64(fd.u)
				case 3:
					r.Pids = int64(fd.u)
				case 4:
					r.DiskBytes = int64(fd.u)
				}
				return nil
			})
		case 6:
			in.Layers = append(in.Layers, Source{})
			return in.Layers[len(in.Layers)-1].unmarshal(fd.b)
		case 7:
			if in.Writable == nil {
				in.Writable = &Writable{}
			}
			w := in.Writable
			return eachField(fd.b, func(fd *field) error {
				if fd.wt != wtBytes {
					return nil
				}
				switch fd.num {
				case 1:
					if w.Source == nil {
						w.Source = &Source{}
					}
					return w.Source.unmarshal(fd.b)
				case 2:
					return strField(fd, &w.Upper)
				case 3:
					return strField(fd, &w.Work)
				}
				return nil
			})
		case 8:
			if in.Container == nil {
				in.Container = &ContainerInit{}
			}
			return in.Container.unmarshal(fd.b)
		}
		return nil
	})
}

func (c *ContainerInit) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		if fd.wt == wtVarint {
			switch fd.num {
			case 2:
				c.UserNS = fd.u != 0
			case 4:
				c.Caps = fd.u
			case 5:
				c.NoLockdown = fd.u != 0
			}
			return nil
		}
		var s string
		switch fd.num {
		case 1:
			return strField(fd, &c.Rootfs)
		case 3:
			c.Seccomp = append([]byte(nil), fd.b...)
		case 6:
			return strField(fd, &c.UserTasks)
		case 7:
			return strField(fd, &c.UserCgroupDir)
		case 8:
			if err := strField(fd, &s); err != nil {
				return err
			}
			c.UserMoreTasks = append(c.UserMoreTasks, s)
		case 9:
			if err := strField(fd, &s); err != nil {
				return err
			}
			c.CgroupFiles = append(c.CgroupFiles, s)
		}
		return nil
	})
}

// unmarshal merges b into s: a member of the oneof replaces any other, the
// same message member twice merges.
func (s *Source) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		if fd.wt != wtBytes {
			return nil
		}
		switch fd.num {
		case 1:
			s.Block, s.Pmem = nil, nil
			return strField(fd, &s.Path)
		case 2:
			s.Path, s.Pmem = "", nil
			if s.Block == nil {
				s.Block = &BlockDevice{}
			}
			d := s.Block
			return eachField(fd.b, func(fd *field) error {
				if fd.num == 1 && fd.wt == wtBytes {
					return strField(fd, &d.Serial)
				}
				return nil
			})
		case 3:
			s.Path, s.Block = "", nil
			if s.Pmem == nil {
				s.Pmem = &PmemDevice{}
			}
			d := s.Pmem
			return eachField(fd.b, func(fd *field) error {
				if fd.wt != wtVarint {
					return nil
				}
				switch fd.num {
				case 1:
					d.Index = uint32(fd.u)
				case 2:
					d.DAX = fd.u != 0
				}
				return nil
			})
		case 4:
			return strField(fd, &s.FSType)
		}
		return nil
	})
}

func (r *InitResult) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		if fd.num != 1 || fd.wt != wtBytes {
			return nil
		}
		if r.Container == nil {
			r.Container = &ContainerInitResult{}
		}
		c := r.Container
		return eachField(fd.b, func(fd *field) error {
			switch {
			case fd.num == 1 && fd.wt == wtVarint:
				c.MqueueFD = int32(fd.u)
			case fd.num == 2 && fd.wt == wtVarint:
				c.CgroupFDs = append(c.CgroupFDs, int32(fd.u))
			case fd.num == 2 && fd.wt == wtBytes:
				// Packed: a run of varints.
				for p := fd.b; len(p) > 0; {
					v, n := consumeVarint(p)
					if n < 0 {
						return varintErr(n)
					}
					c.CgroupFDs = append(c.CgroupFDs, int32(v))
					p = p[n:]
				}
			}
			return nil
		})
	})
}
