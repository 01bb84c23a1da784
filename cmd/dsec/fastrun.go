package main

import (
	"encoding/base64"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Exit codes, as dsec-cli's (cmd/dsec/cli).
const (
	exitTimeout = 124
	exitInfra   = 125
)

// fastRun serves `dsec run ARGS...` when it can. ok is false when nothing
// was sent: the caller hands the command to dsec-cli, which reports
// whatever stopped the fast path (a usage error, an unreadable token
// file, a server that cannot be reached) or does the call its own way.
func fastRun(args []string) (code int, ok bool) {
	c, ok := parseRun(args)
	if !ok {
		return 0, false
	}
	body, ok := c.runRequest()
	if !ok {
		return 0, false
	}
	endpoint, token, ok := c.credentials()
	if !ok || !headerSafe(token) || !headerSafe(endpoint) || strings.ContainsRune(endpoint, ' ') {
		// net/http refuses such a header (or URL) before sending
		// anything; dsec-cli says so.
		return 0, false
	}
	t, ok := parseEndpoint(endpoint)
	if !ok || !t.loopback && (os.Getenv("HTTP_PROXY") != "" || os.Getenv("http_proxy") != "") {
		return 0, false
	}
	fd, err := dial(t)
	if err != nil {
		return 0, false
	}
	if err := writeAll(fd, request(t, token, body)); err != nil {
		syscall.Close(fd)
		return 0, false
	}
	// The call is made: from here on, the outcome is this process's to
	// report.
	r := &runner{prefix: "run in a new sandbox from " + strconv.Quote(c.image) + ": "}
	r.interruptible()
	return r.stream(fd), true
}

// headerSafe reports whether s can go into an HTTP header as is.
func headerSafe(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}

// runner relays one Run's events to stdout and stderr.
type runner struct {
	// prefix starts every error message, as the Go SDK's Run wraps its
	// errors.
	prefix string
	// mu serialises writes and the exit of an interrupt.
	mu sync.Mutex
}

// interruptible makes SIGINT and SIGTERM end the call as they end
// dsec-cli's (its context is cancelled): the message of a cancelled call,
// exit 125. Closing the connection makes the server stop the command and
// destroy the sandbox.
func (r *runner) interruptible() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ch
		r.mu.Lock()
		os.Stderr.WriteString("dsec: " + r.prefix + "canceled: context canceled\n")
		os.Exit(exitInfra)
	}()
}

// fail reports an API error as dsec-cli does (Connect's "code: message"
// behind the SDK's prefix) and returns exit code 125.
func (r *runner) fail(code, msg string) int {
	switch {
	case code == "":
		code = msg
	case msg != "":
		code += ": " + msg
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	os.Stderr.WriteString("dsec: " + r.prefix + code + "\n")
	return exitInfra
}

// httpCode maps an HTTP status to a Connect code as connect-go's client
// does for a streaming call.
func httpCode(status int) string {
	switch status {
	case 400:
		return "internal"
	case 401:
		return "unauthenticated"
	case 403:
		return "permission_denied"
	case 404:
		return "unimplemented"
	case 429, 502, 503, 504:
		return "unavailable"
	}
	return "unknown"
}

func (r *runner) stream(fd int) int {
	defer syscall.Close(fd)
	f := &fdReader{fd: fd, buf: make([]byte, 32<<10)}
	resp, err := readResponse(f)
	if err != nil {
		return r.fail("unavailable", err.Error())
	}
	if resp.status != 200 {
		return r.fail(httpCode(resp.status), "HTTP status "+resp.statusText)
	}
	const want = "application/connect+json"
	if !strings.HasPrefix(resp.contentType, "application/connect+") {
		return r.fail("unknown", "invalid content-type: "+strconv.Quote(resp.contentType)+"; expecting "+strconv.Quote(want))
	}
	if ct, _, _ := strings.Cut(resp.contentType, ";"); strings.TrimSpace(ct) != want {
		return r.fail("internal", "invalid content-type: "+strconv.Quote(resp.contentType)+"; expecting "+strconv.Quote(want))
	}
	var result map[string]any
	destroyErr := ""
	for {
		flags, data, err := envelope(resp.body)
		switch {
		case err == io.EOF:
			return r.fail("internal", "protocol error: unexpected EOF")
		case err != nil:
			return r.fail("unavailable", err.Error())
		case flags == 2:
			if code, msg, failed := endStream(data); failed {
				return r.fail(code, msg)
			}
			if result == nil {
				return r.fail("internal", "stream ended without a result")
			}
			return r.finish(result, destroyErr)
		case flags == 1:
			return r.fail("internal", "protocol error: sent compressed message without compression support")
		case flags != 0:
			return r.fail("internal", "protocol error: invalid envelope flags "+strconv.Itoa(int(flags)))
		}
		v, err := parseJSON(data)
		m, isObject := v.(map[string]any)
		if err != nil || !isObject {
			return r.fail("internal", "unmarshal into dsec.v1.RunResponse: not a JSON object")
		}
		for _, s := range []struct {
			key string
			out *os.File
		}{{"stdout", os.Stdout}, {"stderr", os.Stderr}} {
			b64, present := m[s.key].(string)
			if !present {
				continue
			}
			b, err := base64.StdEncoding.DecodeString(b64)
			if err != nil {
				// protobuf's JSON also takes the URL alphabet.
				if b, err = base64.URLEncoding.DecodeString(b64); err != nil {
					return r.fail("internal", "unmarshal into dsec.v1.RunResponse: "+s.key+": "+err.Error())
				}
			}
			r.mu.Lock()
			_, werr := s.out.Write(b)
			r.mu.Unlock()
			if werr != nil {
				return r.fail("", "copy "+s.key+": "+werr.Error())
			}
		}
		if res, present := field(m, "result").(map[string]any); present {
			result = res
			destroyErr, _ = field(m, "destroyError", "destroy_error").(string)
		}
	}
}

// endStream reads an end-of-stream message: {"error": {"code", "message"}}
// when the call failed.
func endStream(data []byte) (code, msg string, failed bool) {
	v, err := parseJSON(data)
	m, isObject := v.(map[string]any)
	if err != nil || !isObject {
		return "unknown", "protocol error: invalid end of stream", true
	}
	e, present := m["error"].(map[string]any)
	if !present {
		return "", "", false
	}
	code, _ = e["code"].(string)
	msg, _ = e["message"].(string)
	if !knownCodes[code] {
		code = "unknown"
	}
	return code, msg, true
}

var knownCodes = map[string]bool{
	"canceled": true, "unknown": true, "invalid_argument": true, "deadline_exceeded": true,
	"not_found": true, "already_exists": true, "permission_denied": true, "resource_exhausted": true,
	"failed_precondition": true, "aborted": true, "out_of_range": true, "unimplemented": true,
	"internal": true, "unavailable": true, "data_loss": true, "unauthenticated": true,
}

// field returns m's value under the first of names present (protobuf's
// JSON is lowerCamelCase, but parsers accept the proto names too).
func field(m map[string]any, names ...string) any {
	for _, n := range names {
		if v, ok := m[n]; ok {
			return v
		}
	}
	return nil
}

func fieldInt(m map[string]any, names ...string) int {
	switch v := field(m, names...).(type) {
	case float64:
		return int(v)
	case string:
		n, _ := strconv.Atoi(v)
		return n
	}
	return 0
}

func fieldBool(m map[string]any, names ...string) bool {
	b, _ := field(m, names...).(bool)
	return b
}

// finish turns the result into the exit code as dsec-cli's resultExit
// does, after the warning of a failed destroy.
func (r *runner) finish(res map[string]any, destroyErr string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if destroyErr != "" {
		os.Stderr.WriteString("dsec: warning: " + destroyErr + "\n")
	}
	outcome, _ := res["outcome"].(string)
	switch {
	case outcome == "infra_error":
		infra, _ := field(res, "infraError", "infra_error").(string)
		os.Stderr.WriteString("dsec: infra_error: " + infra + "\n")
		return exitInfra
	case fieldBool(res, "timedOut", "timed_out") || outcome == "timeout":
		os.Stderr.WriteString("dsec: command timed out\n")
		return exitTimeout
	case fieldInt(res, "signal") != 0:
		return 128 + fieldInt(res, "signal")
	}
	return fieldInt(res, "exitCode", "exit_code")
}
