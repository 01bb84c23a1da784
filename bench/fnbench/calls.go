package main

// The four ways of running `print(1)` the harness compares. Each call
// checks its own result: exit 0 and exactly "1\n" on stdout.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"time"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// The program, as fncall runs it (language python, code print(1)) and as
// the host and a fresh container run it.
const (
	code       = "print(1)"
	wantStdout = "1\n"
	python     = "/usr/bin/python3"
)

// callTimeout bounds one call so that a wedged service fails the run
// instead of hanging it.
const callTimeout = 3 * time.Minute

// callFunc runs the program once and reports whether it ran as expected,
// and how long the program itself ran as the sandbox measured it (0 when
// there is no such figure: the host row).
type callFunc func(ctx context.Context) (time.Duration, error)

// clients talk to dsec up: the Go SDK over HTTP/2 (Connect) and a plain
// HTTP/1.1 client for /run_code, as SandboxFusion's clients speak it.
type clients struct {
	endpoint, token string
	sdk             *dsec.Client
	h1              *http.Client
	h2              *http.Transport
}

func newClients(endpoint, token string, conc int) *clients {
	// Prior-knowledge h2c, as the SDK's default client speaks to an
	// http:// endpoint.
	h2 := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	h2.Protocols = &p
	// One keep-alive connection per concurrent caller, so that /run_code
	// calls never wait for a connection or pay for a new one.
	h1 := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        conc + 8,
		MaxIdleConnsPerHost: conc + 8,
		IdleConnTimeout:     90 * time.Second,
	}
	return &clients{
		endpoint: endpoint, token: token, h2: h2,
		sdk: dsec.New(endpoint, token, dsec.WithHTTPClient(&http.Client{Transport: h2})),
		h1:  &http.Client{Transport: h1},
	}
}

func (c *clients) close() {
	c.h2.CloseIdleConnections()
	c.h1.CloseIdleConnections()
}

// call returns the call of one row.
func (c *clients) call(row, image string) callFunc {
	switch row {
	case rowHost:
		return hostCall
	case rowFncall:
		return c.fncall
	case rowRunCode:
		return c.runCode
	case rowFresh:
		return func(ctx context.Context) (time.Duration, error) { return c.fresh(ctx, image) }
	}
	panic("fnbench: unknown row " + row)
}

// hostCall runs the program directly on the host.
func hostCall(ctx context.Context) (time.Duration, error) {
	out, err := exec.CommandContext(ctx, python, "-c", code).Output()
	if err != nil {
		return 0, fmt.Errorf("%s -c %q: %w", python, code, err)
	}
	if string(out) != wantStdout {
		return 0, fmt.Errorf("%s -c %q printed %q, want %q", python, code, out, wantStdout)
	}
	return 0, nil
}

// fncall is FnService.RunCode through the Go SDK.
func (c *clients) fncall(ctx context.Context) (time.Duration, error) {
	r, err := c.sdk.RunCode(ctx, dsec.RunCodeRequest{Language: "python", Code: code})
	if err != nil {
		return 0, err
	}
	if r.Status != dsec.RunSuccess || r.RunResult == nil || string(r.RunResult.Stdout) != wantStdout {
		return 0, fmt.Errorf("RunCode: %s", describeRunCode(r))
	}
	return r.RunResult.ExecutionTime, nil
}

func describeRunCode(r *dsec.RunCodeResponse) string {
	if r.RunResult == nil {
		return fmt.Sprintf("status %s (%s), no run result", r.Status, r.Message)
	}
	return fmt.Sprintf("status %s (%s), run %s exit %d, stdout %q, stderr %q", r.Status, r.Message,
		r.RunResult.Status, r.RunResult.ReturnCode, r.RunResult.Stdout, r.RunResult.Stderr)
}

// runCodeReply is the part of SandboxFusion's /run_code reply the harness
// checks.
type runCodeReply struct {
	Status    string `json:"status"`
	Message   string `json:"message"`
	RunResult *struct {
		Status        string  `json:"status"`
		ExecutionTime float64 `json:"execution_time"` // seconds
		ReturnCode    *int    `json:"return_code"`
		Stdout        string  `json:"stdout"`
		Stderr        string  `json:"stderr"`
	} `json:"run_result"`
}

// runCodeBody is SandboxFusion's request for the program.
var runCodeBody = []byte(`{"code":"print(1)","language":"python"}`)

// runCode is SandboxFusion's POST /run_code, JSON over HTTP/1.1.
func (c *clients) runCode(ctx context.Context) (time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.endpoint+"/run_code", bytes.NewReader(runCodeBody))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+c.token)
	resp, err := c.h1.Do(req)
	if err != nil {
		return 0, fmt.Errorf("POST /run_code: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return 0, fmt.Errorf("POST /run_code: read reply: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("POST /run_code: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	var r runCodeReply
	if err := json.Unmarshal(body, &r); err != nil {
		return 0, fmt.Errorf("POST /run_code: reply is not JSON: %w: %q", err, body)
	}
	if r.Status != dsec.RunSuccess || r.RunResult == nil || r.RunResult.Stdout != wantStdout {
		return 0, fmt.Errorf("POST /run_code: reply %s", body)
	}
	return time.Duration(r.RunResult.ExecutionTime * float64(time.Second)), nil
}

// fresh runs the program in a fresh sandbox of the language image through
// the same service: create, exec, destroy.
func (c *clients) fresh(ctx context.Context, image string) (time.Duration, error) {
	sb, err := c.sdk.Create(ctx, dsec.Spec{Image: image})
	if err != nil {
		return 0, err
	}
	r, err := sb.ExecWith(ctx, dsec.ExecOptions{Argv: []string{python, "-c", code}})
	// The sandbox goes whatever happened, also after ctx was cancelled: a
	// Ctrl-C must not leave it behind.
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
	defer cancel()
	derr := sb.Destroy(dctx)
	if err != nil {
		return 0, err
	}
	if r.Outcome != dsec.OutcomeOK || r.ExitCode != 0 || string(r.Stdout) != wantStdout {
		return 0, fmt.Errorf("exec in %s: outcome %s %s, exit %d, stdout %q, stderr %q", sb.ID, r.Outcome, r.InfraError, r.ExitCode, r.Stdout, r.Stderr)
	}
	return r.Duration, derr
}
