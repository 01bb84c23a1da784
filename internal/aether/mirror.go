package aether

import (
	"bytes"
	"context"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// MirrorHost is the reserved name sandboxes reach the node's package
// mirror at, through their proxy (plain HTTP: the proxy answers it itself,
// without dialing anything).
const MirrorHost = "mirror.dsec.internal"

// The mirror's bounds and defaults.
const (
	// DefaultIndexTTL is how long an index page (pypi's simple page, npm's
	// package document, apt's dists files) is served from memory before
	// it is fetched again: indexes change, artifacts do not.
	DefaultIndexTTL = 60 * time.Second
	// DefaultIndexCacheBytes bounds the memory all cached index pages
	// hold together.
	DefaultIndexCacheBytes = 64 << 20
	// maxIndexBytes bounds one index page the mirror reads whole (to
	// rewrite it or cache it): larger pypi and npm pages are refused,
	// larger apt index files are streamed through uncached.
	maxIndexBytes = 16 << 20
	// holdBack is what the first requester of an artifact does not get
	// until the whole artifact has been checked against its hash: a body
	// that fails the check ends short, so the client sees an error and
	// never a complete, wrong file.
	holdBack = 64 << 10
	// maxPageFetches bounds the index pages fetched at once, each read
	// whole (up to maxIndexBytes): what index fetches hold in memory
	// together, whatever the number of sandboxes asking.
	maxPageFetches = 8
	// fetchTimeout bounds one upstream download of an artifact, which
	// goes on when its first requester leaves (others wait for it).
	fetchTimeout = 30 * time.Minute
)

// MirrorConfig is what a Mirror needs.
type MirrorConfig struct {
	// Store keeps the artifacts (blobs) and URL → digest refs under
	// "mirror/".
	Store blobstore.Repository
	// Resolver names the upstreams (the operator's hosts file, then DNS),
	// the same one the proxy uses, so --hosts points the mirror at test
	// or node-local upstreams too.
	Resolver *Resolver
	// Upstream base URLs, without a trailing slash; defaults the public
	// ones: PyPI https://pypi.org, PyPIFiles https://files.pythonhosted.org,
	// NPM https://registry.npmjs.org, Debian https://deb.debian.org/debian.
	PyPI, PyPIFiles, NPM, Debian string
	// RootCAs verifies upstream certificates; nil for the system's.
	RootCAs *x509.CertPool
	// IndexTTL and IndexCacheBytes: DefaultIndexTTL, DefaultIndexCacheBytes.
	IndexTTL        time.Duration
	IndexCacheBytes int64
}

// MirrorStats are the mirror's counters since it started.
type MirrorStats struct {
	// Hits are requests served from the blob store or the index cache
	// (including requests that waited for another's fetch); Misses are
	// requests that fetched upstream.
	Hits, Misses int64
	// BytesServed went to sandboxes, BytesUpstream came from upstreams.
	BytesServed, BytesUpstream int64
}

// Mirror is the node's caching package mirror for pypi, npm and Debian's
// apt archive: an http.Handler serving /pypi/, /npm/ and /debian/. It
// fetches upstream over HTTPS, once per artifact however many sandboxes
// ask at the same moment, and keeps artifacts (wheels, sdists, tarballs,
// .debs) content-addressed in the blob store, checked against the hash
// the index gave for them; index pages are rewritten so that their links
// lead back to the mirror, and kept in memory briefly.
type Mirror struct {
	cfg    MirrorConfig
	client *http.Client
	pypiRe *regexp.Regexp

	mu      sync.Mutex
	flights map[string]*flight
	pages   map[string]*page
	pageMem int64
	pageFl  map[string]*pageFlight
	pageSem chan struct{}

	hits, misses, served, upstream atomic.Int64
}

// flight is one artifact download in progress; done closes when it ended,
// with err or the blob's digest.
type flight struct {
	done chan struct{}
	// waiters is how many requests wait for it (under Mirror.mu).
	waiters int
	digest  string
	err     error
}

// page is one cached index page.
type page struct {
	body    []byte
	ctype   string
	expires time.Time
}

type pageFlight struct {
	done chan struct{}
	p    *page
	err  error
}

// NewMirror returns a mirror over cfg.Store.
func NewMirror(cfg MirrorConfig) *Mirror {
	if cfg.Resolver == nil {
		cfg.Resolver = NewResolver(nil)
	}
	def := func(s *string, d string) {
		if *s == "" {
			*s = d
		}
		*s = strings.TrimSuffix(*s, "/")
	}
	def(&cfg.PyPI, "https://pypi.org")
	def(&cfg.PyPIFiles, "https://files.pythonhosted.org")
	def(&cfg.NPM, "https://registry.npmjs.org")
	def(&cfg.Debian, "https://deb.debian.org/debian")
	if cfg.IndexTTL <= 0 {
		cfg.IndexTTL = DefaultIndexTTL
	}
	if cfg.IndexCacheBytes <= 0 {
		cfg.IndexCacheBytes = DefaultIndexCacheBytes
	}
	res := cfg.Resolver
	dialer := &net.Dialer{Timeout: defaultDial}
	tr := &http.Transport{
		// Upstream names go through the edge's resolver, so --hosts
		// applies to the mirror as to the proxy.
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			host, port, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			addrs, _, err := res.Resolve(ctx, host)
			if err != nil {
				return nil, err
			}
			var last error = fmt.Errorf("%s has no address", host)
			for _, a := range addrs {
				c, err := dialer.DialContext(ctx, network, net.JoinHostPort(a.String(), port))
				if err == nil {
					return c, nil
				}
				last = err
			}
			return nil, last
		},
		TLSClientConfig:       &tls.Config{RootCAs: cfg.RootCAs},
		ForceAttemptHTTP2:     true,
		MaxIdleConnsPerHost:   16,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: 60 * time.Second,
		// What is stored is what upstream sent, not a decompressed copy.
		DisableCompression: true,
	}
	return &Mirror{
		cfg:     cfg,
		client:  &http.Client{Transport: tr},
		pypiRe:  regexp.MustCompile(`(href=["'])` + regexp.QuoteMeta(cfg.PyPIFiles) + `/([^"'#]*)(#sha256=([0-9a-fA-F]{64}))?`),
		flights: map[string]*flight{},
		pages:   map[string]*page{},
		pageFl:  map[string]*pageFlight{},
		pageSem: make(chan struct{}, maxPageFetches),
	}
}

// Stats returns the mirror's counters.
func (m *Mirror) Stats() MirrorStats {
	return MirrorStats{Hits: m.hits.Load(), Misses: m.misses.Load(),
		BytesServed: m.served.Load(), BytesUpstream: m.upstream.Load()}
}

// MirrorEcosystem says which named rule a mirror path belongs to ("pypi",
// "npm", "debian"), or "" for a path the mirror does not serve. The proxy
// serves a path only to a sandbox whose policy allows its ecosystem.
func MirrorEcosystem(path string) string {
	for _, e := range []string{"pypi", "npm", "debian"} {
		if strings.HasPrefix(path, "/"+e+"/") {
			return e
		}
	}
	return ""
}

// ServeHTTP serves GET and HEAD under /pypi/, /npm/ and /debian/.
func (m *Mirror) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		http.Error(w, "dsec mirror: only GET and HEAD", http.StatusMethodNotAllowed)
		return
	}
	p := r.URL.Path
	if strings.Contains(p, "/../") || strings.HasSuffix(p, "/..") {
		http.Error(w, "dsec mirror: path with ..", http.StatusBadRequest)
		return
	}
	switch {
	case strings.HasPrefix(p, "/pypi/simple/"):
		m.servePage(w, r, m.cfg.PyPI+strings.TrimPrefix(p, "/pypi"), "text/html", m.rewritePyPI)
	case strings.HasPrefix(p, "/pypi/files/sha256/"):
		rest := strings.TrimPrefix(p, "/pypi/files/sha256/")
		hx, path, _ := strings.Cut(rest, "/")
		var want *check
		if !strings.HasSuffix(path, ".metadata") {
			// pip appends ".metadata" to a file's link for its PEP 658
			// metadata, whose hash the index gives it apart: the file's
			// hash does not apply.
			var err error
			if want, err = newCheck("sha256", hx); err != nil {
				http.Error(w, "dsec mirror: "+err.Error(), http.StatusBadRequest)
				return
			}
		}
		m.serveArtifact(w, r, m.cfg.PyPIFiles+"/"+path, want)
	case strings.HasPrefix(p, "/pypi/files/"):
		m.serveArtifact(w, r, m.cfg.PyPIFiles+strings.TrimPrefix(p, "/pypi/files"), nil)
	case strings.HasPrefix(p, "/npm/~tarball/"):
		// /npm/~tarball/ALGO/HEX/NAME/-/FILE.tgz ("~" is in no package name).
		parts := strings.SplitN(strings.TrimPrefix(p, "/npm/~tarball/"), "/", 3)
		if len(parts) != 3 {
			http.Error(w, "dsec mirror: want /npm/~tarball/ALGO/HEX/PATH", http.StatusBadRequest)
			return
		}
		want, err := newCheck(parts[0], parts[1])
		if err != nil {
			http.Error(w, "dsec mirror: "+err.Error(), http.StatusBadRequest)
			return
		}
		m.serveArtifact(w, r, m.cfg.NPM+"/"+parts[2], want)
	case strings.HasPrefix(p, "/npm/") && strings.Contains(p, "/-/"):
		m.serveArtifact(w, r, m.cfg.NPM+strings.TrimPrefix(p, "/npm"), nil)
	case strings.HasPrefix(p, "/npm/") && len(p) > len("/npm/"):
		// npm asks for the abbreviated document when it can: pass its
		// Accept on, and keep the two apart in the cache.
		accept := r.Header.Get("Accept")
		if !strings.Contains(accept, "application/vnd.npm.install-v1+json") {
			accept = "application/json"
		} else {
			accept = "application/vnd.npm.install-v1+json; q=1.0, application/json; q=0.8"
		}
		m.servePage(w, r, m.cfg.NPM+strings.TrimPrefix(r.URL.EscapedPath(), "/npm"), accept, m.rewriteNPM)
	case strings.HasPrefix(p, "/debian/pool/"):
		m.serveArtifact(w, r, m.cfg.Debian+strings.TrimPrefix(p, "/debian"), nil)
	case strings.HasPrefix(p, "/debian/dists/") && strings.Contains(p, "/by-hash/SHA256/"):
		// apt fetches indexes by their hash when the Release file offers
		// it: immutable, and checked like an artifact.
		want, err := newCheck("sha256", p[strings.LastIndexByte(p, '/')+1:])
		if err != nil {
			http.Error(w, "dsec mirror: "+err.Error(), http.StatusBadRequest)
			return
		}
		m.serveArtifact(w, r, m.cfg.Debian+strings.TrimPrefix(p, "/debian"), want)
	case strings.HasPrefix(p, "/debian/dists/"):
		m.servePage(w, r, m.cfg.Debian+strings.TrimPrefix(p, "/debian"), "", nil)
	default:
		http.Error(w, "dsec mirror: no such path (serves /pypi/simple/, /npm/, /debian/dists/ and /debian/pool/)", http.StatusNotFound)
	}
}

// check is a hash an artifact must have, as its index gave it.
type check struct {
	algo string
	sum  []byte
}

func newCheck(algo, hx string) (*check, error) {
	sum, err := hex.DecodeString(hx)
	size := map[string]int{"sha256": 32, "sha512": 64, "sha1": 20}[algo]
	if size == 0 {
		return nil, fmt.Errorf("hash algorithm %q (want sha256, sha512 or sha1)", algo)
	}
	if err != nil || len(sum) != size {
		return nil, fmt.Errorf("%s hash %q is not %d hex bytes", algo, hx, size)
	}
	return &check{algo: algo, sum: sum}, nil
}

func (c *check) hash() hash.Hash {
	switch c.algo {
	case "sha512":
		return sha512.New()
	case "sha1":
		return sha1.New()
	}
	return sha256.New()
}

func (c *check) String() string { return c.algo + ":" + hex.EncodeToString(c.sum) }

// refName is where the digest of what url (checked by want) served is
// kept: the key's sha256, since URLs hold characters refs do not.
func refName(url string, want *check) string {
	key := url
	if want != nil {
		key += "#" + want.String()
	}
	s := sha256.Sum256([]byte(key))
	return "mirror/" + hex.EncodeToString(s[:])
}

// serveArtifact serves an immutable file: from the blob store when it is
// there, else fetched upstream once (the first requester gets it as it
// arrives, others wait for it to be stored).
func (m *Mirror) serveArtifact(w http.ResponseWriter, r *http.Request, url string, want *check) {
	ctx := r.Context()
	ref := refName(url, want)
	if d, err := m.cfg.Store.Refs().Get(ctx, ref); err == nil && m.serveBlob(w, r, d, ref) {
		return
	}
	m.mu.Lock()
	if f, ok := m.flights[ref]; ok {
		f.waiters++
		m.mu.Unlock()
		select {
		case <-f.done:
		case <-ctx.Done():
			return
		}
		if f.err != nil {
			http.Error(w, "dsec mirror: "+f.err.Error(), http.StatusBadGateway)
			return
		}
		if !m.serveBlob(w, r, f.digest, ref) {
			http.Error(w, "dsec mirror: "+url+" was fetched but its blob is gone", http.StatusBadGateway)
		}
		return
	}
	f := &flight{done: make(chan struct{})}
	m.flights[ref] = f
	m.mu.Unlock()
	// finish records the outcome, keeps the ref and releases the waiters:
	// before the first requester's last bytes go out (so that whatever it
	// does next finds the ref, not the flight), and in any case, a panic
	// that aborts the response included.
	var once sync.Once
	finish := func(digest string, err error) {
		once.Do(func() {
			if err == nil && digest == "" {
				err = fmt.Errorf("%s: the mirror's copy could not be served", url)
			}
			if err == nil {
				if serr := m.cfg.Store.Refs().Set(context.WithoutCancel(ctx), ref, digest); serr != nil {
					err = fmt.Errorf("keep %s: %w", url, serr)
				}
			}
			f.digest, f.err = digest, err
			m.mu.Lock()
			delete(m.flights, ref)
			m.mu.Unlock()
			close(f.done)
		})
	}
	defer finish("", nil)
	if d, err := m.cfg.Store.Refs().Get(ctx, ref); err == nil {
		// Another flight stored it between the first look and this one.
		finish(d, nil)
		if m.serveBlob(w, r, d, ref) {
			return
		}
	}
	m.misses.Add(1)
	if aborted := m.fetch(w, r, url, want, finish); aborted {
		// The head went out: end the body short, so the client sees an
		// error rather than a complete, wrong file.
		panic(http.ErrAbortHandler)
	}
}

// serveBlob answers with a stored blob; false if it cannot be opened. A
// blob found corrupt loses ref, so the next request fetches it again.
func (m *Mirror) serveBlob(w http.ResponseWriter, r *http.Request, digest, ref string) bool {
	ctx := r.Context()
	desc, err := m.cfg.Store.Stat(ctx, digest)
	if err != nil {
		return false
	}
	rc, err := m.cfg.Store.Open(ctx, digest)
	if err != nil {
		return false
	}
	defer rc.Close()
	// Counted before the response goes out: a client that has its
	// answer finds the counters up to date.
	m.hits.Add(1)
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(desc.Size, 10))
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return true
	}
	// The store checks the digest at EOF: the last chunk read goes out
	// only once the next read said EOF, so a corrupt copy ends short.
	a, b := make([]byte, 32<<10), make([]byte, 32<<10)
	var held []byte
	for {
		n, err := rc.Read(a)
		if n > 0 {
			if held != nil {
				if m.write(w, held) != nil {
					return true
				}
			}
			// held is the chunk just read; the next read goes into
			// the other buffer.
			held = a[:n]
			a, b = b, a
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			if errors.Is(err, blobstore.ErrDigestMismatch) {
				// Drop the ref and the blob (Put keeps a blob already
				// there): the next request fetches a good copy.
				m.cfg.Store.Refs().Delete(context.WithoutCancel(ctx), ref)
				m.cfg.Store.Delete(context.WithoutCancel(ctx), digest)
			}
			// End the response with an error rather than cleanly.
			panic(http.ErrAbortHandler)
		}
	}
	m.write(w, held)
	return true
}

// write sends p to a client, counted as served before it goes (a client
// that has its answer finds the counters up to date).
func (m *Mirror) write(w io.Writer, p []byte) error {
	m.served.Add(int64(len(p)))
	n, err := w.Write(p)
	if n < len(p) {
		m.served.Add(int64(n - len(p)))
	}
	return err
}

// fetch downloads url into the blob store, streaming it to w as it
// arrives, all but the last holdBack bytes until it matched want. It goes
// on when the client leaves (others may be waiting for it). It calls
// finish with the blob's digest, or why nothing was stored, before the
// last bytes go out; w's response must be aborted if it returns true.
func (m *Mirror) fetch(w http.ResponseWriter, r *http.Request, url string, want *check, finish func(string, error)) (aborted bool) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), fetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		finish("", err)
		http.Error(w, "dsec mirror: "+err.Error(), http.StatusBadRequest)
		return false
	}
	resp, err := m.client.Do(req)
	if err != nil {
		err = fmt.Errorf("fetch %s: %w", url, err)
		finish("", err)
		http.Error(w, "dsec mirror: "+err.Error(), http.StatusBadGateway)
		return false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("fetch %s: upstream answered %s", url, resp.Status)
		status := http.StatusBadGateway
		if resp.StatusCode == http.StatusNotFound {
			status = http.StatusNotFound
		}
		finish("", err)
		http.Error(w, "dsec mirror: "+err.Error(), status)
		return false
	}

	// Upstream → (hash, blob store, client). The store gets it through a
	// pipe so that the body is never held whole.
	pr, pw := io.Pipe()
	type put struct {
		d   blobstore.Descriptor
		err error
	}
	stored := make(chan put, 1)
	go func() {
		d, err := m.cfg.Store.Put(ctx, pr)
		pr.CloseWithError(err) // unblock the writer if Put stopped early
		stored <- put{d, err}
	}()
	var h hash.Hash
	if want != nil {
		h = want.hash()
	}
	if resp.ContentLength >= 0 {
		w.Header().Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.WriteHeader(http.StatusOK)
	client := r.Method != http.MethodHead // false once the client is gone
	var held []byte                       // the last bytes, not yet sent
	buf := make([]byte, 32<<10)
	var total int64
	var rerr error
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			total += int64(n)
			m.upstream.Add(int64(n))
			if h != nil {
				h.Write(buf[:n])
			}
			if _, werr := pw.Write(buf[:n]); werr != nil {
				rerr = fmt.Errorf("store %s: %w", url, werr)
				break
			}
			held = append(held, buf[:n]...)
			if len(held) > holdBack {
				send := held[:len(held)-holdBack]
				if client && m.write(w, send) != nil {
					client = false
				}
				held = append(held[:0], held[len(send):]...)
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			rerr = fmt.Errorf("fetch %s: %w", url, err)
			break
		}
	}
	if rerr == nil && resp.ContentLength >= 0 && total != resp.ContentLength {
		rerr = fmt.Errorf("fetch %s: %d bytes of %d", url, total, resp.ContentLength)
	}
	if rerr == nil && h != nil && !bytes.Equal(h.Sum(nil), want.sum) {
		rerr = fmt.Errorf("fetch %s: upstream sent a file whose %s is %x, the index says %x: refused, not stored",
			url, want.algo, h.Sum(nil), want.sum)
	}
	if rerr != nil {
		pw.CloseWithError(rerr)
		<-stored
		finish("", rerr)
		return r.Method != http.MethodHead
	}
	pw.Close()
	p := <-stored
	if p.err != nil {
		err := fmt.Errorf("store %s: %w", url, p.err)
		finish("", err)
		return r.Method != http.MethodHead
	}
	finish(p.d.Digest, nil)
	if client {
		m.write(w, held)
	}
	return false
}

// servePage serves an index page from memory while it is fresh, else
// fetched upstream (once for concurrent requests) and rewritten by
// rewrite, if any. An apt index over maxIndexBytes is streamed through
// uncached; a pypi or npm page that large is refused.
func (m *Mirror) servePage(w http.ResponseWriter, r *http.Request, url, accept string, rewrite func([]byte) ([]byte, error)) {
	key := accept + " " + url
	m.mu.Lock()
	if p, ok := m.pages[key]; ok && time.Now().Before(p.expires) {
		m.mu.Unlock()
		m.hits.Add(1)
		m.writePage(w, r, p)
		return
	}
	fl, waiting := m.pageFl[key]
	if !waiting {
		fl = &pageFlight{done: make(chan struct{})}
		m.pageFl[key] = fl
	}
	m.mu.Unlock()
	if waiting {
		select {
		case <-fl.done:
		case <-r.Context().Done():
			return
		}
		if fl.err != nil {
			http.Error(w, "dsec mirror: "+fl.err.Error(), http.StatusBadGateway)
			return
		}
		m.hits.Add(1)
		m.writePage(w, r, fl.p)
		return
	}
	m.misses.Add(1)
	var status int
	fl.p, status, fl.err = m.fetchPage(w, r, url, accept, rewrite)
	m.mu.Lock()
	delete(m.pageFl, key)
	if fl.err == nil && fl.p != nil {
		m.keepPage(key, fl.p)
	}
	m.mu.Unlock()
	if fl.p == nil && fl.err == nil {
		fl.err = fmt.Errorf("%s was streamed through uncached (over %d bytes)", url, maxIndexBytes)
	}
	close(fl.done)
	switch {
	case status == 0:
		// streamed or already answered
	case fl.err != nil:
		http.Error(w, "dsec mirror: "+fl.err.Error(), status)
	default:
		m.writePage(w, r, fl.p)
	}
}

// fetchPage fetches one index page. It returns the page, or the status
// and error to answer with; status 0 when it answered w itself.
func (m *Mirror) fetchPage(w http.ResponseWriter, r *http.Request, url, accept string, rewrite func([]byte) ([]byte, error)) (*page, int, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 2*time.Minute)
	defer cancel()
	select {
	case m.pageSem <- struct{}{}:
		defer func() { <-m.pageSem }()
	case <-ctx.Done():
		return nil, http.StatusServiceUnavailable, fmt.Errorf("fetch %s: too many index fetches at once", url)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, http.StatusBadRequest, err
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	resp, err := m.client.Do(req)
	if err != nil {
		return nil, http.StatusBadGateway, fmt.Errorf("fetch %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		status := http.StatusBadGateway
		if resp.StatusCode == http.StatusNotFound {
			status = http.StatusNotFound
		}
		return nil, status, fmt.Errorf("fetch %s: upstream answered %s", url, resp.Status)
	}
	cr := &countReader{r: resp.Body, n: &m.upstream}
	body, err := io.ReadAll(io.LimitReader(cr, maxIndexBytes+1))
	if err != nil {
		return nil, http.StatusBadGateway, fmt.Errorf("fetch %s: %w", url, err)
	}
	if len(body) > maxIndexBytes {
		if rewrite != nil {
			return nil, http.StatusBadGateway, fmt.Errorf("index %s is over %d bytes", url, maxIndexBytes)
		}
		// Too large to keep: pass it on as it comes.
		w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
		w.WriteHeader(http.StatusOK)
		if r.Method == http.MethodHead {
			return nil, 0, nil
		}
		n1, _ := w.Write(body)
		n2, _ := io.Copy(w, cr)
		m.served.Add(int64(n1) + n2)
		return nil, 0, nil
	}
	if rewrite != nil {
		if body, err = rewrite(body); err != nil {
			return nil, http.StatusBadGateway, fmt.Errorf("index %s: %w", url, err)
		}
	}
	return &page{body: body, ctype: resp.Header.Get("Content-Type"), expires: time.Now().Add(m.cfg.IndexTTL)}, http.StatusOK, nil
}

// keepPage caches p under key within the memory bound, dropping expired
// pages, then the ones closest to expiring. The caller holds m.mu.
func (m *Mirror) keepPage(key string, p *page) {
	size := int64(len(p.body) + len(key))
	if size > m.cfg.IndexCacheBytes {
		return
	}
	if old, ok := m.pages[key]; ok {
		m.pageMem -= int64(len(old.body) + len(key))
		delete(m.pages, key)
	}
	now := time.Now()
	for k, q := range m.pages {
		if m.pageMem+size <= m.cfg.IndexCacheBytes {
			break
		}
		if now.After(q.expires) {
			m.pageMem -= int64(len(q.body) + len(k))
			delete(m.pages, k)
		}
	}
	for m.pageMem+size > m.cfg.IndexCacheBytes {
		var ok string
		var first time.Time
		for k, q := range m.pages {
			if ok == "" || q.expires.Before(first) {
				ok, first = k, q.expires
			}
		}
		m.pageMem -= int64(len(m.pages[ok].body) + len(ok))
		delete(m.pages, ok)
	}
	m.pages[key] = p
	m.pageMem += size
}

func (m *Mirror) writePage(w http.ResponseWriter, r *http.Request, p *page) {
	if p.ctype != "" {
		w.Header().Set("Content-Type", p.ctype)
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(p.body)))
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	m.write(w, p.body)
}

// mirrorBase is how rewritten links name the mirror: sandboxes reach it
// through their proxy under its reserved name.
const mirrorBase = "http://" + MirrorHost

// rewritePyPI points a simple page's file links at the mirror, carrying
// the #sha256= hash into the path so the mirror can check the file.
func (m *Mirror) rewritePyPI(body []byte) ([]byte, error) {
	return m.pypiRe.ReplaceAllFunc(body, func(s []byte) []byte {
		g := m.pypiRe.FindSubmatch(s)
		out := append([]byte(nil), g[1]...)
		if len(g[4]) > 0 {
			out = append(out, mirrorBase+"/pypi/files/sha256/"+strings.ToLower(string(g[4]))+"/"...)
		} else {
			out = append(out, mirrorBase+"/pypi/files/"...)
		}
		out = append(out, g[2]...)
		return append(out, g[3]...)
	}), nil
}

// rewriteNPM points every version's dist.tarball at the mirror, carrying
// dist.integrity (sha512, else shasum's sha1) into the path.
func (m *Mirror) rewriteNPM(body []byte) ([]byte, error) {
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(body, &doc); err != nil {
		return nil, fmt.Errorf("package document is not a JSON object: %w", err)
	}
	var versions map[string]map[string]json.RawMessage
	if raw, ok := doc["versions"]; ok {
		if err := json.Unmarshal(raw, &versions); err != nil {
			return nil, fmt.Errorf("package document's versions: %w", err)
		}
	}
	for v, ver := range versions {
		var dist map[string]any
		if raw, ok := ver["dist"]; !ok || json.Unmarshal(raw, &dist) != nil {
			continue
		}
		tarball, _ := dist["tarball"].(string)
		path, ok := strings.CutPrefix(tarball, m.cfg.NPM+"/")
		if !ok {
			continue
		}
		var algo, hx string
		if integ, _ := dist["integrity"].(string); strings.HasPrefix(integ, "sha512-") {
			if sum, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(strings.Fields(integ)[0], "sha512-")); err == nil && len(sum) == 64 {
				algo, hx = "sha512", hex.EncodeToString(sum)
			}
		}
		if algo == "" {
			if s, _ := dist["shasum"].(string); len(s) == 40 {
				algo, hx = "sha1", strings.ToLower(s)
			}
		}
		if algo != "" {
			dist["tarball"] = mirrorBase + "/npm/~tarball/" + algo + "/" + hx + "/" + path
		} else {
			dist["tarball"] = mirrorBase + "/npm/" + path
		}
		raw, err := json.Marshal(dist)
		if err != nil {
			return nil, err
		}
		ver["dist"] = raw
		versions[v] = ver
	}
	if versions != nil {
		raw, err := json.Marshal(versions)
		if err != nil {
			return nil, err
		}
		doc["versions"] = raw
	}
	return json.Marshal(doc)
}

type countReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}
