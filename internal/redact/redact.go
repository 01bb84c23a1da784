// Package redact keeps host paths out of what DSec's services tell their
// callers. Errors from the file system, mkfs.erofs or the blob store name
// the daemon's data directory, spool files and layer mounts (with PIDs and
// random names in them): a tenant learns the host's layout from them and
// nothing it can act on. A Redactor replaces every path under the roots it
// was given with a placeholder, at the service boundary; the daemon's own
// log keeps the full error.
package redact

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"sort"
	"strings"

	"connectrpc.com/connect"
)

// Placeholder stands for a host path in a redacted message.
const Placeholder = "<server path>"

// Redactor replaces paths under its roots.
type Redactor struct {
	roots []string
	log   *slog.Logger
}

// New returns a Redactor for roots (empty ones, relative ones and "/" are
// ignored). log, if not nil, receives the full error of each call whose
// error was redacted, at debug level.
func New(log *slog.Logger, roots ...string) *Redactor {
	r := &Redactor{log: log}
	seen := map[string]bool{}
	for _, root := range roots {
		if root == "" || !filepath.IsAbs(root) {
			continue
		}
		root = filepath.Clean(root)
		if root == "/" || seen[root] {
			continue
		}
		seen[root] = true
		r.roots = append(r.roots, root)
		// The same directory as the kernel resolves it (/tmp may be a
		// symlink, a data dir given through one).
		if real, err := filepath.EvalSymlinks(root); err == nil && real != root && !seen[real] {
			seen[real] = true
			r.roots = append(r.roots, real)
		}
	}
	// Longest first, so a root inside another is matched whole.
	sort.Slice(r.roots, func(i, j int) bool { return len(r.roots[i]) > len(r.roots[j]) })
	return r
}

// pathEnd reports whether b ends a path token in a message.
func pathEnd(b byte) bool {
	switch b {
	case ' ', '\t', '\n', ':', '"', '\'', ',', ';', ')', ']', '}', '`':
		return true
	}
	return false
}

// String returns s with every path under a root replaced by Placeholder.
func (r *Redactor) String(s string) string {
	if r == nil || len(r.roots) == 0 {
		return s
	}
	for _, root := range r.roots {
		if !strings.Contains(s, root) {
			continue
		}
		var b strings.Builder
		rest := s
		for {
			i := strings.Index(rest, root)
			if i < 0 {
				b.WriteString(rest)
				break
			}
			end := i + len(root)
			// Only the root itself or a path below it: /data is not a
			// root of /database.
			if end < len(rest) && rest[end] != '/' && !pathEnd(rest[end]) {
				b.WriteString(rest[:end])
				rest = rest[end:]
				continue
			}
			for end < len(rest) && !pathEnd(rest[end]) {
				end++
			}
			b.WriteString(rest[:i])
			b.WriteString(Placeholder)
			rest = rest[end:]
		}
		s = b.String()
	}
	return s
}

// Error returns err with its message redacted, keeping its Connect code
// and metadata; nil stays nil.
func (r *Redactor) Error(err error) error {
	if err == nil || r == nil || len(r.roots) == 0 {
		return err
	}
	msg := err.Error()
	var ce *connect.Error
	if errors.As(err, &ce) {
		msg = ce.Message()
	}
	red := r.String(msg)
	if red == msg {
		return err
	}
	if r.log != nil {
		r.log.Debug("host paths redacted from an error to a caller", "err", err)
	}
	code := connect.CodeOf(err)
	out := connect.NewError(code, errors.New(red))
	if ce != nil {
		for k, v := range ce.Meta() {
			out.Meta()[k] = v
		}
	}
	return out
}

// Interceptor redacts the errors handlers return.
func (r *Redactor) Interceptor() connect.Interceptor { return interceptor{r} }

type interceptor struct{ r *Redactor }

func (i interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, i.r.Error(err)
	}
}

func (i interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return i.r.Error(next(ctx, conn))
	}
}
