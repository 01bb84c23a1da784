package trajectory

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
)

// VerifyError names the first record of a trajectory that fails
// verification.
type VerifyError struct {
	// Line is the 1-based line of the JSONL input.
	Line    int
	Sandbox string
	Seq     uint64
	Reason  string
}

func (e *VerifyError) Error() string {
	if e.Sandbox == "" {
		return fmt.Sprintf("line %d: %s", e.Line, e.Reason)
	}
	return fmt.Sprintf("line %d (sandbox %s, seq %d): %s", e.Line, e.Sandbox, e.Seq, e.Reason)
}

// Verify checks a JSONL trajectory: every line is a well-formed record
// whose hash matches its content and whose inline data matches its digest,
// each record's prev is the hash of the record before it of the same
// sandbox, the first record of a sandbox is its creation record, and no
// sequence number appears twice. It returns the number of records checked
// and, on the first failure, a *VerifyError naming the record.
func Verify(r io.Reader) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<30)
	type chain struct {
		last string
		seqs map[uint64]bool
	}
	chains := map[string]*chain{}
	n := 0
	for sc.Scan() {
		n++
		line := sc.Bytes()
		rec, err := Parse(line)
		if err != nil {
			ve := &VerifyError{Line: n, Reason: "not a trajectory record: " + err.Error()}
			// Name the record when the line is JSON that says which.
			var id struct {
				Sandbox string `json:"sandbox"`
				Seq     uint64 `json:"seq"`
			}
			if json.Unmarshal(line, &id) == nil {
				ve.Sandbox, ve.Seq = id.Sandbox, id.Seq
			}
			return n - 1, ve
		}
		fail := func(format string, args ...any) (int, error) {
			return n - 1, &VerifyError{Line: n, Sandbox: rec.Sandbox, Seq: rec.Seq, Reason: fmt.Sprintf(format, args...)}
		}
		if err := rec.check(); err != nil {
			return fail("%v", err)
		}
		c := chains[rec.Sandbox]
		if c == nil {
			if rec.Kind != KindCreate {
				return fail("the trajectory does not start with its creation record")
			}
			c = &chain{seqs: map[uint64]bool{}}
			chains[rec.Sandbox] = c
		}
		if rec.Prev != c.last {
			return fail("hash chain broken: prev %q, the record before has hash %q", rec.Prev, c.last)
		}
		if !IsEvent(rec.Kind) {
			if c.seqs[rec.Seq] {
				return fail("seq %d appears twice", rec.Seq)
			}
			c.seqs[rec.Seq] = true
		}
		c.last = rec.Hash
	}
	if err := sc.Err(); err != nil {
		return n, fmt.Errorf("read trajectory: %w", err)
	}
	return n, nil
}
