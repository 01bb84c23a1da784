package main

// A little JSON, enough for Connect's JSON codec on the Run call: encoding
// the request (strings, string lists and maps, and protobuf's JSON forms
// of int64 and Duration) and parsing the response messages into plain
// values. encoding/json would cost ~30 page faults of start-up (about a
// millisecond here) for what these 200 lines do.

import (
	"errors"
	"strconv"
	"time"
	"unicode/utf16"
	"unicode/utf8"
)

// appendJSONString appends s as a JSON string. Callers check that s is
// valid UTF-8 first (protobuf refuses anything else).
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c == '\n':
			b = append(b, '\\', 'n')
		case c == '\r':
			b = append(b, '\\', 'r')
		case c == '\t':
			b = append(b, '\\', 't')
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// jsonObject builds one JSON object, leaving out empty fields as protobuf's
// JSON encoding does.
type jsonObject struct{ b []byte }

func (o *jsonObject) key(k string) {
	if len(o.b) == 0 {
		o.b = append(o.b, '{')
	} else {
		o.b = append(o.b, ',')
	}
	o.b = appendJSONString(o.b, k)
	o.b = append(o.b, ':')
}

func (o *jsonObject) str(k, v string) {
	if v != "" {
		o.key(k)
		o.b = appendJSONString(o.b, v)
	}
}

func (o *jsonObject) strs(k string, vs []string) {
	if len(vs) == 0 {
		return
	}
	o.key(k)
	for i, v := range vs {
		if i == 0 {
			o.b = append(o.b, '[')
		} else {
			o.b = append(o.b, ',')
		}
		o.b = appendJSONString(o.b, v)
	}
	o.b = append(o.b, ']')
}

// int64 is a quoted decimal, as protobuf's JSON has 64-bit integers.
func (o *jsonObject) int64(k string, v int64) {
	if v != 0 {
		o.str(k, strconv.FormatInt(v, 10))
	}
}

// duration is protobuf's JSON form of a Duration: seconds with up to nine
// fractional digits and an "s".
func (o *jsonObject) duration(k string, d time.Duration) {
	if d <= 0 {
		return
	}
	s := strconv.FormatInt(int64(d/time.Second), 10)
	if ns := int64(d % time.Second); ns != 0 {
		frac := strconv.FormatInt(ns+1e9, 10)[1:] // nine digits, zero-padded
		for frac[len(frac)-1] == '0' {
			frac = frac[:len(frac)-1]
		}
		s += "." + frac
	}
	o.str(k, s+"s")
}

func (o *jsonObject) object(k string, v *jsonObject) {
	if len(v.b) > 0 {
		o.key(k)
		o.b = append(o.b, v.bytes()...)
	}
}

func (o *jsonObject) bytes() []byte {
	if len(o.b) == 0 {
		return []byte("{}")
	}
	return append(o.b, '}')
}

// parseJSON parses one JSON value into map[string]any, []any, string,
// float64, bool or nil.
func parseJSON(b []byte) (any, error) {
	p := &jsonParser{b: b}
	v, err := p.value(0)
	if err != nil {
		return nil, err
	}
	p.space()
	if p.i != len(p.b) {
		return nil, p.fail("data after the value")
	}
	return v, nil
}

type jsonParser struct {
	b []byte
	i int
}

// maxDepth bounds nesting, so a hostile answer cannot exhaust the stack.
const maxDepth = 64

func (p *jsonParser) fail(what string) error {
	return errors.New("invalid JSON at offset " + strconv.Itoa(p.i) + ": " + what)
}

func (p *jsonParser) space() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *jsonParser) value(depth int) (any, error) {
	if depth > maxDepth {
		return nil, p.fail("nested too deeply")
	}
	p.space()
	if p.i >= len(p.b) {
		return nil, p.fail("unexpected end")
	}
	switch c := p.b[p.i]; {
	case c == '{':
		p.i++
		m := map[string]any{}
		p.space()
		if p.i < len(p.b) && p.b[p.i] == '}' {
			p.i++
			return m, nil
		}
		for {
			p.space()
			if p.i >= len(p.b) || p.b[p.i] != '"' {
				return nil, p.fail("want a key")
			}
			k, err := p.string()
			if err != nil {
				return nil, err
			}
			p.space()
			if p.i >= len(p.b) || p.b[p.i] != ':' {
				return nil, p.fail("want ':'")
			}
			p.i++
			v, err := p.value(depth + 1)
			if err != nil {
				return nil, err
			}
			m[k] = v
			p.space()
			if p.i < len(p.b) && p.b[p.i] == ',' {
				p.i++
				continue
			}
			if p.i < len(p.b) && p.b[p.i] == '}' {
				p.i++
				return m, nil
			}
			return nil, p.fail("want ',' or '}'")
		}
	case c == '[':
		p.i++
		var a []any
		p.space()
		if p.i < len(p.b) && p.b[p.i] == ']' {
			p.i++
			return a, nil
		}
		for {
			v, err := p.value(depth + 1)
			if err != nil {
				return nil, err
			}
			a = append(a, v)
			p.space()
			if p.i < len(p.b) && p.b[p.i] == ',' {
				p.i++
				continue
			}
			if p.i < len(p.b) && p.b[p.i] == ']' {
				p.i++
				return a, nil
			}
			return nil, p.fail("want ',' or ']'")
		}
	case c == '"':
		return p.string()
	case c == 't' || c == 'f' || c == 'n':
		for _, w := range []struct {
			s string
			v any
		}{{"true", true}, {"false", false}, {"null", nil}} {
			if len(p.b)-p.i >= len(w.s) && string(p.b[p.i:p.i+len(w.s)]) == w.s {
				p.i += len(w.s)
				return w.v, nil
			}
		}
		return nil, p.fail("bad literal")
	default:
		start := p.i
		for p.i < len(p.b) && (p.b[p.i] == '-' || p.b[p.i] == '+' || p.b[p.i] == '.' ||
			p.b[p.i] == 'e' || p.b[p.i] == 'E' || p.b[p.i] >= '0' && p.b[p.i] <= '9') {
			p.i++
		}
		f, err := strconv.ParseFloat(string(p.b[start:p.i]), 64)
		if err != nil || start == p.i {
			return nil, p.fail("bad number")
		}
		return f, nil
	}
}

// string parses a JSON string starting at its opening quote.
func (p *jsonParser) string() (string, error) {
	p.i++ // the quote
	var out []byte
	for p.i < len(p.b) {
		c := p.b[p.i]
		switch {
		case c == '"':
			p.i++
			return string(out), nil
		case c < 0x20:
			return "", p.fail("control character in string")
		case c != '\\':
			out = append(out, c)
			p.i++
			continue
		}
		// An escape.
		if p.i+1 >= len(p.b) {
			break
		}
		e := p.b[p.i+1]
		p.i += 2
		switch e {
		case '"', '\\', '/':
			out = append(out, e)
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r, ok := p.hex4()
			if !ok {
				return "", p.fail("bad \\u escape")
			}
			if utf16.IsSurrogate(r) {
				r2 := rune(-1)
				if p.i+1 < len(p.b) && p.b[p.i] == '\\' && p.b[p.i+1] == 'u' {
					p.i += 2
					if r2, ok = p.hex4(); !ok {
						return "", p.fail("bad \\u escape")
					}
				}
				r = utf16.DecodeRune(r, r2)
			}
			out = utf8.AppendRune(out, r)
		default:
			return "", p.fail("bad escape")
		}
	}
	return "", p.fail("unterminated string")
}

func (p *jsonParser) hex4() (rune, bool) {
	if len(p.b)-p.i < 4 {
		return 0, false
	}
	n, err := strconv.ParseUint(string(p.b[p.i:p.i+4]), 16, 32)
	if err != nil {
		return 0, false
	}
	p.i += 4
	return rune(n), true
}
