package main

import (
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

// TestParseRunLeavesTheRestToDsecCli lists invocations the fast path must
// not serve: dsec-cli refuses them (usage errors, bad values) or does
// something else (help).
func TestParseRunLeavesTheRestToDsecCli(t *testing.T) {
	for _, args := range [][]string{
		{"--image", "x"},                      // no command
		{"--image", "x", "--"},                // empty command
		{"--help"},                            // help
		{"-h", "--image", "x", "--", "true"},  // help
		{"--image", "x", "true"},              // no --
		{"pos", "--image", "x", "--", "true"}, // positional before --
		{"--bogus", "--image", "x", "--", "true"},
		{"--image", "--", "true"},                // --image would take "--" as its value
		{"--image"},                              // value missing
		{"-e=A=B", "--image", "x", "--", "true"}, // pflag's -x=v
		{"-x", "--image", "x", "--", "true"},     // unknown shorthand
		{"--timeout", "soon", "--image", "x", "--", "true"},
		{"--ttl", "1", "--image", "x", "--", "true"}, // a duration needs a unit
	} {
		if c, ok := parseRun(args); ok {
			t.Errorf("parseRun(%q) = %+v, want not fast", args, c)
		}
	}
	// Parsed, but refused as dsec-cli refuses them.
	for _, args := range [][]string{
		{"--", "true"}, // no --image
		{"--image", "", "--", "true"},
		{"--image", "x", "--ttl", "-1s", "--", "true"},
		{"--image", "x", "--idle-timeout", "-1s", "--", "true"},
		{"--image", "x", "--timeout", "-1s", "--", "true"},
		{"--image", "x", "--idle-action", "sleep", "--", "true"},
		{"--image", "x", "--cpu", "lots", "--", "true"},
		{"--image", "x", "--memory", "-1g", "--", "true"},
		{"--image", "x", "--disk-size", "lots", "--", "true"},
		{"--image", "x", "--label", "novalue", "--", "true"},
		{"--image", "x", "--label", "a=1", "--label", "a=2", "--", "true"},
		{"--image", "x", "-e", "=v", "--", "true"},
		{"--image", "x", "--sandbox-env", "NOEQ", "--", "true"},
		{"--image", "x", "--", "bad\xffutf8"},
	} {
		c, ok := parseRun(args)
		if !ok {
			t.Errorf("parseRun(%q): not parsed", args)
			continue
		}
		if body, ok := c.runRequest(); ok {
			t.Errorf("runRequest(%q) = %s, want refused", args, body)
		}
	}
}

// TestRunRequestIsTheSDKs checks that the fast path sends what dsec-cli
// (through the Go SDK) sends: the JSON must parse as protobuf JSON into
// the same RunRequest.
func TestRunRequestIsTheSDKs(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want *dsecv1.RunRequest
	}{{
		args: []string{"--image", "busybox:latest", "--", "/bin/true"},
		want: &dsecv1.RunRequest{
			Spec: &dsecv1.SandboxSpec{Backend: "container", Image: "busybox:latest", IdleAction: "destroy"},
			Exec: &dsecv1.ExecRequest{Argv: []string{"/bin/true"}},
		},
	}, {
		args: []string{"--image=busybox:latest", "--workspace", "ws:1", "--toolkit", "t:1", "--toolkit=t:2",
			"--backend", "container", "--cpu", "0.5", "--memory", "1.5g", "--disk-size", "2g", "--label", "job=7", "--label", "k=a=b",
			"--sandbox-env", "A=1", "--ttl", "1h", "--idle-timeout", "1.5s", "--idle-action", "freeze",
			"--net-allow", "pypi", "--net-allow=*.example.org", "--net-deny", "npm",
			"--timeout", "250ms", "-e", "X=\"quoted\"\n", "-eY=2", "--env", "Z=3", "-w", "/tmp", "-uroot",
			"--token", "tok", "--endpoint", "127.0.0.1:1",
			"--", "sh", "-c", "echo \\ é \x01 $X", "--", "-e"},
		want: &dsecv1.RunRequest{
			Spec: &dsecv1.SandboxSpec{
				Backend: "container", Image: "busybox:latest", Workspace: "ws:1", Toolkits: []string{"t:1", "t:2"},
				Resources: &dsecv1.Resources{MilliCpu: 500, MemoryBytes: 3 << 29, DiskBytes: 2 << 30},
				Labels:    map[string]string{"job": "7", "k": "a=b"},
				Ttl:       durationpb.New(time.Hour), IdleTimeout: durationpb.New(1500 * time.Millisecond),
				Env: []string{"A=1"}, IdleAction: "freeze",
				Network: &dsecv1.NetworkPolicy{Allow: []string{"pypi", "*.example.org"}, Deny: []string{"npm"}},
			},
			Exec: &dsecv1.ExecRequest{
				Argv: []string{"sh", "-c", "echo \\ é \x01 $X", "--", "-e"}, Env: []string{"X=\"quoted\"\n", "Y=2", "Z=3"},
				Cwd: "/tmp", User: "root", Timeout: durationpb.New(250 * time.Millisecond),
			},
		},
	}, {
		args: []string{"--image", "x:1", "--timeout", "1ns", "--ttl", "90s", "--", "true"},
		want: &dsecv1.RunRequest{
			Spec: &dsecv1.SandboxSpec{Backend: "container", Image: "x:1", IdleAction: "destroy", Ttl: durationpb.New(90 * time.Second)},
			Exec: &dsecv1.ExecRequest{Argv: []string{"true"}, Timeout: durationpb.New(time.Nanosecond)},
		},
	}} {
		c, ok := parseRun(tc.args)
		if !ok {
			t.Fatalf("parseRun(%q): not fast", tc.args)
		}
		body, ok := c.runRequest()
		if !ok {
			t.Fatalf("runRequest(%q): refused", tc.args)
		}
		got := &dsecv1.RunRequest{}
		if err := protojson.Unmarshal(body, got); err != nil {
			t.Fatalf("%q: the request is not protobuf JSON: %v\n%s", tc.args, err, body)
		}
		if !proto.Equal(got, tc.want) {
			t.Errorf("%q: sent\n%v\nwant\n%v", tc.args, got, tc.want)
		}
	}
}

func TestCredentials(t *testing.T) {
	dir := t.TempDir()
	file := dir + "/tok"
	if err := os.WriteFile(file, []byte("  from-file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		env             map[string]string
		c               runCall
		endpoint, token string
		ok              bool
	}{
		{env: map[string]string{envEndpoint: "", envToken: "env"}, endpoint: defaultEndpoint, token: "env", ok: true},
		{env: map[string]string{envEndpoint: "10.0.0.1:7/", envToken: "env"}, endpoint: "http://10.0.0.1:7", token: "env", ok: true},
		{env: map[string]string{envEndpoint: "x", envToken: "env"}, c: runCall{endpoint: "http://1.2.3.4:5", token: "flag"}, endpoint: "http://1.2.3.4:5", token: "flag", ok: true},
		{env: map[string]string{envToken: "env"}, c: runCall{tokenFile: file}, endpoint: defaultEndpoint, token: "from-file", ok: true},
		{env: map[string]string{envToken: "env"}, c: runCall{token: "flag", tokenFile: "/nonexistent"}, endpoint: defaultEndpoint, token: "flag", ok: true},
		{env: map[string]string{envToken: "env"}, c: runCall{tokenFile: "/nonexistent"}},
	} {
		t.Setenv(envEndpoint, "")
		for k, v := range tc.env {
			t.Setenv(k, v)
		}
		endpoint, token, ok := tc.c.credentials()
		if ok != tc.ok || ok && (endpoint != tc.endpoint || token != tc.token) {
			t.Errorf("%+v: got %q %q %v, want %q %q %v", tc.c, endpoint, token, ok, tc.endpoint, tc.token, tc.ok)
		}
	}
}

func TestParseEndpoint(t *testing.T) {
	for _, tc := range []struct {
		in       string
		ok       bool
		host     string
		path     string
		loopback bool
	}{
		{in: "http://127.0.0.1:7110", ok: true, host: "127.0.0.1:7110", loopback: true},
		{in: "http://10.1.2.3:80/api", ok: true, host: "10.1.2.3:80", path: "/api"},
		{in: "http://10.1.2.3", ok: true, host: "10.1.2.3"},
		{in: "http://[::1]:7110", ok: true, host: "[::1]:7110", loopback: true},
		{in: "http://[fd00::1:2]:7110", ok: true, host: "[fd00::1:2]:7110"},
		{in: "https://127.0.0.1:7110"},
		{in: "http://localhost:7110"},
		{in: "http://dsec.example:7110"},
		{in: "http://u:p@127.0.0.1:7110"},
		{in: "http://127.0.0.1:7110?x=1"},
		{in: "http://127.0.0.1:99999"},
		{in: "http://127.0.0.01:7110"},
		{in: "http://[::1"},
	} {
		got, ok := parseEndpoint(tc.in)
		if ok != tc.ok || ok && (got.host != tc.host || got.path != tc.path || got.loopback != tc.loopback) {
			t.Errorf("parseEndpoint(%q) = %+v, %v; want host %q path %q loopback %v, ok %v", tc.in, got, ok, tc.host, tc.path, tc.loopback, tc.ok)
		}
	}
}

func TestParseJSON(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want any
	}{
		{`{"result":{"outcome":"failed","exitCode":3,"timedOut":true,"seq":"7"},"sandboxId":"n-1"}`,
			map[string]any{"result": map[string]any{"outcome": "failed", "exitCode": 3.0, "timedOut": true, "seq": "7"}, "sandboxId": "n-1"}},
		{` [1, -2.5e3, null, false, "a\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00"] `, []any{1.0, -2500.0, nil, false, "a\"\\/\b\f\n\r\té😀"}},
		{`{}`, map[string]any{}},
		{`[]`, []any(nil)},
	} {
		got, err := parseJSON([]byte(tc.in))
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseJSON(%s) = %#v, %v; want %#v", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{``, `{`, `{"a"}`, `{"a":1,}`, `[1 2]`, `"\x"`, "\"a\nb\"", `tru`, `{} {}`, `"\u12"`, strings.Repeat("[", 100) + strings.Repeat("]", 100)} {
		if v, err := parseJSON([]byte(bad)); err == nil {
			t.Errorf("parseJSON(%q) = %#v, want an error", bad, v)
		}
	}
}
