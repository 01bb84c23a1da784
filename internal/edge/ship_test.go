package edge_test

import (
	"bytes"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/edge"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// TestShipEndedTrajectories destroys sandboxes together, as a create and
// destroy loop does, and checks that the ship loop (not the periodic pass,
// an hour away here) ships every one soon after: each sandbox's shipped
// trajectory is its whole trajectory, ending with its destroy record.
func TestShipEndedTrajectories(t *testing.T) {
	w := newWorld(t)
	n := w.startNode(t, "sh1", func(c *edge.Config) { c.ShipInterval = time.Hour })
	const count = 6
	ids := make([]string, count)
	for i := range ids {
		ids[i] = n.mustCreate(t, admin, &dsecv1.SandboxSpec{Image: baseImage}).Id
		if _, err := n.exec(t, admin, ids[i], &dsecv1.ExecRequest{Shell: "echo " + ids[i], Seq: 1}); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, count)
	for i, id := range ids {
		wg.Go(func() { errs[i] = n.destroy(t, admin, id) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}

	for _, id := range ids {
		local, _ := n.trajectory(t, admin, id, 0)
		shipped := waitShipped(t, w.store, id)
		recs := verifyLines(t, shipped)
		if last := recs[len(recs)-1]; last.Kind != trajectory.KindDestroy {
			t.Fatalf("shipped trajectory of %s ends with %s", id, last.Kind)
		}
		if strings.Join(shipped, "\n") != strings.Join(local, "\n") {
			t.Fatalf("shipped trajectory of %s:\n%s\nthe node's:\n%s", id, strings.Join(shipped, "\n"), strings.Join(local, "\n"))
		}
	}
}

// waitShipped polls the store until sandbox id's shipped trajectory has
// its destroy record, and returns its lines; the deadline only bounds a
// broken test.
func waitShipped(t *testing.T, store *blobstore.Dir, id string) []string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		// The blob may be a pack: only id's lines are its trajectory.
		lines, _, err := trajectory.ReadShipped(t.Context(), store, id)
		if err != nil && !errors.Is(err, blobstore.ErrNotFound) {
			t.Fatal(err)
		}
		if err == nil && bytes.Contains(lines[len(lines)-1], []byte(`"kind":"destroy"`)) {
			out := make([]string, len(lines))
			for i, line := range lines {
				out[i] = string(line)
			}
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("the trajectory of %s was not shipped after its destroy", id)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
