package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// ckDir is where the checkpoint phase's sandbox keeps its files.
const ckDir = "/root/ck"

// checkpointPhase: each repetition, the sandbox writes ckptMiB fresh files
// of 1 MiB plus a marker into its writable layer (untimed), Checkpoint is
// timed, the files are modified (changed, appended, deleted, a file
// replaced by a directory, a new directory), Rollback is timed, and the
// directory must then read exactly as at the checkpoint, or the run fails.
//
// Peers in the same repetition: `cp -a` of the same bytes on the host (a
// naive copy snapshot), with and without fsync, and destroy + create of a
// sandbox through the same API (what a user does without rollback; it
// does not even restore the files, so it is a lower bound).
func (h *harness) checkpointPhase(ctx context.Context) (err error) {
	cfg := h.cfg
	src := filepath.Join(h.work, "ckpt-src")
	dst := filepath.Join(h.work, "ckpt-copy")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	defer func() { err = errors.Join(err, os.RemoveAll(src), os.RemoveAll(dst)) }()

	var ids []string
	live := map[string]bool{}
	defer func() {
		var left []string
		for _, id := range ids {
			if live[id] {
				left = append(left, id)
			}
		}
		err = errors.Join(err, h.api.destroy(ctx, cfg.Batch, left...))
	}()
	track := func(sb *dsec.Sandbox) { ids = append(ids, sb.ID); live[sb.ID] = true }

	sb, err := h.api.create(ctx, map[string]string{"statebench": "checkpoint"})
	if err != nil {
		return err
	}
	track(sb)
	peerSB, err := h.api.create(ctx, map[string]string{"statebench": "recreate"})
	if err != nil {
		return err
	}
	track(peerSB)

	state := fmt.Sprintf("cd %s && ls -A && %s", ckDir, sumScript(".", cfg.CkptMiB)+" marker")
	modify := fmt.Sprintf("set -e; cd %s; echo changed > marker; echo more >> f1; rm f2; mkdir new; echo y > new/file", ckDir)
	if cfg.CkptMiB >= 3 {
		modify += "; rm f3; mkdir f3" // a file replaced by a directory
	}

	var ckTimes, rbTimes, cpTimes, cpSyncTimes, recreateTimes []time.Duration
	// What was measured is reported also when the phase stops early.
	defer func() {
		h.rep.addRow(figCkpt, "dsec Checkpoint", true, ckTimes, 0,
			"API round trip: freeze, copy the upper into a node-local checkpoint directory (not fsynced: checkpoints do not outlive the edge), thaw")
		h.rep.addRow(figCkpt, "cp -a", false, cpTimes, 0, "naive copy snapshot of the same bytes on the host (page cache)")
		h.rep.addRow(figCkpt, "cp -a + fsync", false, cpSyncTimes, 0, "as cp -a, then fsync of every copied file and directory")
		h.rep.addRow(figRollback, "dsec Rollback", true, rbTimes, 0,
			fmt.Sprintf("API round trip: kill the sandbox, restart it on the checkpoint's layers (the stack grows by one layer a repetition, up to %d)", cfg.Reps))
		h.rep.addRow(figRollback, "destroy+create", false, recreateTimes, 0,
			"Destroy then Create of a busybox sandbox through the same API; restores no file, so a lower bound for doing without rollback")
	}()
	for i := 1; i <= cfg.Reps; i++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		hostDir := ""
		if i == 1 {
			hostDir = src // the peers copy the first repetition's bytes
		}
		if _, err := fillUpper(ctx, sb, ckDir, cfg.CkptMiB, hostDir); err != nil {
			return err
		}
		want, err := sh(ctx, sb, fmt.Sprintf("set -e; echo rep-%d > %s/marker; rm -rf %s/new; %s", i, ckDir, ckDir, state))
		if err != nil {
			return err
		}

		t0 := time.Now()
		ck, err := h.api.checkpoint(ctx, sb.ID)
		d := time.Since(t0)
		if err != nil {
			return err
		}
		ckTimes = append(ckTimes, d)

		if _, err := sh(ctx, sb, modify); err != nil {
			return fmt.Errorf("modify after checkpoint: %w", err)
		}
		if _, err := sh(ctx, sb, "cd "+ckDir+` && test -f new/file && test ! -e f2 && test "$(cat marker)" = changed`); err != nil {
			return fmt.Errorf("modify after checkpoint had no effect: %w", err)
		}

		t0 = time.Now()
		err = h.api.rollback(ctx, sb.ID, ck)
		d = time.Since(t0)
		if err != nil {
			return err
		}
		rbTimes = append(rbTimes, d)

		got, err := sh(ctx, sb, state)
		if err != nil {
			return fmt.Errorf("after rollback %d to %s: %w", i, ck, err)
		}
		if got != want {
			return fmt.Errorf("after rollback %d to %s the files differ from the checkpoint:\n%s\nwant:\n%s", i, ck, got, want)
		}
		if err := h.api.deleteCheckpoint(ctx, sb.ID, ck); err != nil {
			return err
		}

		// Peers.
		for _, sync := range []bool{false, true} {
			t0 = time.Now()
			if b, err := exec.CommandContext(ctx, "cp", "-a", src, dst).CombinedOutput(); err != nil {
				return fmt.Errorf("cp -a: %w: %s", err, strings.TrimSpace(string(b)))
			}
			if sync {
				if err := fsyncTree(dst); err != nil {
					return err
				}
			}
			d = time.Since(t0)
			if sync {
				cpSyncTimes = append(cpSyncTimes, d)
			} else {
				cpTimes = append(cpTimes, d)
			}
			if err := os.RemoveAll(dst); err != nil {
				return err
			}
		}
		t0 = time.Now()
		dctx, cancel := context.WithTimeout(ctx, opTimeout)
		err = h.api.c.Destroy(dctx, peerSB.ID)
		cancel()
		if err != nil {
			return err
		}
		live[peerSB.ID] = false
		peerSB, err = h.api.create(ctx, map[string]string{"statebench": "recreate"})
		d = time.Since(t0)
		if err != nil {
			return err
		}
		track(peerSB)
		recreateTimes = append(recreateTimes, d)
	}
	slog.Info("rollbacks verified", "n", len(rbTimes))
	return nil
}
