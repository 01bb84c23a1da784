package limits

import (
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"net/http"

	"connectrpc.com/connect"
)

// Body bounds every request body h reads to n bytes on the wire (see
// http.MaxBytesReader: reading past it fails, and Connect answers
// ResourceExhausted). Only for services whose requests are single
// messages: a client stream (image import) is bounded per message instead.
func Body(h http.Handler, n int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, n)
		h.ServeHTTP(w, r)
	})
}

// HandlerOptions are the options every DSec Connect handler takes: each
// message at most maxMessage bytes, compressed or not (gzip inflation
// stops there, see Gzip), and answers under 4 KiB sent uncompressed even
// to clients that accept gzip (most answers are a few hundred bytes, and
// gzipping them cost ~1.5 % of the service's CPU in the SDK benchmark for
// nothing on a local network).
func HandlerOptions(maxMessage int64) connect.HandlerOption {
	return connect.WithHandlerOptions(
		connect.WithReadMaxBytes(int(maxMessage)),
		// Replace the built-in gzip, not add a second one.
		connect.WithCompression("gzip", nil, nil),
		Gzip(maxMessage),
		connect.WithCompressMinBytes(4096),
	)
}

// Gzip is gzip whose decompressor fails once it has inflated more than
// max+1 bytes. Connect's own stops filling the message at its read limit
// but then inflates the rest of the body to report its size: a 64 MiB
// body of zeros is 64 GiB of inflation, CPU an authenticated caller could
// burn at will.
func Gzip(max int64) connect.HandlerOption {
	return connect.WithCompression("gzip",
		func() connect.Decompressor { return &boundedGzip{max: max + 1} },
		func() connect.Compressor { return gzip.NewWriter(io.Discard) },
	)
}

// ErrInflate is what a bounded decompressor returns past its bound.
var ErrInflate = errors.New("gzip message inflates past the request bound")

type boundedGzip struct {
	gz       gzip.Reader
	n, max   int64
	resetErr error
}

func (b *boundedGzip) Read(p []byte) (int, error) {
	if b.resetErr != nil {
		return 0, b.resetErr
	}
	if b.n >= b.max {
		return 0, fmt.Errorf("%w (%d bytes)", ErrInflate, b.max-1)
	}
	if room := b.max - b.n; int64(len(p)) > room {
		p = p[:room]
	}
	n, err := b.gz.Read(p)
	b.n += int64(n)
	return n, err
}

func (b *boundedGzip) Reset(r io.Reader) error {
	b.n = 0
	b.resetErr = b.gz.Reset(r)
	return b.resetErr
}

func (b *boundedGzip) Close() error { return b.gz.Close() }
