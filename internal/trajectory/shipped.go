package trajectory

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// A shipped trajectory blob may be a pack: the trajectories of several
// sandboxes of one tenant, one after the other (see ship.go). Every reader
// of a shipped blob takes the sandbox's own lines out of it with LinesOf
// (or LineSandbox, to sort a blob's lines by sandbox in one pass), never the
// blob whole: the other lines are other sandboxes' records, which the
// reader may have no right to see.

// ErrNoRecords means a shipped trajectory blob holds no record of the
// sandbox whose ref names it: the ref or the blob is damaged.
var ErrNoRecords = errors.New("holds no record of the sandbox")

// linePrefix is how every canonical line of sandbox id begins: Sandbox is
// Record's first field, encoded as Marshal encodes it.
func linePrefix(id string) []byte {
	var buf bytes.Buffer
	buf.WriteString(`{"sandbox":`)
	_ = jsonEncoder(&buf).Encode(id) // a string always encodes
	buf.Truncate(buf.Len() - 1)      // the encoder's newline
	buf.WriteByte(',')
	return buf.Bytes()
}

// LinesOf returns sandbox id's lines of a shipped trajectory blob (JSONL),
// in order and without their newlines: the lines that start as id's
// records do in canonical form. A blob holding none is an error wrapping
// ErrNoRecords, never another sandbox's records.
func LinesOf(blob []byte, id string) ([][]byte, error) {
	prefix := linePrefix(id)
	var lines [][]byte
	for len(blob) > 0 {
		line := blob
		if i := bytes.IndexByte(blob, '\n'); i >= 0 {
			line, blob = blob[:i], blob[i+1:]
		} else {
			blob = nil
		}
		if bytes.HasPrefix(line, prefix) {
			lines = append(lines, line)
		}
	}
	if len(lines) == 0 {
		return nil, fmt.Errorf("trajectory blob %w %q", ErrNoRecords, id)
	}
	return lines, nil
}

// LineSandbox returns the sandbox whose record a line of a shipped
// trajectory is, by the same rule as LinesOf; ok is false for a line that
// does not start as a canonical record.
func LineSandbox(line []byte) (id string, ok bool) {
	const start = `{"sandbox":"`
	if !bytes.HasPrefix(line, []byte(start)) {
		return "", false
	}
	// The string ends at the first quote not escaped by a backslash.
	end := -1
	for i := len(start); i < len(line); i++ {
		if line[i] == '\\' {
			i++
			continue
		}
		if line[i] == '"' {
			end = i + 1
			break
		}
	}
	if end < 0 || json.Unmarshal(line[len(start)-1:end], &id) != nil {
		return "", false
	}
	// Canonical only: a line LinesOf(blob, id) would not take is nobody's.
	if !bytes.HasPrefix(line, linePrefix(id)) {
		return "", false
	}
	return id, true
}

// ReadShipped returns sandbox id's lines of the trajectory shipped to repo
// (see Ship) and the digest of the blob they are in. A sandbox never
// shipped (or a blob gone from the store) is an error wrapping
// blobstore.ErrNotFound; a blob without its records one wrapping
// ErrNoRecords.
func ReadShipped(ctx context.Context, repo blobstore.Repository, id string) ([][]byte, string, error) {
	digest, err := repo.Refs().Get(ctx, ShipRef(id))
	if err != nil {
		return nil, "", fmt.Errorf("shipped trajectory of %s: %w", id, err)
	}
	blob, err := blobstore.ReadAll(ctx, repo, digest)
	if err != nil {
		return nil, "", fmt.Errorf("shipped trajectory of %s: %w", id, err)
	}
	lines, err := LinesOf(blob, id)
	if err != nil {
		return nil, "", fmt.Errorf("shipped trajectory of %s: blob %s: %w", id, digest, err)
	}
	return lines, digest, nil
}
