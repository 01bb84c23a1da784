package main

// The Run call on the wire: Connect's streaming protocol with the JSON
// codec (https://connectrpc.com/docs/protocol), over HTTP/1.1 on a socket
// made with syscalls. Packages net and net/http would each cost
// milliseconds of page faults at start-up here, more than the call.
//
// Request: POST <endpoint>/dsec.v1.SandboxService/Run with Content-Type
// application/connect+json and one enveloped message (a flags byte, a
// big-endian uint32 length, the JSON). Response: 200 and a body of
// enveloped messages (flags 0) ending with an end-of-stream envelope
// (flags 2) whose JSON carries the error, if any.

import (
	"errors"
	"io"
	"strconv"
	"strings"
	"syscall"
)

// runProcedure is the Run RPC's path.
const runProcedure = "/dsec.v1.SandboxService/Run"

// target is where to send the call: a socket address and the URL's path
// prefix and Host header.
type target struct {
	sa     syscall.Sockaddr
	family int
	host   string
	path   string
	// loopback: a proxy from the environment never applies.
	loopback bool
}

// parseEndpoint accepts http:// endpoints whose host is an IP address.
// Anything else (https, a name to resolve, user info, a query) is not
// fast: dsec-cli handles it.
func parseEndpoint(endpoint string) (target, bool) {
	rest, ok := strings.CutPrefix(endpoint, "http://")
	if !ok {
		return target{}, false
	}
	hostport, path, _ := strings.Cut(rest, "/")
	if path != "" {
		path = "/" + path
	}
	if strings.ContainsAny(rest, "@?#%") || hostport == "" {
		return target{}, false
	}
	host, port := hostport, "80"
	if strings.HasPrefix(hostport, "[") {
		end := strings.IndexByte(hostport, ']')
		if end < 0 {
			return target{}, false
		}
		host = hostport[1:end]
		if r := hostport[end+1:]; r != "" {
			if r[0] != ':' {
				return target{}, false
			}
			port = r[1:]
		}
	} else if h, p, ok := strings.Cut(hostport, ":"); ok {
		host, port = h, p
	}
	pn, err := strconv.ParseUint(port, 10, 16)
	if err != nil || port == "" {
		return target{}, false
	}
	t := target{host: hostport, path: path}
	if ip4, ok := parseIPv4(host); ok {
		t.sa, t.family, t.loopback = &syscall.SockaddrInet4{Port: int(pn), Addr: ip4}, syscall.AF_INET, ip4[0] == 127
		return t, true
	}
	if ip6, ok := parseIPv6(host); ok {
		var lo [16]byte
		lo[15] = 1
		t.sa, t.family, t.loopback = &syscall.SockaddrInet6{Port: int(pn), Addr: ip6}, syscall.AF_INET6, ip6 == lo
		return t, true
	}
	return target{}, false
}

func parseIPv4(s string) ([4]byte, bool) {
	var ip [4]byte
	parts := strings.Split(s, ".")
	if len(parts) != 4 {
		return ip, false
	}
	for i, p := range parts {
		if p == "" || len(p) > 1 && p[0] == '0' {
			return ip, false
		}
		n, err := strconv.ParseUint(p, 10, 8)
		if err != nil {
			return ip, false
		}
		ip[i] = byte(n)
	}
	return ip, true
}

// parseIPv6 reads the common forms (with ::, no zone, no embedded IPv4).
func parseIPv6(s string) ([16]byte, bool) {
	var ip [16]byte
	if s == "" || strings.ContainsAny(s, "%.") {
		return ip, false
	}
	head, tail, double := strings.Cut(s, "::")
	groups := func(x string) ([]uint16, bool) {
		if x == "" {
			return nil, true
		}
		var g []uint16
		for _, p := range strings.Split(x, ":") {
			n, err := strconv.ParseUint(p, 16, 16)
			if err != nil || len(p) > 4 {
				return nil, false
			}
			g = append(g, uint16(n))
		}
		return g, true
	}
	h, ok1 := groups(head)
	t, ok2 := groups(tail)
	if !ok1 || !ok2 || len(h)+len(t) > 8 || !double && len(h) != 8 || double && len(h)+len(t) == 8 {
		return ip, false
	}
	for i, g := range h {
		ip[2*i], ip[2*i+1] = byte(g>>8), byte(g)
	}
	for i, g := range t {
		j := 16 - 2*(len(t)-i)
		ip[j], ip[j+1] = byte(g>>8), byte(g)
	}
	return ip, true
}

// dial connects to t. An error here means nothing was sent.
func dial(t target) (int, error) {
	fd, err := syscall.Socket(t.family, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	for {
		err = syscall.Connect(fd, t.sa)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		syscall.Close(fd)
		return -1, err
	}
	// The request goes out in one write; no need to wait for more.
	syscall.SetsockoptInt(fd, syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1)
	return fd, nil
}

// request is the HTTP/1.1 request carrying one enveloped message.
func request(t target, token string, msg []byte) []byte {
	var b []byte
	b = append(b, "POST "+t.path+runProcedure+" HTTP/1.1\r\nHost: "+t.host+
		"\r\nUser-Agent: dsec\r\nContent-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n"...)
	if token != "" {
		b = append(b, "Authorization: Bearer "+token+"\r\n"...)
	}
	b = append(b, "Content-Length: "+strconv.Itoa(5+len(msg))+"\r\nConnection: close\r\n\r\n"...)
	n := len(msg)
	b = append(b, 0, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	return append(b, msg...)
}

// writeAll writes b to fd.
func writeAll(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := syscall.Write(fd, b)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// fdReader reads a socket with a buffer.
type fdReader struct {
	fd   int
	buf  []byte
	r, w int
}

func (f *fdReader) fill() error {
	if f.r == f.w {
		f.r, f.w = 0, 0
	}
	if f.w == len(f.buf) {
		if f.r > 0 {
			copy(f.buf, f.buf[f.r:f.w])
			f.w -= f.r
			f.r = 0
		} else {
			f.buf = append(f.buf, make([]byte, len(f.buf))...)
		}
	}
	for {
		n, err := syscall.Read(f.fd, f.buf[f.w:])
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.EOF
		}
		f.w += n
		return nil
	}
}

// line reads up to CRLF (for the status line, headers and chunk sizes).
func (f *fdReader) line() (string, error) {
	for {
		if i := strings.Index(string(f.buf[f.r:f.w]), "\n"); i >= 0 {
			s := string(f.buf[f.r : f.r+i])
			f.r += i + 1
			return strings.TrimSuffix(s, "\r"), nil
		}
		if f.w-f.r > 64<<10 {
			return "", errors.New("HTTP line too long")
		}
		if err := f.fill(); err != nil {
			return "", err
		}
	}
}

func (f *fdReader) Read(p []byte) (int, error) {
	if f.r == f.w {
		if err := f.fill(); err != nil {
			return 0, err
		}
	}
	n := copy(p, f.buf[f.r:f.w])
	f.r += n
	return n, nil
}

// response is the head of the HTTP response and its body.
type response struct {
	status      int
	statusText  string
	contentType string
	body        io.Reader
}

func readResponse(f *fdReader) (*response, error) {
	status, err := f.line()
	if err != nil {
		return nil, err
	}
	proto, rest, _ := strings.Cut(status, " ")
	code, text, _ := strings.Cut(rest, " ")
	n, err := strconv.Atoi(code)
	if !strings.HasPrefix(proto, "HTTP/1.") || err != nil {
		return nil, errors.New("malformed HTTP response")
	}
	r := &response{status: n, statusText: code + " " + text}
	chunked, length := false, int64(-1)
	for {
		h, err := f.line()
		if err != nil {
			return nil, err
		}
		if h == "" {
			break
		}
		k, v, _ := strings.Cut(h, ":")
		v = strings.TrimSpace(v)
		switch strings.ToLower(k) {
		case "content-type":
			r.contentType = v
		case "transfer-encoding":
			chunked = strings.EqualFold(v, "chunked")
		case "content-length":
			if length, err = strconv.ParseInt(v, 10, 64); err != nil {
				return nil, errors.New("malformed Content-Length")
			}
		}
	}
	switch {
	case chunked:
		r.body = &chunkedReader{f: f}
	case length >= 0:
		r.body = io.LimitReader(f, length)
	default:
		r.body = f
	}
	return r, nil
}

// chunkedReader undoes HTTP/1.1 chunked transfer coding.
type chunkedReader struct {
	f    *fdReader
	left int64
	done bool
}

func (c *chunkedReader) Read(p []byte) (int, error) {
	for c.left == 0 {
		if c.done {
			return 0, io.EOF
		}
		s, err := c.f.line()
		if err != nil {
			return 0, err
		}
		if s == "" {
			continue // the CRLF after a chunk's data
		}
		s, _, _ = strings.Cut(s, ";")
		n, err := strconv.ParseInt(strings.TrimSpace(s), 16, 64)
		if err != nil || n < 0 {
			return 0, errors.New("malformed chunk size")
		}
		if n == 0 {
			c.done = true
			return 0, io.EOF
		}
		c.left = n
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.f.Read(p)
	c.left -= int64(n)
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}

// envelope reads one enveloped message: its flags and data. io.EOF means
// the body ended cleanly between messages.
func envelope(body io.Reader) (byte, []byte, error) {
	var head [5]byte
	if _, err := io.ReadFull(body, head[:]); err != nil {
		return 0, nil, err
	}
	n := int(head[1])<<24 | int(head[2])<<16 | int(head[3])<<8 | int(head[4])
	if n < 0 || n > 64<<20 {
		return 0, nil, errors.New("enveloped message too large")
	}
	data := make([]byte, n)
	if _, err := io.ReadFull(body, data); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return head[0], data, nil
}
