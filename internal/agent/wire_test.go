package agent

import (
	"bytes"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/dsec-dev/dsec/internal/agent/agentpb"
)

// The hand codec in wire.go must agree with the generated code of
// agentpb/agent.proto, which defines the wire format: for every message both
// ways, byte for byte on encode and field for field on decode.

// toPB converts a hand frame to the generated type.
func toPB(f *frame) *agentpb.Frame {
	out := &agentpb.Frame{Stream: f.stream}
	switch {
	case f.request != nil:
		r, pr := f.request, &agentpb.Request{}
		switch {
		case r.exec != nil:
			e := r.exec
			pr.Op = &agentpb.Request_Exec{Exec: &agentpb.ExecRequest{
				Argv: e.argv, Shell: e.shell, Env: e.env, Cwd: e.cwd, User: e.user,
				TimeoutNanos: e.timeoutNanos, MaxOutputBytes: e.maxOutputBytes,
				StreamOutput: e.streamOutput, HasStdin: e.hasStdin,
			}}
		case r.writeFile != nil:
			pr.Op = &agentpb.Request_WriteFile{WriteFile: &agentpb.WriteFileRequest{Path: r.writeFile.path, Mode: r.writeFile.mode}}
		case r.readFile != nil:
			pr.Op = &agentpb.Request_ReadFile{ReadFile: &agentpb.ReadFileRequest{Path: r.readFile.path, MaxBytes: r.readFile.maxBytes}}
		case r.putArchive != nil:
			pr.Op = &agentpb.Request_PutArchive{PutArchive: &agentpb.PutArchiveRequest{Dir: r.putArchive.dir}}
		case r.getArchive != nil:
			pr.Op = &agentpb.Request_GetArchive{GetArchive: &agentpb.GetArchiveRequest{Dir: r.getArchive.dir}}
		case r.ping != nil:
			pr.Op = &agentpb.Request_Ping{Ping: &agentpb.PingRequest{}}
		case r.init != nil:
			pr.Op = &agentpb.Request_Init{Init: initToPB(r.init)}
		case r.egress != nil:
			pr.Op = &agentpb.Request_EgressAccept{EgressAccept: &agentpb.EgressAcceptRequest{Listen: r.egress.listen}}
		case r.diff != nil:
			pr.Op = &agentpb.Request_Diff{Diff: &agentpb.DiffRequest{}}
		}
		out.Msg = &agentpb.Frame_Request{Request: pr}
	case f.data != nil:
		out.Msg = &agentpb.Frame_Data{Data: &agentpb.Data{Channel: agentpb.Channel(f.data.channel), Chunk: f.data.chunk, Eof: f.data.eof}}
	case f.window != nil:
		out.Msg = &agentpb.Frame_Window{Window: &agentpb.WindowUpdate{Bytes: f.window.bytes}}
	case f.cancel != nil:
		out.Msg = &agentpb.Frame_Cancel{Cancel: &agentpb.Cancel{}}
	case f.response != nil:
		pr := &agentpb.Response{}
		if e := f.response.err; e != nil {
			pr.Error = &agentpb.Error{Code: agentpb.Code(e.code), Message: e.message}
		}
		if e := f.response.exec; e != nil {
			pr.Exec = &agentpb.ExecResult{
				ExitCode: e.exitCode, Signal: e.signal, DurationNanos: e.durationNanos,
				TimedOut: e.timedOut, StdoutTruncated: e.stdoutTruncated, StderrTruncated: e.stderrTruncated, PidsExhausted: e.pidsExhausted,
				OomKilled: e.oomKilled, DiskFull: e.diskFull,
			}
		}
		if e := f.response.init; e != nil {
			pr.Init = &agentpb.InitResult{}
			if c := e.Container; c != nil {
				pr.Init.Container = &agentpb.ContainerInitResult{MqueueFd: c.MqueueFD, CgroupFds: c.CgroupFDs}
			}
		}
		out.Msg = &agentpb.Frame_Response{Response: pr}
	}
	return out
}

// fromPB converts a generated frame to the hand type.
func fromPB(p *agentpb.Frame) *frame {
	f := &frame{stream: p.GetStream()}
	switch m := p.Msg.(type) {
	case *agentpb.Frame_Request:
		r := &request{}
		switch op := m.Request.Op.(type) {
		case *agentpb.Request_Exec:
			e := op.Exec
			r.exec = &execRequest{
				argv: e.GetArgv(), shell: e.GetShell(), env: e.GetEnv(), cwd: e.GetCwd(), user: e.GetUser(),
				timeoutNanos: e.GetTimeoutNanos(), maxOutputBytes: e.GetMaxOutputBytes(),
				streamOutput: e.GetStreamOutput(), hasStdin: e.GetHasStdin(),
			}
		case *agentpb.Request_WriteFile:
			r.writeFile = &writeFileRequest{path: op.WriteFile.GetPath(), mode: op.WriteFile.GetMode()}
		case *agentpb.Request_ReadFile:
			r.readFile = &readFileRequest{path: op.ReadFile.GetPath(), maxBytes: op.ReadFile.GetMaxBytes()}
		case *agentpb.Request_PutArchive:
			r.putArchive = &putArchiveRequest{dir: op.PutArchive.GetDir()}
		case *agentpb.Request_GetArchive:
			r.getArchive = &getArchiveRequest{dir: op.GetArchive.GetDir()}
		case *agentpb.Request_Ping:
			r.ping = &pingRequest{}
		case *agentpb.Request_Init:
			r.init = initFromPB(op.Init)
		case *agentpb.Request_EgressAccept:
			r.egress = &egressAcceptRequest{listen: op.EgressAccept.GetListen()}
		case *agentpb.Request_Diff:
			r.diff = &diffRequest{}
		}
		f.request = r
	case *agentpb.Frame_Data:
		f.data = &dataMsg{channel: channel(m.Data.GetChannel()), chunk: m.Data.GetChunk(), eof: m.Data.GetEof()}
	case *agentpb.Frame_Window:
		f.window = &windowUpdate{bytes: m.Window.GetBytes()}
	case *agentpb.Frame_Cancel:
		f.cancel = &cancelMsg{}
	case *agentpb.Frame_Response:
		r := &response{}
		if e := m.Response.GetError(); e != nil {
			r.err = &wireError{code: Code(e.GetCode()), message: e.GetMessage()}
		}
		if e := m.Response.GetExec(); e != nil {
			r.exec = &execResult{
				exitCode: e.GetExitCode(), signal: e.GetSignal(), durationNanos: e.GetDurationNanos(),
				timedOut: e.GetTimedOut(), stdoutTruncated: e.GetStdoutTruncated(), stderrTruncated: e.GetStderrTruncated(), pidsExhausted: e.GetPidsExhausted(),
				oomKilled: e.GetOomKilled(), diskFull: e.GetDiskFull(),
			}
		}
		if e := m.Response.GetInit(); e != nil {
			r.init = &InitResult{}
			if c := e.GetContainer(); c != nil {
				r.init.Container = &ContainerInitResult{MqueueFD: c.GetMqueueFd(), CgroupFDs: c.GetCgroupFds()}
			}
		}
		f.response = r
	}
	return f
}

// normalize makes empty slices nil so frames compare with reflect.DeepEqual
// (the wire cannot tell them apart).
func normalize(f *frame) *frame {
	if r := f.request; r != nil && r.exec != nil {
		if len(r.exec.argv) == 0 {
			r.exec.argv = nil
		}
		if len(r.exec.env) == 0 {
			r.exec.env = nil
		}
	}
	if r := f.request; r != nil && r.init != nil {
		in := r.init
		nilIfEmpty(&in.Env)
		if len(in.Layers) == 0 {
			in.Layers = nil
		}
		if c := in.Container; c != nil {
			nilIfEmpty(&c.UserMoreTasks)
			nilIfEmpty(&c.CgroupFiles)
			if len(c.Seccomp) == 0 {
				c.Seccomp = nil
			}
		}
	}
	if r := f.response; r != nil && r.init != nil && r.init.Container != nil && len(r.init.Container.CgroupFDs) == 0 {
		r.init.Container.CgroupFDs = nil
	}
	if f.data != nil && len(f.data.chunk) == 0 {
		f.data.chunk = nil
	}
	return f
}

// randFrame returns a frame with random field values; about a third of the
// scalars are zero so implicit presence is exercised.
func randFrame(r *rand.Rand) *frame {
	u64 := func() uint64 {
		switch r.IntN(6) {
		case 0, 1:
			return 0
		case 2:
			return uint64(r.IntN(200))
		case 3:
			return math.MaxUint64 - uint64(r.IntN(3))
		}
		return r.Uint64() >> r.IntN(64)
	}
	i64 := func() int64 { return int64(u64()) }
	i32 := func() int32 { return int32(u64()) }
	b := func() bool { return r.IntN(2) == 0 }
	str := func() string {
		alphabet := []rune{'a', 'Z', '0', '/', ' ', '=', 'é', '世', '🙂', 0, 0x7f}
		n := r.IntN(4)
		if n == 3 {
			n = r.IntN(300) // a length needing a two-byte varint
		}
		s := make([]rune, n)
		for i := range s {
			s[i] = alphabet[r.IntN(len(alphabet))]
		}
		return string(s)
	}
	strs := func() []string {
		n := r.IntN(4)
		if n == 0 {
			return nil
		}
		s := make([]string, n)
		for i := range s {
			s[i] = str()
		}
		return s
	}

	f := &frame{stream: u64()}
	switch r.IntN(6) {
	case 0:
		req := &request{}
		switch r.IntN(9) {
		case 0:
			req.exec = &execRequest{
				argv: strs(), shell: str(), env: strs(), cwd: str(), user: str(),
				timeoutNanos: i64(), maxOutputBytes: i64(), streamOutput: b(), hasStdin: b(),
			}
		case 1:
			req.writeFile = &writeFileRequest{path: str(), mode: uint32(u64())}
		case 2:
			req.readFile = &readFileRequest{path: str(), maxBytes: i64()}
		case 3:
			req.putArchive = &putArchiveRequest{dir: str()}
		case 4:
			req.getArchive = &getArchiveRequest{dir: str()}
		case 5:
			req.ping = &pingRequest{}
		case 6:
			req.init = randInit(r, u64, b, str, strs)
		case 7:
			req.egress = &egressAcceptRequest{listen: str()}
		case 8:
			req.diff = &diffRequest{}
		}
		f.request = req
	case 1:
		d := &dataMsg{channel: channel(r.IntN(4)), eof: b()}
		if n := r.IntN(3); n > 0 {
			d.chunk = make([]byte, []int{0, r.IntN(200), MaxChunk}[n])
			for i := range d.chunk {
				d.chunk[i] = byte(r.Uint32())
			}
		}
		f.data = d
	case 2:
		f.window = &windowUpdate{bytes: uint32(u64())}
	case 3:
		f.cancel = &cancelMsg{}
	case 4:
		resp := &response{}
		if b() {
			resp.err = &wireError{code: Code(i32()), message: str()}
		}
		if b() {
			resp.exec = &execResult{
				exitCode: i32(), signal: i32(), durationNanos: i64(),
				timedOut: b(), stdoutTruncated: b(), stderrTruncated: b(), pidsExhausted: b(), oomKilled: b(), diskFull: b(),
			}
		}
		if r.IntN(3) == 0 {
			resp.init = &InitResult{}
			if b() {
				c := &ContainerInitResult{MqueueFD: i32()}
				for range r.IntN(4) {
					c.CgroupFDs = append(c.CgroupFDs, i32())
				}
				resp.init.Container = c
			}
		}
		f.response = resp
	case 5:
		// No member of the oneof: only valid for the codec, not the mux.
	}
	return f
}

func TestWireMatchesGenerated(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 20000 {
		f := randFrame(r)
		pb := toPB(f)

		// Encode: the same bytes as proto.Marshal.
		got := appendFrame(nil, f)
		want, err := proto.Marshal(pb)
		if err != nil {
			t.Fatalf("#%d: proto.Marshal: %v", i, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("#%d: encoding differs for %v\nhand: %x\ngen:  %x", i, pb, got, want)
		}
		if f.checkUTF8() != nil {
			t.Fatalf("#%d: valid strings reported invalid", i)
		}

		// Decode what the generated code wrote, and the other way round.
		back, err := unmarshalFrame(want)
		if err != nil {
			t.Fatalf("#%d: unmarshalFrame: %v", i, err)
		}
		if !reflect.DeepEqual(normalize(back), normalize(fromPB(pb))) {
			t.Fatalf("#%d: hand decode of %v gives %v", i, pb, toPB(back))
		}
		pb2 := &agentpb.Frame{}
		if err := proto.Unmarshal(got, pb2); err != nil {
			t.Fatalf("#%d: proto.Unmarshal: %v", i, err)
		}
		if !proto.Equal(pb2, pb) {
			t.Fatalf("#%d: generated decode of hand bytes gives %v, want %v", i, pb2, pb)
		}
	}
}

// TestWireDecodeLikeGenerated feeds both decoders the same odd inputs:
// concatenated frames (merge and oneof replacement), unknown fields of every
// wire type, known fields with a wrong wire type, and corruptions. Either
// both reject the input, or both accept it with the same known fields.
func TestWireDecodeLikeGenerated(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	unknown := func(b []byte) []byte {
		num := protowire.Number(1 + r.IntN(8))
		if r.IntN(4) == 0 {
			num = protowire.Number(100 + r.IntN(1000))
		}
		switch r.IntN(5) {
		case 0:
			b = protowire.AppendTag(b, num, protowire.VarintType)
			return protowire.AppendVarint(b, r.Uint64()>>r.IntN(64))
		case 1:
			b = protowire.AppendTag(b, num, protowire.Fixed32Type)
			return protowire.AppendFixed32(b, r.Uint32())
		case 2:
			b = protowire.AppendTag(b, num, protowire.Fixed64Type)
			return protowire.AppendFixed64(b, r.Uint64())
		case 3:
			b = protowire.AppendTag(b, num, protowire.StartGroupType)
			b = protowire.AppendTag(b, 1, protowire.VarintType)
			b = protowire.AppendVarint(b, 7)
			return protowire.AppendTag(b, num, protowire.EndGroupType)
		}
		b = protowire.AppendTag(b, num, protowire.BytesType)
		return protowire.AppendBytes(b, []byte("xy"))
	}
	for i := range 50000 {
		var in []byte
		switch r.IntN(4) {
		case 0: // two frames back to back: the second merges into the first
			in = appendFrame(appendFrame(nil, randFrame(r)), randFrame(r))
		case 1: // unknown fields around a frame
			in = unknown(appendFrame(unknown(nil), randFrame(r)))
		case 2: // an unknown field inside a nested message
			f := randFrame(r)
			for f.request == nil || f.request.exec == nil {
				f = randFrame(r)
			}
			e := f.request.exec.appendTo(nil)
			e = unknown(e)
			in = protowire.AppendTag(nil, 2, protowire.BytesType)
			in = protowire.AppendBytes(in, protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), e))
		case 3: // a corrupted frame: a flipped, dropped or truncated byte
			in = appendFrame(nil, randFrame(r))
			if len(in) > 0 {
				switch j := r.IntN(len(in)); r.IntN(3) {
				case 0:
					in[j] ^= byte(1 << r.IntN(8))
				case 1:
					in = append(in[:j], in[j+1:]...)
				case 2:
					in = in[:j]
				}
			}
		}
		pb := &agentpb.Frame{}
		pbErr := proto.Unmarshal(in, pb)
		hand, handErr := unmarshalFrame(in)
		if (pbErr == nil) != (handErr == nil) {
			t.Fatalf("#%d: input %x: generated error %v, hand error %v", i, in, pbErr, handErr)
		}
		if pbErr != nil {
			continue
		}
		// Compare known fields only: the generated code keeps unknown ones.
		if !reflect.DeepEqual(normalize(hand), normalize(fromPB(pb))) {
			t.Fatalf("#%d: input %x: hand decode %v, generated %v", i, in, toPB(hand), pb)
		}
	}
}

func TestWireInvalidUTF8(t *testing.T) {
	f := &frame{stream: 1, request: &request{exec: &execRequest{argv: []string{"ok", "bad\xff"}}}}
	if f.checkUTF8() == nil {
		t.Fatal("checkUTF8 accepted invalid UTF-8")
	}
	// The generated code refuses to encode it, and both refuse to decode it.
	if _, err := proto.Marshal(toPB(f)); err == nil {
		t.Fatal("proto.Marshal accepted invalid UTF-8")
	}
	in := appendFrame(nil, f)
	if _, err := unmarshalFrame(in); err == nil {
		t.Fatal("unmarshalFrame accepted invalid UTF-8")
	}
	if err := proto.Unmarshal(in, &agentpb.Frame{}); err == nil {
		t.Fatal("proto.Unmarshal accepted invalid UTF-8")
	}
	// An agent error naming a non-UTF-8 path must still reach the client.
	resp := errResponse(errorf(CodeNotFound, "open /tmp/\xff: no such file"))
	if err := (&frame{stream: 1, response: resp}).checkUTF8(); err != nil {
		t.Fatalf("errResponse left invalid UTF-8: %q", resp.err.message)
	}
}

func TestCodeString(t *testing.T) {
	for c := CodeOK; c <= CodeFailedPrecondition+1; c++ {
		if got, want := c.String(), agentpb.Code(c).String(); got != want {
			t.Errorf("Code(%d).String() = %q, want %q", c, got, want)
		}
	}
}

// BenchmarkWireDataFrame compares encoding and decoding a full Data frame.
func BenchmarkWireDataFrame(b *testing.B) {
	f := &frame{stream: 7, data: &dataMsg{channel: chStdout, chunk: make([]byte, MaxChunk)}}
	buf := appendFrame(nil, f)
	b.Run("hand", func(b *testing.B) {
		var out []byte
		for b.Loop() {
			out = appendFrame(out[:0], f)
			if _, err := unmarshalFrame(buf); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("generated", func(b *testing.B) {
		pb := toPB(f)
		var out []byte
		for b.Loop() {
			out, _ = proto.MarshalOptions{}.MarshalAppend(out[:0], pb)
			if err := proto.Unmarshal(buf, &agentpb.Frame{}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func nilIfEmpty(s *[]string) {
	if len(*s) == 0 {
		*s = nil
	}
}

func initToPB(in *Init) *agentpb.Init {
	p := &agentpb.Init{Hostname: in.Hostname, Env: in.Env, Workdir: in.Workdir, User: in.User}
	if r := in.Resources; r != nil {
		p.Resources = &agentpb.Resources{MilliCpu: r.MilliCPU, MemoryBytes: r.MemoryBytes, Pids: r.Pids, DiskBytes: r.DiskBytes}
	}
	for i := range in.Layers {
		p.Layers = append(p.Layers, sourceToPB(&in.Layers[i]))
	}
	if w := in.Writable; w != nil {
		p.Writable = &agentpb.Writable{Upper: w.Upper, Work: w.Work}
		if w.Source != nil {
			p.Writable.Source = sourceToPB(w.Source)
		}
	}
	if c := in.Container; c != nil {
		p.Container = &agentpb.ContainerInit{Rootfs: c.Rootfs, UserNs: c.UserNS, Seccomp: c.Seccomp, Caps: c.Caps,
			NoLockdown: c.NoLockdown, UserTasks: c.UserTasks, UserCgroupDir: c.UserCgroupDir,
			UserMoreTasks: c.UserMoreTasks, CgroupFiles: c.CgroupFiles}
	}
	return p
}

// sourceToPB maps an empty Path to no member, as the hand codec writes it.
func sourceToPB(s *Source) *agentpb.Source {
	p := &agentpb.Source{Fstype: s.FSType}
	switch {
	case s.Path != "":
		p.Kind = &agentpb.Source_Path{Path: s.Path}
	case s.Block != nil:
		p.Kind = &agentpb.Source_Block{Block: &agentpb.BlockDevice{Serial: s.Block.Serial}}
	case s.Pmem != nil:
		p.Kind = &agentpb.Source_Pmem{Pmem: &agentpb.PmemDevice{Index: s.Pmem.Index, Dax: s.Pmem.DAX}}
	}
	return p
}

func initFromPB(p *agentpb.Init) *Init {
	in := &Init{Hostname: p.GetHostname(), Env: p.GetEnv(), Workdir: p.GetWorkdir(), User: p.GetUser()}
	if r := p.GetResources(); r != nil {
		in.Resources = &Resources{MilliCPU: r.GetMilliCpu(), MemoryBytes: r.GetMemoryBytes(), Pids: r.GetPids(), DiskBytes: r.GetDiskBytes()}
	}
	for _, l := range p.GetLayers() {
		in.Layers = append(in.Layers, *sourceFromPB(l))
	}
	if w := p.GetWritable(); w != nil {
		in.Writable = &Writable{Upper: w.GetUpper(), Work: w.GetWork()}
		if s := w.GetSource(); s != nil {
			in.Writable.Source = sourceFromPB(s)
		}
	}
	if c := p.GetContainer(); c != nil {
		in.Container = &ContainerInit{Rootfs: c.GetRootfs(), UserNS: c.GetUserNs(), Seccomp: c.GetSeccomp(), Caps: c.GetCaps(),
			NoLockdown: c.GetNoLockdown(), UserTasks: c.GetUserTasks(), UserCgroupDir: c.GetUserCgroupDir(),
			UserMoreTasks: c.GetUserMoreTasks(), CgroupFiles: c.GetCgroupFiles()}
	}
	return in
}

func sourceFromPB(p *agentpb.Source) *Source {
	s := &Source{Path: p.GetPath(), FSType: p.GetFstype()}
	if d := p.GetBlock(); d != nil {
		s.Block = &BlockDevice{Serial: d.GetSerial()}
	}
	if d := p.GetPmem(); d != nil {
		s.Pmem = &PmemDevice{Index: d.GetIndex(), DAX: d.GetDax()}
	}
	return s
}

// randInit returns an Init with random fields, nested messages present or
// not, every kind of Source.
func randInit(r *rand.Rand, u64 func() uint64, b func() bool, str func() string, strs func() []string) *Init {
	src := func() Source {
		s := Source{FSType: str()}
		switch r.IntN(4) {
		case 0:
			s.Path = str()
		case 1:
			s.Block = &BlockDevice{Serial: str()}
		case 2:
			s.Pmem = &PmemDevice{Index: uint32(u64()), DAX: b()}
		}
		return s
	}
	in := &Init{Hostname: str(), Env: strs(), Workdir: str(), User: str()}
	if b() {
		in.Resources = &Resources{MilliCPU: int64(u64()), MemoryBytes: int64(u64()), Pids: int64(u64()), DiskBytes: int64(u64())}
	}
	for range r.IntN(4) {
		in.Layers = append(in.Layers, src())
	}
	if b() {
		in.Writable = &Writable{Upper: str(), Work: str()}
		if b() {
			s := src()
			in.Writable.Source = &s
		}
	}
	if b() {
		c := &ContainerInit{Rootfs: str(), UserNS: b(), Caps: u64(), NoLockdown: b(), UserTasks: str(),
			UserCgroupDir: str(), UserMoreTasks: strs(), CgroupFiles: strs()}
		if b() {
			c.Seccomp = []byte(str())
		}
		in.Container = c
	}
	return in
}
