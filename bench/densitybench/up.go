package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/dsec-dev/dsec/bench/internal/dsecup"
)

// nodeID names the edge of every phase; sandbox IDs start with it.
const nodeID = "densitybench"

// withUp starts a dsec up of its own for one phase (data dir
// work/<name>/data, the run's -up-args plus args), runs fn against it, and
// always tears it down: SIGTERM (dsec up destroys what is left), then
// whatever it left behind is reported as an error and removed.
func (rn *run) withUp(ctx context.Context, name string, args []string, fn func(up *dsecup.Up) error) (leaks *dsecup.Leaks, err error) {
	dir := filepath.Join(rn.work, name)
	dataDir := filepath.Join(dir, "data")
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, err
	}
	all := append(append([]string{}, rn.cfg.UpArgs...), args...)
	up, err := dsecup.Start(ctx, dsecup.Options{Bins: rn.bins, DataDir: dataDir, Rootfs: rn.rootfs, NodeID: nodeID,
		Args: all, LogAttrs: []any{"phase", name, "args", all}})
	if up == nil {
		return nil, err
	}
	rn.upPIDs = append(rn.upPIDs, up.PID())
	errs := []error{err}
	defer func() {
		if serr := up.Stop(); serr != nil {
			errs = append(errs, serr)
		}
		l, cerr := dsecup.Reclaim(rn.bins, up.PID(), dataDir)
		if cerr != nil {
			errs = append(errs, fmt.Errorf("cleanup: %w", cerr))
		}
		if !l.Empty() {
			leaks = &l
			errs = append(errs, fmt.Errorf("dsec up left %s (removed)", l))
		}
		if rn.keep {
			if werr := os.WriteFile(filepath.Join(dir, "dsec-up.log"), []byte(up.Log()), 0o644); werr != nil {
				errs = append(errs, werr)
			}
		} else if rerr := dsecup.RemoveDir(dir); rerr != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", dir, rerr))
		}
		err = errors.Join(errs...)
	}()
	if err != nil {
		return nil, err
	}
	errs = append(errs, fn(up))
	return nil, nil
}
