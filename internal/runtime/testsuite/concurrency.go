package testsuite

import (
	"bytes"
	"fmt"
	"strconv"
	"sync"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

func (s *suite) testConcurrency(t *testing.T) {
	t.Run("execs-in-one-sandbox", s.testConcurrentExecs)
	t.Run("creates", s.testConcurrentCreates)
}

func (s *suite) testConcurrentExecs(t *testing.T) {
	sb := s.create(t, nil)
	ctx := s.ctx(t)
	const n = 20
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Distinct stdin, env and exit code per exec: any crossed wire shows.
			in := bytes.Repeat([]byte(fmt.Sprintf("exec-%02d;", i)), 2000)
			req := runtime.ExecRequest{
				Shell: `echo "$DSEC_I"; cat; exit $DSEC_I`,
				Env:   []string{"DSEC_I=" + strconv.Itoa(i)},
				Stdin: in,
			}
			res, err := sb.Exec(ctx, req, nil)
			if err != nil {
				errs <- fmt.Errorf("exec %d: %w", i, err)
				return
			}
			want := append([]byte(strconv.Itoa(i)+"\n"), in...)
			if res.ExitCode != i || !bytes.Equal(res.Stdout, want) {
				errs <- fmt.Errorf("exec %d: %s, stdout %d bytes starting %q; want exit %d and %d bytes",
					i, resultSummary(res), len(res.Stdout), clip(res.Stdout[:min(len(res.Stdout), 40)]), i, len(want))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func (s *suite) testConcurrentCreates(t *testing.T) {
	const n = 10
	specs := make([]runtime.Spec, n)
	for i := range specs {
		specs[i] = s.h.NewSpec(t)
		specs[i].Hostname = ""
	}
	ctx := s.ctx(t)
	sbs := make([]runtime.Sandbox, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range specs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sbs[i], errs[i] = s.h.Backend.Create(ctx, specs[i])
		}()
	}
	wg.Wait()
	for i, sb := range sbs {
		if sb != nil {
			t.Cleanup(func() { s.destroy(t, sb) })
		}
		if errs[i] != nil {
			t.Errorf("concurrent Create(%q): %v", specs[i].ID, errs[i])
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	// Each sandbox is its own: its hostname is its ID and it reads back what
	// was written in it, not what its neighbours wrote at the same moment.
	for i, sb := range sbs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			script := fmt.Sprintf(`echo %d > /tmp/who; hostname; cat /tmp/who`, i)
			res, err := sb.Exec(ctx, runtime.ExecRequest{Shell: script}, nil)
			errs[i] = err
			if err == nil {
				want := fmt.Sprintf("%s\n%d\n", specs[i].ID, i)
				if got := string(res.Stdout); got != want || res.ExitCode != 0 {
					errs[i] = fmt.Errorf("printed %q (%s), want %q", got, resultSummary(res), want)
				}
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("sandbox %d (%s): %v", i, specs[i].ID, err)
		}
	}
	ids := map[string]bool{}
	for _, sb := range sbs {
		if ids[sb.ID()] {
			t.Errorf("two sandboxes share the ID %q", sb.ID())
		}
		ids[sb.ID()] = true
	}
	// Concurrent destroys too.
	for _, sb := range sbs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := sb.Destroy(ctx); err != nil {
				t.Errorf("concurrent Destroy(%q): %v", sb.ID(), err)
			}
		}()
	}
	wg.Wait()
}
