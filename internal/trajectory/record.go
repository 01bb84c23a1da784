// Package trajectory keeps every sandbox's trajectory: the ordered, durable,
// hash-chained log of every operation that observed or changed the sandbox
// and of its result. It is a sandbox-level write-ahead log. It gives client
// fast-forward (a re-sent operation number returns the recorded result
// instead of running again), provenance (each record names its step, and the
// creation record the exact layers) and deterministic replay.
//
// A record's canonical form is its JSON encoding (encoding/json of Record,
// fields in declaration order, map keys sorted): that is one line of a JSONL
// export, one line of the edge's write-ahead log, and what the hash chain
// covers. Data too large to keep inline (outputs, file contents, stdin) is
// kept in the blob store and named by digest; the hash covers the digest and
// size, never the inline copy, so an export may inline everything and still
// verify.
package trajectory

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
)

// Record kinds.
const (
	KindCreate     = "create"
	KindExec       = "exec"
	KindWriteFile  = "write_file"
	KindReadFile   = "read_file"
	KindReward     = "reward"
	KindSnapshot   = "snapshot"
	KindCheckpoint = "checkpoint"
	KindRollback   = "rollback"
	// KindVerify: a grading command run in a fresh sandbox of the same
	// images with only the listed artifacts copied from this one
	// (Record.Exec: the command and its result; Record.Verify).
	KindVerify = "verify"
	// Events happen to a sandbox rather than being operations a client
	// numbers: they carry the seq of the step they follow, and do not take
	// a number of their own (a job-wide freeze must not shift the numbers
	// every client of the job is counting).
	KindDestroy = "destroy"
	KindLost    = "lost"
	KindFreeze  = "freeze"
	KindThaw    = "thaw"
	// KindInput: keyboard or mouse input sent to the sandbox's screen
	// (its reason says how many events of each kind, not what was typed).
	KindInput = "input"
	// KindEgress: one outward connection the sandbox's proxy decided
	// (Record.Egress: allowed or denied, by which rule, bytes each way).
	KindEgress = "egress"
)

// IsEvent reports whether records of kind are events (see KindDestroy).
func IsEvent(kind string) bool {
	switch kind {
	case KindDestroy, KindLost, KindFreeze, KindThaw, KindInput, KindEgress:
		return true
	}
	return false
}

// Record is one entry of a sandbox's trajectory.
type Record struct {
	Sandbox string `json:"sandbox"`
	// Seq is the operation's step: 0 for the creation record, then 1, 2, ...
	// in the order operations were admitted. Records appear in the log in
	// the order they completed, so concurrent operations may interleave.
	Seq       uint64 `json:"seq"`
	Kind      string `json:"kind"`
	RequestID string `json:"request_id,omitempty"`
	// Start and End are RFC 3339 UTC times with nanoseconds.
	Start string `json:"start"`
	End   string `json:"end"`

	Environment *Environment  `json:"environment,omitempty"`
	Exec        *Exec         `json:"exec,omitempty"`
	File        *File         `json:"file,omitempty"`
	Reward      *Reward       `json:"reward,omitempty"`
	Snapshot    *Snapshot     `json:"snapshot,omitempty"`
	Checkpoint  *Checkpoint   `json:"checkpoint,omitempty"`
	Egress      *Egress       `json:"egress,omitempty"`
	Verify      *Verification `json:"verify,omitempty"`
	// Error is set when the operation failed with an error rather than a
	// result (a file that does not exist, a bad path).
	Error *Error `json:"error,omitempty"`
	// Reason says why a sandbox was destroyed or lost.
	Reason string `json:"reason,omitempty"`

	// Prev is the Hash of the record before this one in the log ("" for
	// the first); Hash is sha256 over the record's canonical form with Hash
	// empty and inline data left out.
	Prev string `json:"prev"`
	Hash string `json:"hash"`
}

// Environment is what a sandbox was built from: enough to build it again.
type Environment struct {
	Tenant    string   `json:"tenant,omitempty"`
	Backend   string   `json:"backend"`
	Image     string   `json:"image"`
	Workspace string   `json:"workspace,omitempty"`
	Toolkits  []string `json:"toolkits,omitempty"`
	// Layers are the ordered layer digests, bottom first.
	Layers      []string          `json:"layers"`
	MilliCPU    int64             `json:"milli_cpu,omitempty"`
	MemoryBytes int64             `json:"memory_bytes,omitempty"`
	Pids        int64             `json:"pids,omitempty"`
	DiskBytes   int64             `json:"disk_bytes,omitempty"`
	Env         []string          `json:"env,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	TTL         string            `json:"ttl,omitempty"`
	IdleTimeout string            `json:"idle_timeout,omitempty"`
	IdleAction  string            `json:"idle_action,omitempty"`
}

// Exec is an exec's request and result.
type Exec struct {
	Argv           []string `json:"argv,omitempty"`
	Shell          string   `json:"shell,omitempty"`
	Env            []string `json:"env,omitempty"`
	Cwd            string   `json:"cwd,omitempty"`
	User           string   `json:"user,omitempty"`
	Timeout        string   `json:"timeout,omitempty"`
	MaxOutputBytes int64    `json:"max_output_bytes,omitempty"`
	Stdin          *Data    `json:"stdin,omitempty"`

	Outcome         string `json:"outcome"`
	ExitCode        int32  `json:"exit_code"`
	Signal          int32  `json:"signal,omitempty"`
	Stdout          *Data  `json:"stdout"`
	Stderr          *Data  `json:"stderr"`
	StdoutTruncated bool   `json:"stdout_truncated,omitempty"`
	StderrTruncated bool   `json:"stderr_truncated,omitempty"`
	TimedOut        bool   `json:"timed_out,omitempty"`
	OOMKilled       bool   `json:"oom_killed,omitempty"`
	PidsExhausted   bool   `json:"pids_exhausted,omitempty"`
	DiskFull        bool   `json:"disk_full,omitempty"`
	InfraError      string `json:"infra_error,omitempty"`
	DurationNanos   int64  `json:"duration_ns"`
}

// File is a write_file or read_file operation: for a write the data
// written, for a read the data returned.
type File struct {
	Path     string `json:"path"`
	Mode     uint32 `json:"mode,omitempty"`
	MaxBytes int64  `json:"max_bytes,omitempty"`
	Data     *Data  `json:"data,omitempty"`
}

// Reward is a reward the trainer submitted.
type Reward struct {
	Value    float64           `json:"value"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// Snapshot is a snapshot's request (the image name) and result.
type Snapshot struct {
	Ref string `json:"ref"`
	// Image is the new image's manifest digest, Layer the layer packed
	// from the sandbox's writable layer.
	Image string `json:"image,omitempty"`
	Layer string `json:"layer,omitempty"`
}

// Checkpoint names a checkpoint: the result of a checkpoint (with the
// layer it packed) or the target of a rollback.
// Verification is what a verify step copied into its verifier sandbox.
type Verification struct {
	// Artifacts are the paths copied from the sandbox, files or
	// directories, to the same paths in the verifier.
	Artifacts []string `json:"artifacts"`
}

// Egress is one connection the sandbox asked its proxy for and what the
// node's policy decided (internal/aether): recorded when it ends, or when
// it is refused.
type Egress struct {
	Host   string `json:"host"`
	Port   int    `json:"port,omitempty"`
	Method string `json:"method,omitempty"`
	// Addr is the address the node dialled (never one the sandbox chose).
	Addr    string `json:"addr,omitempty"`
	Allowed bool   `json:"allowed"`
	// Rule is what decided: "allow pypi", "default deny", "deny npm", ...
	Rule string `json:"rule"`
	// BytesOut went from the sandbox upstream, BytesIn came back.
	BytesOut int64 `json:"bytes_out,omitempty"`
	BytesIn  int64 `json:"bytes_in,omitempty"`
	// Ended says why an allowed connection was cut short (a policy
	// change, the sandbox's end).
	Ended string `json:"ended,omitempty"`
}

type Checkpoint struct {
	ID    string `json:"id"`
	Layer string `json:"layer,omitempty"`
}

// Error is an operation's failure as a Connect code name and message.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Data is a byte string named by its digest. Inline holds the bytes when
// they are kept in the record; otherwise they are in the blob store under
// Digest (when Size > 0).
type Data struct {
	Digest string `json:"digest"`
	Size   int64  `json:"size"`
	Inline []byte `json:"inline,omitempty"`
}

// NewData describes b, keeping it inline.
func NewData(b []byte) *Data {
	return &Data{Digest: digest(b), Size: int64(len(b)), Inline: b}
}

// Complete reports whether the bytes are at hand (inline or empty).
func (d *Data) Complete() bool { return d == nil || d.Size == 0 || d.Inline != nil }

func digest(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Timestamp formats t the way records hold times.
func Timestamp(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

func jsonEncoder(w io.Writer) *json.Encoder {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return enc
}

// Marshal returns the record's canonical JSON (no trailing newline).
func (r *Record) Marshal() ([]byte, error) {
	var buf bytes.Buffer
	if err := jsonEncoder(&buf).Encode(r); err != nil {
		return nil, fmt.Errorf("encode trajectory record %d of %s: %w", r.Seq, r.Sandbox, err)
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// ComputeHash returns the hash the record should carry: sha256 over its
// canonical form with Hash empty and every Data's inline bytes left out.
func (r *Record) ComputeHash() (string, error) {
	c := *r
	c.Hash = ""
	if r.Exec != nil {
		e := *r.Exec
		e.Stdin, e.Stdout, e.Stderr = bare(e.Stdin), bare(e.Stdout), bare(e.Stderr)
		c.Exec = &e
	}
	if r.File != nil {
		f := *r.File
		f.Data = bare(f.Data)
		c.File = &f
	}
	b, err := c.Marshal()
	if err != nil {
		return "", err
	}
	return digest(b), nil
}

func bare(d *Data) *Data {
	if d == nil {
		return nil
	}
	return &Data{Digest: d.Digest, Size: d.Size}
}

// datas lists the record's data fields.
func (r *Record) datas() []*Data {
	var out []*Data
	if r.Exec != nil {
		out = append(out, r.Exec.Stdin, r.Exec.Stdout, r.Exec.Stderr)
	}
	if r.File != nil {
		out = append(out, r.File.Data)
	}
	return out
}

// Parse decodes one canonical JSON record. Unknown fields are an error: a
// field the hash would not cover must not pass as part of the record.
func Parse(line []byte) (*Record, error) {
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	var r Record
	if err := dec.Decode(&r); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("trailing data after the record")
	}
	return &r, nil
}

// check verifies the record's own hash and its inline data against their
// digests; it does not look at the chain.
func (r *Record) check() error {
	h, err := r.ComputeHash()
	if err != nil {
		return err
	}
	if h != r.Hash {
		return fmt.Errorf("hash %s does not match its content (%s)", r.Hash, h)
	}
	return r.checkData()
}

// checkData verifies the record's inline data against their digests.
func (r *Record) checkData() error {
	for _, d := range r.datas() {
		if d != nil && d.Inline != nil && (digest(d.Inline) != d.Digest || int64(len(d.Inline)) != d.Size) {
			return fmt.Errorf("inline data does not match its digest %s", d.Digest)
		}
	}
	return nil
}
