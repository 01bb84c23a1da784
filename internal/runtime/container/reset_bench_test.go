package container_test

import (
	"context"
	"testing"
	"time"

	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// BenchmarkReset is what a warm pool pays between two users: a command,
// then Reset of the same sandbox. reset-ns/op is the Reset call alone; the
// rest of ns/op is the command and the background work Reset leaves (old
// overlay removal, next overlay built ahead), which competes for the same
// cores.
func BenchmarkReset(b *testing.B) {
	e := newEnv(b, 0)
	ctx := context.Background()
	sb, err := e.backend.Create(ctx, e.newSpec())
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Destroy(ctx)
	r := sb.(rt.Resetter)
	var spent time.Duration
	for b.Loop() {
		benchExec(b, sb)
		start := time.Now()
		if err := r.Reset(ctx); err != nil {
			b.Fatal(err)
		}
		spent += time.Since(start)
	}
	b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "reset-ns/op")
}

// BenchmarkDestroyCreate is the alternative to Reset: a command, then
// Destroy and a new Create over the same layers; "cold" spawns an agent per
// create, "warm" takes pre-started ones (Options.Warm) while the pool
// refills in the background on the same cores.
func BenchmarkDestroyCreate(b *testing.B) {
	for _, bc := range []struct {
		name string
		warm int
	}{{"cold", 0}, {"warm", 4}} {
		b.Run(bc.name, func(b *testing.B) {
			e := newEnv(b, bc.warm)
			ctx := context.Background()
			sb, err := e.backend.Create(ctx, e.newSpec())
			if err != nil {
				b.Fatal(err)
			}
			// The latest sandbox, also when the loop fails half-way.
			b.Cleanup(func() {
				if sb != nil {
					sb.Destroy(ctx)
				}
			})
			var destroying, creating time.Duration
			for b.Loop() {
				benchExec(b, sb)
				start := time.Now()
				if err := sb.Destroy(ctx); err != nil {
					b.Fatal(err)
				}
				mid := time.Now()
				if sb, err = e.backend.Create(ctx, e.newSpec()); err != nil {
					b.Fatal(err)
				}
				destroying += mid.Sub(start)
				creating += time.Since(mid)
			}
			b.ReportMetric(float64(destroying.Nanoseconds())/float64(b.N), "destroy-ns/op")
			b.ReportMetric(float64(creating.Nanoseconds())/float64(b.N), "create-ns/op")
		})
	}
}

// BenchmarkExecTrue is the command alone, to subtract from the two above.
func BenchmarkExecTrue(b *testing.B) {
	e := newEnv(b, 0)
	ctx := context.Background()
	sb, err := e.backend.Create(ctx, e.newSpec())
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Destroy(ctx)
	for b.Loop() {
		benchExec(b, sb)
	}
}

func benchExec(b *testing.B, sb rt.Sandbox) {
	res, err := sb.Exec(context.Background(), rt.ExecRequest{Argv: []string{"true"}}, nil)
	if err != nil || res.ExitCode != 0 {
		b.Fatalf("exec true: %v %+v", err, res)
	}
}
