// Package ids makes and parses DSec's identifiers. A sandbox ID names the
// node that owns it ("<node>-<16 hex>"), so any server replica routes a
// request to the right edge without a lookup table.
package ids

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"regexp"
)

var (
	nodePattern    = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,31}$`)
	sandboxPattern = regexp.MustCompile(`^([a-z0-9][a-z0-9-]{0,31})-([0-9a-f]{16})$`)
)

// ValidNode reports whether id can name a node.
func ValidNode(id string) error {
	if !nodePattern.MatchString(id) {
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
	m := sandboxPattern.FindStringSubmatch(id)
	if m == nil {
		return "", fmt.Errorf("sandbox id %q is malformed (want <node>-<16 hex digits>)", id)
	}
	return m[1], nil
}
