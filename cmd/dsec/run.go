package main

// The fast path of `dsec run`: its flags, checked exactly as dsec-cli
// checks them, turned into one Run request. Whatever this file does not
// recognise (an unknown flag, --help, a positional argument before --, a
// value dsec-cli would refuse, an endpoint that needs DNS, TLS or a proxy)
// makes parseRun say "not fast", and main hands the command to dsec-cli,
// which then prints its own usage error or does the call its own way.

import (
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval"
)

// Defaults, as in sdk/go/dsec (New) and dsec-cli's flags.
const (
	defaultEndpoint  = "http://127.0.0.1:7110"
	defaultTokenFile = "/var/lib/dsec/admin.token"
	envEndpoint      = "DSEC_ENDPOINT"
	envToken         = "DSEC_TOKEN"
)

// runCall is one parsed `dsec run`.
type runCall struct {
	// Client flags.
	endpoint, token, tokenFile string
	// createFlags.
	image, workspace, backend string
	toolkits, labels, sbEnv   []string
	netAllow, netDeny         []string
	cpu, memory, idleAction   string
	disk                      string
	ttl, idle                 time.Duration
	// execFlags.
	timeout   time.Duration
	env       []string
	cwd, user string

	argv []string
}

// runFlag is one flag of `dsec run` (see dsec-cli's createFlags, execFlags
// and globals).
type runFlag struct {
	name  string
	short byte
	set   func(c *runCall, v string) bool
}

func str(p func(*runCall) *string) func(*runCall, string) bool {
	return func(c *runCall, v string) bool { *p(c) = v; return true }
}

func strs(p func(*runCall) *[]string) func(*runCall, string) bool {
	return func(c *runCall, v string) bool { *p(c) = append(*p(c), v); return true }
}

func dur(p func(*runCall) *time.Duration) func(*runCall, string) bool {
	return func(c *runCall, v string) bool {
		d, err := time.ParseDuration(v)
		*p(c) = d
		return err == nil
	}
}

var runFlags = []runFlag{
	{"endpoint", 0, str(func(c *runCall) *string { return &c.endpoint })},
	{"token", 0, str(func(c *runCall) *string { return &c.token })},
	{"token-file", 0, str(func(c *runCall) *string { return &c.tokenFile })},
	{"image", 0, str(func(c *runCall) *string { return &c.image })},
	{"workspace", 0, str(func(c *runCall) *string { return &c.workspace })},
	{"toolkit", 0, strs(func(c *runCall) *[]string { return &c.toolkits })},
	{"backend", 0, str(func(c *runCall) *string { return &c.backend })},
	{"cpu", 0, str(func(c *runCall) *string { return &c.cpu })},
	{"memory", 0, str(func(c *runCall) *string { return &c.memory })},
	{"disk-size", 0, str(func(c *runCall) *string { return &c.disk })},
	{"label", 0, strs(func(c *runCall) *[]string { return &c.labels })},
	{"sandbox-env", 0, strs(func(c *runCall) *[]string { return &c.sbEnv })},
	{"net-allow", 0, strs(func(c *runCall) *[]string { return &c.netAllow })},
	{"net-deny", 0, strs(func(c *runCall) *[]string { return &c.netDeny })},
	{"ttl", 0, dur(func(c *runCall) *time.Duration { return &c.ttl })},
	{"idle-timeout", 0, dur(func(c *runCall) *time.Duration { return &c.idle })},
	{"idle-action", 0, str(func(c *runCall) *string { return &c.idleAction })},
	{"timeout", 0, dur(func(c *runCall) *time.Duration { return &c.timeout })},
	{"env", 'e', strs(func(c *runCall) *[]string { return &c.env })},
	{"cwd", 'w', str(func(c *runCall) *string { return &c.cwd })},
	{"user", 'u', str(func(c *runCall) *string { return &c.user })},
}

func lookupFlag(name string, short byte) *runFlag {
	for i := range runFlags {
		f := &runFlags[i]
		if name != "" && f.name == name || short != 0 && f.short == short {
			return f
		}
	}
	return nil
}

// parseRun parses the arguments after "run" as pflag would, for the forms
// --name=value, --name value, -x value and -xvalue, up to "--" and the
// command. ok is false for anything else.
func parseRun(args []string) (c *runCall, ok bool) {
	c = &runCall{backend: "container", idleAction: "destroy"}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			c.argv = args[i+1:]
			break
		}
		var (
			f        *runFlag
			val      string
			hasValue bool
		)
		switch {
		case strings.HasPrefix(a, "--"):
			var name string
			name, val, hasValue = strings.Cut(a[2:], "=")
			f = lookupFlag(name, 0)
		case len(a) > 1 && a[0] == '-':
			f = lookupFlag("", a[1])
			if len(a) > 2 {
				val, hasValue = a[2:], true
				if val[0] == '=' {
					return nil, false // pflag's -x=value: rare, left to dsec-cli
				}
			}
		default:
			return nil, false // a positional argument before --: a usage error
		}
		if f == nil {
			return nil, false
		}
		if !hasValue {
			if i+1 >= len(args) || args[i+1] == "--" {
				return nil, false
			}
			i++
			val = args[i]
		}
		if !f.set(c, val) {
			return nil, false
		}
	}
	if len(c.argv) == 0 {
		return nil, false
	}
	return c, true
}

// runRequest checks the call as dsec-cli's createFlags.spec and
// execFlags.options do and builds the RunRequest's JSON (what the Go SDK
// would send). ok is false when dsec-cli would refuse the call or when
// protobuf would refuse a string (not UTF-8).
func (c *runCall) runRequest() (body []byte, ok bool) {
	if c.image == "" || c.ttl < 0 || c.idle < 0 || c.timeout < 0 ||
		c.idleAction != "destroy" && c.idleAction != "freeze" {
		return nil, false
	}
	var milliCPU, memBytes, diskBytes int64
	var err error
	if c.cpu != "" {
		if milliCPU, err = flagval.ParseCPU("cpu", c.cpu); err != nil {
			return nil, false
		}
	}
	if c.memory != "" {
		if memBytes, err = flagval.ParseSize("memory", c.memory); err != nil {
			return nil, false
		}
	}
	if c.disk != "" {
		if diskBytes, err = flagval.ParseSize("disk-size", c.disk); err != nil {
			return nil, false
		}
	}
	labels, err := flagval.ParseLabels("label", c.labels)
	if err != nil {
		return nil, false
	}
	if flagval.CheckEnv("sandbox-env", c.sbEnv) != nil || flagval.CheckEnv("env", c.env) != nil {
		return nil, false
	}
	for _, list := range [][]string{{c.image, c.workspace, c.backend, c.idleAction, c.cwd, c.user},
		c.toolkits, c.labels, c.sbEnv, c.env, c.argv, c.netAllow, c.netDeny} {
		for _, s := range list {
			if !utf8.ValidString(s) {
				return nil, false
			}
		}
	}

	var spec, res, lab, net, ex, req jsonObject
	spec.str("backend", c.backend)
	spec.str("image", c.image)
	spec.str("workspace", c.workspace)
	spec.strs("toolkits", c.toolkits)
	res.int64("milliCpu", milliCPU)
	res.int64("memoryBytes", memBytes)
	res.int64("diskBytes", diskBytes)
	spec.object("resources", &res)
	for k, v := range labels {
		lab.key(k)
		lab.b = appendJSONString(lab.b, v)
	}
	spec.object("labels", &lab)
	spec.duration("ttl", c.ttl)
	spec.duration("idleTimeout", c.idle)
	spec.strs("env", c.sbEnv)
	spec.str("idleAction", c.idleAction)
	net.strs("allow", c.netAllow)
	net.strs("deny", c.netDeny)
	spec.object("network", &net)
	ex.strs("argv", c.argv)
	ex.strs("env", c.env)
	ex.str("cwd", c.cwd)
	ex.str("user", c.user)
	ex.duration("timeout", c.timeout)
	req.object("spec", &spec)
	req.object("exec", &ex)
	return req.bytes(), true
}

// credentials resolves the endpoint and token as dsec-cli does (flags,
// then DSEC_ENDPOINT and DSEC_TOKEN, then the local defaults). ok is false
// when --token-file cannot be read: dsec-cli reports that.
func (c *runCall) credentials() (endpoint, token string, ok bool) {
	endpoint = c.endpoint
	if endpoint == "" {
		endpoint = os.Getenv(envEndpoint)
	}
	if endpoint == "" {
		endpoint = defaultEndpoint
	}
	if !strings.Contains(endpoint, "://") {
		endpoint = "http://" + endpoint
	}
	endpoint = strings.TrimRight(endpoint, "/")

	token = c.token
	if token == "" && c.tokenFile != "" {
		b, err := os.ReadFile(c.tokenFile)
		if err != nil {
			return "", "", false
		}
		token = strings.TrimSpace(string(b))
	}
	if token == "" {
		token = os.Getenv(envToken)
	}
	if token == "" {
		if b, err := os.ReadFile(defaultTokenFile); err == nil {
			token = strings.TrimSpace(string(b))
		}
	}
	return endpoint, token, true
}
