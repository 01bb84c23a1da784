package aether

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// Reaching the mirror: a sandbox's tools ask their proxy for
// http://mirror.dsec.internal/pypi/... (PIP_INDEX_URL, npm's registry:
// MirrorEnv), and apt, whose sources name http://deb.debian.org/debian
// and which honours http_proxy, asks for that. The proxy answers those
// requests from the node's mirror itself, with nothing dialed and no TLS
// intercepted (the mirror fetches upstream over HTTPS), if the sandbox's
// policy allows the ecosystem, and records the decision like any other.

// serveMirror answers req from the mirror if it is for the mirror, and
// says whether it did (or refused it).
func (sb *Sandbox) serveMirror(ctx context.Context, c Conn, req *http.Request, q Request, ev *Event, deny func(int, string)) bool {
	m := sb.p.cfg.Mirror
	host := strings.TrimSuffix(strings.ToLower(q.Host), ".")
	path := req.URL.Path
	switch {
	case host == MirrorHost:
		eco := MirrorEcosystem(path)
		if eco == "" {
			deny(http.StatusNotFound, "mirror: no such path "+path+" (serves /pypi/, /npm/, /debian/)")
			return true
		}
		// The ecosystem's own rule decides, deny rules included: the
		// mirror serves what a direct download of its first host would
		// be allowed.
		d := sb.Policy().Decide(Request{Host: Ecosystems[eco].Hosts[0], Port: 443, Method: q.Method})
		if !d.Allowed {
			deny(http.StatusForbidden, "mirror /"+eco+"/: "+d.Rule)
			return true
		}
		ev.Rule = d.Rule + " (mirror)"
		// What a policy change re-decides while the response goes out.
		q = Request{Host: Ecosystems[eco].Hosts[0], Port: 443, Method: q.Method}
	case host == "deb.debian.org" && q.Port == 80 && strings.HasPrefix(path, "/debian/") &&
		(req.Method == http.MethodGet || req.Method == http.MethodHead):
		d := sb.Policy().Decide(q)
		if !d.Allowed {
			return false // decided, and refused, as before
		}
		ev.Rule = d.Rule + " (mirror)"
	default:
		return false
	}
	t := &tunnel{q: q, client: c}
	if !sb.add(t) {
		deny(http.StatusServiceUnavailable, "sandbox closed")
		return true
	}
	defer sb.remove(t)
	ev.Allowed = true
	ev.Addr = "mirror"
	req.Host = MirrorHost
	rw := &connWriter{c: c, h: http.Header{}}
	func() {
		defer func() {
			if v := recover(); v != nil {
				if v != http.ErrAbortHandler {
					panic(v)
				}
				ev.Ended = "mirror: the response was cut short (see the node's log)"
				rw.aborted = true
			}
		}()
		m.ServeHTTP(rw, req.WithContext(ctx))
	}()
	if !rw.wrote {
		rw.WriteHeader(http.StatusOK)
	}
	ev.BytesIn = rw.n
	sb.mu.Lock()
	if t.ended != "" {
		ev.Ended = t.ended
	}
	sb.mu.Unlock()
	if rw.status >= 400 && ev.Ended == "" {
		ev.Ended = "mirror answered " + strconv.Itoa(rw.status)
	}
	if !rw.aborted {
		c.CloseWrite()
	}
	sb.record(*ev)
	return true
}

// connWriter is an http.ResponseWriter onto a proxied connection: one
// response, then the connection ends (the proxy serves one request per
// connection), so a body without a length is delimited by the close.
type connWriter struct {
	c       Conn
	h       http.Header
	wrote   bool
	aborted bool
	status  int
	n       int64
	err     error
}

func (w *connWriter) Header() http.Header { return w.h }

func (w *connWriter) WriteHeader(status int) {
	if w.wrote {
		return
	}
	w.wrote, w.status = true, status
	w.h.Set("Connection", "close")
	head := fmt.Sprintf("HTTP/1.1 %d %s\r\n", status, http.StatusText(status))
	var b strings.Builder
	b.WriteString(head)
	w.h.Write(&b)
	b.WriteString("\r\n")
	_, w.err = io.WriteString(w.c, b.String())
}

func (w *connWriter) Write(p []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	n, err := w.c.Write(p)
	w.n += int64(n)
	w.err = err
	return n, err
}

// MirrorEnv is what every exec of a sandbox under p gets, besides
// ProxyEnv, to use the node's mirror for the ecosystems p allows: pip's
// and uv's index, npm's registry. apt needs nothing: it honours
// http_proxy, and a Debian image's sources name http://deb.debian.org,
// whose /debian/ the proxy answers from the mirror.
func MirrorEnv(p Policy) []string {
	allows := func(eco string) bool {
		return p.Decide(Request{Host: Ecosystems[eco].Hosts[0], Port: 443, Method: http.MethodGet}).Allowed
	}
	var env []string
	if allows("pypi") {
		idx := mirrorBase + "/pypi/simple/"
		env = append(env, "PIP_INDEX_URL="+idx, "PIP_TRUSTED_HOST="+MirrorHost,
			"UV_DEFAULT_INDEX="+idx, "UV_INSECURE_HOST="+MirrorHost)
	}
	if allows("npm") {
		env = append(env, "npm_config_registry="+mirrorBase+"/npm/")
	}
	return env
}
