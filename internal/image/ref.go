package image

import (
	"errors"
	"fmt"
	"strings"
)

// ErrInvalidRef wraps every reference parsing error.
var ErrInvalidRef = errors.New("invalid image reference")

// DefaultTag is the tag of a reference written without one.
const DefaultTag = "latest"

// Ref is a parsed image reference, name:tag.
type Ref struct {
	Name string
	Tag  string
}

// String returns "name:tag".
func (r Ref) String() string { return r.Name + ":" + r.Tag }

const (
	maxNameLen = 255
	maxTagLen  = 128
)

// ParseRef parses "name[:tag]". The name follows OCI/Docker repository
// names: '/'-separated components of lowercase letters and digits, joined
// inside a component by one '.', one or two '_', or any number of '-'. The
// tag is [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}; it defaults to "latest".
// Registry hosts with ports and digest references are not accepted.
func ParseRef(s string) (Ref, error) {
	if s == "" {
		return Ref{}, fmt.Errorf("%w: empty", ErrInvalidRef)
	}
	name, tag := s, DefaultTag
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		if strings.Contains(s[i:], "/") {
			return Ref{}, fmt.Errorf("%w %q: ':' in the name (registry ports are not supported)", ErrInvalidRef, s)
		}
		name, tag = s[:i], s[i+1:]
	}
	if strings.ContainsRune(s, '@') {
		return Ref{}, fmt.Errorf("%w %q: digest references are not supported", ErrInvalidRef, s)
	}
	if err := validateName(name); err != nil {
		return Ref{}, fmt.Errorf("%w %q: %s", ErrInvalidRef, s, err)
	}
	if err := validateTag(tag); err != nil {
		return Ref{}, fmt.Errorf("%w %q: %s", ErrInvalidRef, s, err)
	}
	return Ref{Name: name, Tag: tag}, nil
}

func validateName(name string) error {
	if name == "" {
		return errors.New("name is empty")
	}
	if len(name) > maxNameLen {
		return fmt.Errorf("name is longer than %d characters", maxNameLen)
	}
	for comp := range strings.SplitSeq(name, "/") {
		if err := validateComponent(comp); err != nil {
			return fmt.Errorf("name component %q %s", comp, err)
		}
	}
	return nil
}

func isAlnum(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }

// validateComponent checks [a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*.
func validateComponent(c string) error {
	if c == "" {
		return errors.New("is empty")
	}
	if !isAlnum(c[0]) || !isAlnum(c[len(c)-1]) {
		return errors.New("must start and end with a lowercase letter or digit")
	}
	for i := 0; i < len(c); {
		if isAlnum(c[i]) {
			i++
			continue
		}
		j := i
		for j < len(c) && !isAlnum(c[j]) {
			j++
		}
		sep := c[i:j]
		switch {
		case sep == "." || sep == "_" || sep == "__":
		case strings.Trim(sep, "-") == "":
		default:
			if strings.ContainsFunc(sep, func(r rune) bool { return r >= 'A' && r <= 'Z' }) {
				return errors.New("must be lowercase")
			}
			return fmt.Errorf("has separator %q (want one '.', one or two '_', or '-'s)", sep)
		}
		i = j
	}
	return nil
}

func validateTag(tag string) error {
	if tag == "" {
		return errors.New("tag is empty")
	}
	if len(tag) > maxTagLen {
		return fmt.Errorf("tag is longer than %d characters", maxTagLen)
	}
	for i := 0; i < len(tag); i++ {
		c := tag[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_'
		if i > 0 {
			ok = ok || c == '.' || c == '-'
		}
		if !ok {
			return fmt.Errorf("tag %q has %q at position %d", tag, c, i)
		}
	}
	return nil
}
