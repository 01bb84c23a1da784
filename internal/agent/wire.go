package agent

// A hand-written codec for the messages of agentpb/agent.proto.
//
// dsec-agent starts once per sandbox, so its start-up time and idle memory
// are paid on every create. The protobuf-go runtime (descriptors, reflection,
// registries, even google.golang.org/protobuf/encoding/protowire, which pulls
// in an init that hashes the executable) costs milliseconds of package init
// and over half a megabyte per process, for a dozen flat messages. So this
// package encodes and decodes them itself, with the rules of the protobuf
// binary format for proto3:
//
//   - scalar fields are omitted when zero; repeated strings write every
//     element; message fields and oneof members are written when set, even
//     if empty; fields are written in field-number order, a oneof's member
//     after the message's other fields, as protobuf-go does, so the bytes
//     equal those of proto.Marshal;
//   - decoding merges: a repeated message field merges into the earlier one,
//     a later oneof member replaces an earlier one, unknown fields (and known
//     fields with an unexpected wire type) are skipped, strings must be
//     valid UTF-8.
//
// The generated package agentpb stays the definition of the wire format; the
// tests check that this codec and the generated code agree both ways.
//
// Adding a request: its message in agent.proto (a new member of Request's
// oneof, and of Response if it returns more than an error), then
// ./scripts/proto.sh; here a struct, a pointer in request (and response), a
// case in request.size, request.appendTo, request.unmarshal and
// frame.checkUTF8; a case in server.handle and a Client method; toPB, fromPB
// and randFrame in wire_test.go, which then check the codec against the
// generated code. Init (init.go) shows a request with nested messages.

import (
	"errors"
	"math/bits"
	"strconv"
	"unicode/utf8"
)

// Code classifies an agent error on the wire (enum Code in agent.proto).
type Code int32

// The values of Code.
const (
	CodeOK               Code = 0
	CodeUnknown          Code = 1
	CodeInvalidArgument  Code = 2
	CodeNotFound         Code = 3
	CodePermissionDenied Code = 4
	CodeAlreadyExists    Code = 5
	CodeTooLarge         Code = 6
	CodeCanceled         Code = 7
	CodeUnavailable      Code = 8
	// CodeFailedPrecondition: the sandbox's own state refuses the
	// operation (a file that is not a regular file, an I/O error of its
	// file system, a full disk).
	CodeFailedPrecondition Code = 9
)

var codeNames = [...]string{"CODE_OK", "CODE_UNKNOWN", "CODE_INVALID_ARGUMENT", "CODE_NOT_FOUND",
	"CODE_PERMISSION_DENIED", "CODE_ALREADY_EXISTS", "CODE_TOO_LARGE", "CODE_CANCELED", "CODE_UNAVAILABLE",
	"CODE_FAILED_PRECONDITION"}

// String returns the name agent.proto gives the code (the number for an
// unknown one, as protobuf-go does).
func (c Code) String() string {
	if c >= 0 && int(c) < len(codeNames) {
		return codeNames[c]
	}
	return strconv.Itoa(int(c))
}

// channel names the byte stream a Data frame belongs to (enum Channel).
type channel int32

const (
	chBody   channel = 0 // stdin, file contents, tar streams
	chStdout channel = 1
	chStderr channel = 2
)

// frame is one protocol frame (message Frame). At most one of the message
// pointers (the oneof msg) is set; a decoded frame with none set is invalid.
type frame struct {
	stream   uint64
	request  *request
	data     *dataMsg
	window   *windowUpdate
	cancel   *cancelMsg
	response *response
}

// request opens a stream (message Request); at most one op is set.
type request struct {
	exec       *execRequest
	writeFile  *writeFileRequest
	readFile   *readFileRequest
	putArchive *putArchiveRequest
	getArchive *getArchiveRequest
	ping       *pingRequest
	init       *Init
	egress     *egressAcceptRequest
	diff       *diffRequest
}

type dataMsg struct {
	channel channel
	chunk   []byte
	eof     bool
}

type windowUpdate struct{ bytes uint32 }

type cancelMsg struct{}

type response struct {
	err  *wireError
	exec *execResult
	init *InitResult
}

// wireError is message Error.
type wireError struct {
	code    Code
	message string
}

type execRequest struct {
	argv           []string
	shell          string
	env            []string
	cwd            string
	user           string
	timeoutNanos   int64
	maxOutputBytes int64
	streamOutput   bool
	hasStdin       bool
}

type execResult struct {
	exitCode        int32
	signal          int32
	durationNanos   int64
	timedOut        bool
	stdoutTruncated bool
	stderrTruncated bool
	pidsExhausted   bool
	oomKilled       bool
	diskFull        bool
}

type writeFileRequest struct {
	path string
	mode uint32
}

type readFileRequest struct {
	path     string
	maxBytes int64
}

type putArchiveRequest struct{ dir string }

type getArchiveRequest struct{ dir string }

type pingRequest struct{}

type egressAcceptRequest struct{ listen string }
type diffRequest struct{}

// Protobuf wire types.
const (
	wtVarint     = 0
	wtFixed64    = 1
	wtBytes      = 2
	wtStartGroup = 3
	wtEndGroup   = 4
	wtFixed32    = 5
)

// ---- encoding ----

func appendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func sizeVarint(v uint64) int { return (bits.Len64(v|1) + 6) / 7 }

func appendTag(b []byte, num, wt int) []byte { return appendVarint(b, uint64(num)<<3|uint64(wt)) }

// sizeTag is the size of a tag; every field number here is below 16.
const sizeTag = 1

// appendUint writes a non-zero varint field (uint32, uint64, int64, bool and,
// sign-extended, int32 and enums).
func appendUint(b []byte, num int, v uint64) []byte {
	if v == 0 {
		return b
	}
	return appendVarint(appendTag(b, num, wtVarint), v)
}

func sizeUint(v uint64) int {
	if v == 0 {
		return 0
	}
	return sizeTag + sizeVarint(v)
}

func b2u(v bool) uint64 {
	if v {
		return 1
	}
	return 0
}

// appendString writes a string (or bytes) field; omitted when empty unless
// always (a repeated field's element).
func appendString(b []byte, num int, s string, always bool) []byte {
	if s == "" && !always {
		return b
	}
	b = appendVarint(appendTag(b, num, wtBytes), uint64(len(s)))
	return append(b, s...)
}

func sizeString(s string, always bool) int {
	if s == "" && !always {
		return 0
	}
	return sizeTag + sizeVarint(uint64(len(s))) + len(s)
}

func sizeStrings(ss []string) int {
	n := 0
	for _, s := range ss {
		n += sizeString(s, true)
	}
	return n
}

func appendStrings(b []byte, num int, ss []string) []byte {
	for _, s := range ss {
		b = appendString(b, num, s, true)
	}
	return b
}

// appendMsgHeader writes the tag and length of a message field whose body
// (size bytes) the caller appends next.
func appendMsgHeader(b []byte, num, size int) []byte {
	return appendVarint(appendTag(b, num, wtBytes), uint64(size))
}

func sizeMsg(size int) int { return sizeTag + sizeVarint(uint64(size)) + size }

// appendFrame appends the encoding of f to b (without the length prefix of
// the framing).
func appendFrame(b []byte, f *frame) []byte {
	b = appendUint(b, 1, f.stream)
	switch {
	case f.request != nil && f.request.init != nil:
		// Init's nested messages are encoded to learn their size: once.
		sub := f.request.init.appendTo(nil)
		b = appendMsgHeader(b, 2, sizeMsg(len(sub)))
		b = appendSub(b, 7, sub)
	case f.request != nil:
		b = appendMsgHeader(b, 2, f.request.size())
		b = f.request.appendTo(b)
	case f.data != nil:
		b = appendMsgHeader(b, 3, f.data.size())
		b = f.data.appendTo(b)
	case f.window != nil:
		b = appendMsgHeader(b, 4, sizeUint(uint64(f.window.bytes)))
		b = appendUint(b, 1, uint64(f.window.bytes))
	case f.cancel != nil:
		b = appendMsgHeader(b, 5, 0)
	case f.response != nil:
		b = appendMsgHeader(b, 6, f.response.size())
		b = f.response.appendTo(b)
	}
	return b
}

func (r *request) size() int {
	switch {
	case r.exec != nil:
		return sizeMsg(r.exec.size())
	case r.writeFile != nil:
		return sizeMsg(sizeString(r.writeFile.path, false) + sizeUint(uint64(r.writeFile.mode)))
	case r.readFile != nil:
		return sizeMsg(sizeString(r.readFile.path, false) + sizeUint(uint64(r.readFile.maxBytes)))
	case r.putArchive != nil:
		return sizeMsg(sizeString(r.putArchive.dir, false))
	case r.getArchive != nil:
		return sizeMsg(sizeString(r.getArchive.dir, false))
	case r.ping != nil, r.diff != nil:
		return sizeMsg(0)
	case r.init != nil:
		return sizeMsg(len(r.init.appendTo(nil)))
	case r.egress != nil:
		return sizeMsg(sizeString(r.egress.listen, false))
	}
	return 0
}

func (r *request) appendTo(b []byte) []byte {
	switch {
	case r.exec != nil:
		b = appendMsgHeader(b, 1, r.exec.size())
		b = r.exec.appendTo(b)
	case r.writeFile != nil:
		w := r.writeFile
		b = appendMsgHeader(b, 2, sizeString(w.path, false)+sizeUint(uint64(w.mode)))
		b = appendString(b, 1, w.path, false)
		b = appendUint(b, 2, uint64(w.mode))
	case r.readFile != nil:
		rf := r.readFile
		b = appendMsgHeader(b, 3, sizeString(rf.path, false)+sizeUint(uint64(rf.maxBytes)))
		b = appendString(b, 1, rf.path, false)
		b = appendUint(b, 2, uint64(rf.maxBytes))
	case r.putArchive != nil:
		b = appendMsgHeader(b, 4, sizeString(r.putArchive.dir, false))
		b = appendString(b, 1, r.putArchive.dir, false)
	case r.getArchive != nil:
		b = appendMsgHeader(b, 5, sizeString(r.getArchive.dir, false))
		b = appendString(b, 1, r.getArchive.dir, false)
	case r.ping != nil:
		b = appendMsgHeader(b, 6, 0)
	case r.diff != nil:
		b = appendMsgHeader(b, 8, 0)
	case r.init != nil:
		b = appendSub(b, 7, r.init.appendTo(nil))
	case r.egress != nil:
		b = appendMsgHeader(b, 15, sizeString(r.egress.listen, false))
		b = appendString(b, 1, r.egress.listen, false)
	}
	return b
}

func (e *execRequest) size() int {
	return sizeStrings(e.argv) + sizeString(e.shell, false) + sizeStrings(e.env) +
		sizeString(e.cwd, false) + sizeString(e.user, false) +
		sizeUint(uint64(e.timeoutNanos)) + sizeUint(uint64(e.maxOutputBytes)) +
		sizeUint(b2u(e.streamOutput)) + sizeUint(b2u(e.hasStdin))
}

func (e *execRequest) appendTo(b []byte) []byte {
	b = appendStrings(b, 1, e.argv)
	b = appendString(b, 2, e.shell, false)
	b = appendStrings(b, 3, e.env)
	b = appendString(b, 4, e.cwd, false)
	b = appendString(b, 5, e.user, false)
	b = appendUint(b, 6, uint64(e.timeoutNanos))
	b = appendUint(b, 7, uint64(e.maxOutputBytes))
	b = appendUint(b, 8, b2u(e.streamOutput))
	return appendUint(b, 9, b2u(e.hasStdin))
}

func (d *dataMsg) size() int {
	n := sizeUint(uint64(int64(d.channel))) + sizeUint(b2u(d.eof))
	if len(d.chunk) > 0 {
		n += sizeTag + sizeVarint(uint64(len(d.chunk))) + len(d.chunk)
	}
	return n
}

func (d *dataMsg) appendTo(b []byte) []byte {
	b = appendUint(b, 1, uint64(int64(d.channel)))
	if len(d.chunk) > 0 {
		b = appendVarint(appendTag(b, 2, wtBytes), uint64(len(d.chunk)))
		b = append(b, d.chunk...)
	}
	return appendUint(b, 3, b2u(d.eof))
}

func (r *response) size() int {
	n := 0
	if r.err != nil {
		n += sizeMsg(r.err.size())
	}
	if r.exec != nil {
		n += sizeMsg(r.exec.size())
	}
	if r.init != nil {
		n += sizeMsg(len(r.init.appendTo(nil)))
	}
	return n
}

func (r *response) appendTo(b []byte) []byte {
	if r.err != nil {
		b = appendMsgHeader(b, 1, r.err.size())
		b = appendUint(b, 1, uint64(int64(r.err.code)))
		b = appendString(b, 2, r.err.message, false)
	}
	if r.exec != nil {
		b = appendMsgHeader(b, 2, r.exec.size())
		b = r.exec.appendTo(b)
	}
	if r.init != nil {
		b = appendSub(b, 3, r.init.appendTo(nil))
	}
	return b
}

func (e *wireError) size() int {
	return sizeUint(uint64(int64(e.code))) + sizeString(e.message, false)
}

func (e *execResult) size() int {
	return sizeUint(uint64(int64(e.exitCode))) + sizeUint(uint64(int64(e.signal))) +
		sizeUint(uint64(e.durationNanos)) + sizeUint(b2u(e.timedOut)) +
		sizeUint(b2u(e.stdoutTruncated)) + sizeUint(b2u(e.stderrTruncated)) + sizeUint(b2u(e.pidsExhausted)) +
		sizeUint(b2u(e.oomKilled)) + sizeUint(b2u(e.diskFull))
}

func (e *execResult) appendTo(b []byte) []byte {
	b = appendUint(b, 1, uint64(int64(e.exitCode)))
	b = appendUint(b, 2, uint64(int64(e.signal)))
	b = appendUint(b, 3, uint64(e.durationNanos))
	b = appendUint(b, 4, b2u(e.timedOut))
	b = appendUint(b, 5, b2u(e.stdoutTruncated))
	b = appendUint(b, 6, b2u(e.stderrTruncated))
	b = appendUint(b, 7, b2u(e.pidsExhausted))
	b = appendUint(b, 8, b2u(e.oomKilled))
	return appendUint(b, 9, b2u(e.diskFull))
}

// errInvalidUTF8 matches what protobuf-go reports for such strings.
var errInvalidUTF8 = errors.New("string field contains invalid UTF-8")

// checkUTF8 reports whether every string in f is valid UTF-8, as proto3
// requires: a peer's decoder would reject the frame otherwise.
func (f *frame) checkUTF8() error {
	ok := true
	check := func(ss ...string) {
		for _, s := range ss {
			ok = ok && utf8.ValidString(s)
		}
	}
	if r := f.request; r != nil {
		switch {
		case r.exec != nil:
			check(r.exec.argv...)
			check(r.exec.env...)
			check(r.exec.shell, r.exec.cwd, r.exec.user)
		case r.writeFile != nil:
			check(r.writeFile.path)
		case r.readFile != nil:
			check(r.readFile.path)
		case r.putArchive != nil:
			check(r.putArchive.dir)
		case r.getArchive != nil:
			check(r.getArchive.dir)
		case r.init != nil:
			ok = validUTF8(r.init.strings())
		case r.egress != nil:
			check(r.egress.listen)
		}
	}
	if r := f.response; r != nil && r.err != nil {
		check(r.err.message)
	}
	if !ok {
		return errInvalidUTF8
	}
	return nil
}

// ---- decoding ----

var (
	errTruncated   = errors.New("truncated field")
	errOverflow    = errors.New("variable length integer overflow")
	errFieldNumber = errors.New("invalid field number")
	errWireType    = errors.New("invalid wire type")
	errGroup       = errors.New("mismatching end group marker")
)

// consumeVarint decodes a varint at the start of b and returns it and its
// length, or a negative length for truncated (-1) or overlong (-2) input.
func consumeVarint(b []byte) (uint64, int) {
	var v uint64
	for i := 0; i < 10; i++ {
		if i >= len(b) {
			return 0, -1
		}
		c := b[i]
		if i == 9 && c > 1 {
			return 0, -2
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return v, i + 1
		}
	}
	return 0, -2
}

func varintErr(n int) error {
	if n == -1 {
		return errTruncated
	}
	return errOverflow
}

// field is one decoded field: the value of a varint field in u, that of a
// length-delimited field in b (aliasing the input).
type field struct {
	num int
	wt  int
	u   uint64
	b   []byte
}

// maxDepth bounds the nesting of unknown groups that are skipped.
const maxDepth = 100

// eachField calls fn for every varint and length-delimited field of the
// encoded message b, in order, and skips fields of the other wire types
// (none is used by agent.proto, so they are unknown).
func eachField(b []byte, fn func(f *field) error) error {
	for len(b) > 0 {
		var f field
		n, err := consumeField(b, &f, 0)
		if err != nil {
			return err
		}
		b = b[n:]
		if f.wt == wtVarint || f.wt == wtBytes {
			if err := fn(&f); err != nil {
				return err
			}
		}
	}
	return nil
}

// consumeField decodes one field (tag and value) at the start of b into f and
// returns its length. Groups are skipped whole.
func consumeField(b []byte, f *field, depth int) (int, error) {
	tag, n := consumeVarint(b)
	if n < 0 {
		return 0, varintErr(n)
	}
	if tag>>3 < 1 || tag>>3 > 1<<29-1 {
		return 0, errFieldNumber
	}
	f.num, f.wt = int(tag>>3), int(tag&7)
	rest := b[n:]
	switch f.wt {
	case wtVarint:
		v, m := consumeVarint(rest)
		if m < 0 {
			return 0, varintErr(m)
		}
		f.u = v
		return n + m, nil
	case wtFixed32:
		if len(rest) < 4 {
			return 0, errTruncated
		}
		return n + 4, nil
	case wtFixed64:
		if len(rest) < 8 {
			return 0, errTruncated
		}
		return n + 8, nil
	case wtBytes:
		l, m := consumeVarint(rest)
		if m < 0 {
			return 0, varintErr(m)
		}
		if l > uint64(len(rest)-m) {
			return 0, errTruncated
		}
		f.b = rest[m : m+int(l)]
		return n + m + int(l), nil
	case wtStartGroup:
		if depth >= maxDepth {
			return 0, errors.New("groups nested too deep")
		}
		for {
			var g field
			m, err := consumeField(rest, &g, depth+1)
			if err != nil {
				return 0, err
			}
			n += m
			rest = rest[m:]
			if g.wt == wtEndGroup {
				if g.num != f.num {
					return 0, errGroup
				}
				return n, nil
			}
		}
	case wtEndGroup:
		if depth == 0 {
			return 0, errGroup
		}
		return n, nil
	}
	return 0, errWireType
}

// str decodes a string field, which proto3 requires to be valid UTF-8.
func str(b []byte) (string, error) {
	if !utf8.Valid(b) {
		return "", errInvalidUTF8
	}
	return string(b), nil
}

// unmarshalFrame decodes b into a new frame. Bytes fields are copied, so b
// may be reused.
func unmarshalFrame(b []byte) (*frame, error) {
	f := &frame{}
	// A oneof member replaces any other; the same member twice merges.
	reset := func() { *f = frame{stream: f.stream} }
	err := eachField(b, func(fd *field) error {
		if fd.num == 1 {
			if fd.wt == wtVarint {
				f.stream = fd.u
			}
			return nil
		}
		if fd.wt != wtBytes || fd.num > 6 {
			return nil
		}
		switch fd.num {
		case 2:
			if f.request == nil {
				reset()
				f.request = &request{}
			}
			return f.request.unmarshal(fd.b)
		case 3:
			if f.data == nil {
				reset()
				f.data = &dataMsg{}
			}
			return f.data.unmarshal(fd.b)
		case 4:
			if f.window == nil {
				reset()
				f.window = &windowUpdate{}
			}
			return eachField(fd.b, func(fd *field) error {
				if fd.num == 1 && fd.wt == wtVarint {
					f.window.bytes = uint32(fd.u)
				}
				return nil
			})
		case 5:
			if f.cancel == nil {
				reset()
				f.cancel = &cancelMsg{}
			}
			return eachField(fd.b, func(*field) error { return nil })
		case 6:
			if f.response == nil {
				reset()
				f.response = &response{}
			}
			return f.response.unmarshal(fd.b)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return f, nil
}

func (r *request) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		if fd.wt != wtBytes || fd.num < 1 || fd.num > 8 && fd.num != 15 {
			return nil
		}
		// Keep the member if it is the one being merged into.
		keep := *r
		*r = request{}
		switch fd.num {
		case 1:
			if r.exec = keep.exec; r.exec == nil {
				r.exec = &execRequest{}
			}
			return r.exec.unmarshal(fd.b)
		case 2:
			if r.writeFile = keep.writeFile; r.writeFile == nil {
				r.writeFile = &writeFileRequest{}
			}
			w := r.writeFile
			return eachField(fd.b, func(fd *field) error {
				var err error
				switch {
				case fd.num == 1 && fd.wt == wtBytes:
					w.path, err = str(fd.b)
				case fd.num == 2 && fd.wt == wtVarint:
					w.mode = uint32(fd.u)
				}
				return err
			})
		case 3:
			if r.readFile = keep.readFile; r.readFile == nil {
				r.readFile = &readFileRequest{}
			}
			rf := r.readFile
			return eachField(fd.b, func(fd *field) error {
				var err error
				switch {
				case fd.num == 1 && fd.wt == wtBytes:
					rf.path, err = str(fd.b)
				case fd.num == 2 && fd.wt == wtVarint:
					rf.maxBytes = int64(fd.u)
				}
				return err
			})
		case 4:
			if r.putArchive = keep.putArchive; r.putArchive == nil {
				r.putArchive = &putArchiveRequest{}
			}
			return unmarshalDir(fd.b, &r.putArchive.dir)
		case 5:
			if r.getArchive = keep.getArchive; r.getArchive == nil {
				r.getArchive = &getArchiveRequest{}
			}
			return unmarshalDir(fd.b, &r.getArchive.dir)
		case 6:
			if r.ping = keep.ping; r.ping == nil {
				r.ping = &pingRequest{}
			}
			return eachField(fd.b, func(*field) error { return nil })
		case 7:
			if r.init = keep.init; r.init == nil {
				r.init = &Init{}
			}
			return r.init.unmarshal(fd.b)
		case 15:
			if r.egress = keep.egress; r.egress == nil {
				r.egress = &egressAcceptRequest{}
			}
			return unmarshalDir(fd.b, &r.egress.listen)
		case 8:
			if r.diff = keep.diff; r.diff == nil {
				r.diff = &diffRequest{}
			}
			return eachField(fd.b, func(*field) error { return nil })
		}
		return nil
	})
}

// unmarshalDir decodes a message whose only field is string dir = 1.
func unmarshalDir(b []byte, dir *string) error {
	return eachField(b, func(fd *field) error {
		var err error
		if fd.num == 1 && fd.wt == wtBytes {
			*dir, err = str(fd.b)
		}
		return err
	})
}

func (e *execRequest) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		var err error
		var s string
		if fd.wt == wtBytes {
			switch fd.num {
			case 1, 2, 3, 4, 5:
				if s, err = str(fd.b); err != nil {
					return err
				}
			}
			switch fd.num {
			case 1:
				e.argv = append(e.argv, s)
			case 2:
				e.shell = s
			case 3:
				e.env = append(e.env, s)
			case 4:
				e.cwd = s
			case 5:
				e.user = s
			}
			return nil
		}
		switch fd.num {
		case 6:
			e.timeoutNanos = int64(fd.u)
		case 7:
			e.maxOutputBytes = int64(fd.u)
		case 8:
			e.streamOutput = fd.u != 0
		case 9:
			e.hasStdin = fd.u != 0
		}
		return nil
	})
}

func (d *dataMsg) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		switch {
		case fd.num == 1 && fd.wt == wtVarint:
			d.channel = channel(int32(fd.u))
		case fd.num == 2 && fd.wt == wtBytes:
			d.chunk = append([]byte(nil), fd.b...)
		case fd.num == 3 && fd.wt == wtVarint:
			d.eof = fd.u != 0
		}
		return nil
	})
}

func (r *response) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		if fd.wt != wtBytes {
			return nil
		}
		switch fd.num {
		case 1:
			if r.err == nil {
				r.err = &wireError{}
			}
			e := r.err
			return eachField(fd.b, func(fd *field) error {
				var err error
				switch {
				case fd.num == 1 && fd.wt == wtVarint:
					e.code = Code(int32(fd.u))
				case fd.num == 2 && fd.wt == wtBytes:
					e.message, err = str(fd.b)
				}
				return err
			})
		case 2:
			if r.exec == nil {
				r.exec = &execResult{}
			}
			return r.exec.unmarshal(fd.b)
		case 3:
			if r.init == nil {
				r.init = &InitResult{}
			}
			return r.init.unmarshal(fd.b)
		}
		return nil
	})
}

func (e *execResult) unmarshal(b []byte) error {
	return eachField(b, func(fd *field) error {
		if fd.wt != wtVarint {
			return nil
		}
		switch fd.num {
		case 1:
			e.exitCode = int32(fd.u)
		case 2:
			e.signal = int32(fd.u)
		case 3:
			e.durationNanos = int64(fd.u)
		case 4:
			e.timedOut = fd.u != 0
		case 5:
			e.stdoutTruncated = fd.u != 0
		case 6:
			e.stderrTruncated = fd.u != 0
		case 7:
			e.pidsExhausted = fd.u != 0
		case 8:
			e.oomKilled = fd.u != 0
		case 9:
			e.diskFull = fd.u != 0
		}
		return nil
	})
}
