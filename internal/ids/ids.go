// Package ids makes and parses DSec's identifiers. A sandbox ID names the
// node that owns it ("<node>-<16 hex>"), so any server replica routes a
// request to the right edge without a lookup table.
package ids

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
)

// validNode: 1-32 of [a-z0-9-], starting with a letter or digit. Written
// out rather than as a regexp: package-level regexps with counted
// repetition cost every CLI invocation a millisecond of init here, and
// NodeOf runs on every routed request.
func validNode(id string) bool {
	if len(id) == 0 || len(id) > 32 || id[0] == '-' {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// ValidNode reports whether id can name a node.
func ValidNode(id string) error {
	if !validNode(id) {
		return fmt.Errorf("node id %q must be 1-32 characters of [a-z0-9-], starting with a letter or digit", id)
	}
	return nil
}

// NewSandbox returns a fresh sandbox ID on node.
func NewSandbox(node string) string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return node + "-" + hex.EncodeToString(b[:])
}

// NodeOf returns the node that owns sandbox id.
func NodeOf(id string) (string, error) {
	const suffix = 17 // "-" and 16 hex digits
	if len(id) <= suffix || id[len(id)-suffix] != '-' || !validNode(id[:len(id)-suffix]) {
		return "", fmt.Errorf("sandbox id %q is malformed (want <node>-<16 hex digits>)", id)
	}
	for i := len(id) - 16; i < len(id); i++ {
		if c := id[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return "", fmt.Errorf("sandbox id %q is malformed (want <node>-<16 hex digits>)", id)
		}
	}
	return id[:len(id)-suffix], nil
}
