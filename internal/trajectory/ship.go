package trajectory

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"

	"github.com/dsec-dev/dsec/internal/blobstore"
)

// Bounds of one blob store batch of shipped trajectories, which are held in
// memory until the batch is written. A node ships at most a few hundred
// ended sandboxes per pacing interval; a periodic pass over thousands of
// running ones goes in several batches.
const (
	shipBatchMax   = 256
	shipBatchBytes = 64 << 20
)

// ShipRef is the blob-store ref under which sandbox id's shipped
// trajectory (a JSONL blob) is kept.
func ShipRef(id string) string { return "trajectories/" + id }

// Ship copies sandbox id's trajectory to the blob store as one JSONL blob
// and points ShipRef(id) at it, so that the trajectory outlives the node.
// It does nothing when nothing was appended since the last ship.
func (l *Log) Ship(ctx context.Context, id string) error {
	l.shipMu.Lock()
	defer l.shipMu.Unlock()
	sb, err := l.sandbox(id)
	if err != nil {
		return err
	}
	return l.ship(ctx, []*sbLog{sb})
}

// ShipBatch ships the trajectories of the sandboxes ids as Ship does, one
// blob and one ref each, written together as blob store batches
// (blobstore.WriteBatch), so that the flushes they cost do not grow with
// their number. Sandboxes the log does not know are skipped: Forget ships
// before it forgets.
func (l *Log) ShipBatch(ctx context.Context, ids []string) error {
	if l.isClosed() {
		return nil
	}
	l.shipMu.Lock()
	defer l.shipMu.Unlock()
	l.mu.Lock()
	sbs := make([]*sbLog, 0, len(ids))
	seen := make(map[string]bool, len(ids))
	for _, id := range ids {
		if sb := l.sandboxes[id]; sb != nil && !seen[id] {
			seen[id] = true
			sbs = append(sbs, sb)
		}
	}
	l.mu.Unlock()
	return l.ship(ctx, sbs)
}

// ShipAll ships every sandbox with records not yet shipped; it is what the
// periodic shipping runs.
func (l *Log) ShipAll(ctx context.Context) error {
	if l.isClosed() {
		return nil
	}
	l.shipMu.Lock()
	defer l.shipMu.Unlock()
	l.mu.Lock()
	sbs := make([]*sbLog, 0, len(l.sandboxes))
	for _, sb := range l.sandboxes {
		sbs = append(sbs, sb)
	}
	l.mu.Unlock()
	sort.Slice(sbs, func(i, j int) bool { return sbs[i].id < sbs[j].id })
	return l.ship(ctx, sbs)
}

// shipment is one trajectory on its way to the blob store: its first n
// records, as JSONL.
type shipment struct {
	sb   *sbLog
	n    int
	blob []byte
}

// ship ships the sandboxes with records not yet shipped, in batches. The
// caller holds shipMu: one ship at a time, so that a trajectory read later
// is also written later and a ref never goes back to an older version when
// two ships of one sandbox race (the ship loop's and Forget's).
func (l *Log) ship(ctx context.Context, sbs []*sbLog) error {
	var (
		errs  []error
		batch []shipment
		size  int
	)
	flush := func() {
		errs = append(errs, l.writeShipments(ctx, batch)...)
		batch, size = batch[:0], 0
	}
	for _, sb := range sbs {
		s, err := l.readShipment(sb)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if s.n == 0 {
			continue
		}
		batch = append(batch, s)
		size += len(s.blob)
		if len(batch) >= shipBatchMax || size >= shipBatchBytes {
			flush()
		}
	}
	if len(batch) > 0 {
		flush()
	}
	return errors.Join(errs...)
}

// readShipment reads sb's records for shipping; n is 0 when there is
// nothing new to ship.
func (l *Log) readShipment(sb *sbLog) (shipment, error) {
	sb.mu.Lock()
	locs := slices.Clone(sb.recs)
	shipped := sb.shipped
	sb.mu.Unlock()
	if len(locs) == shipped {
		return shipment{}, nil
	}
	if err := blobstore.ValidateRefName(ShipRef(sb.id)); err != nil {
		return shipment{}, fmt.Errorf("ship trajectory of %s: %w", sb.id, err)
	}
	size := 0
	for _, at := range locs {
		size += at.n
	}
	// Each record's line in its segment ends with its newline: read
	// straight into the blob.
	blob := make([]byte, size)
	off := 0
	for _, at := range locs {
		if _, err := at.seg.f.ReadAt(blob[off:off+at.n], at.off); err != nil {
			return shipment{}, fmt.Errorf("ship trajectory of %s: read %s at %d: %w", sb.id, at.seg.f.Name(), at.off, err)
		}
		off += at.n
	}
	return shipment{sb: sb, n: len(locs), blob: blob}, nil
}

// writeShipments writes a batch of shipments. When the batch fails as a
// whole, each shipment is written on its own, so that one that cannot be
// written does not hold back the others and its error names its sandbox.
func (l *Log) writeShipments(ctx context.Context, batch []shipment) []error {
	b := blobstore.Batch{Blobs: make([][]byte, len(batch)), Refs: make([]blobstore.Ref, len(batch))}
	for i, s := range batch {
		b.Blobs[i] = s.blob
		b.Refs[i] = blobstore.Ref{Name: ShipRef(s.sb.id), Digest: blobstore.Digest(s.blob)}
	}
	err := blobstore.WriteBatch(ctx, l.opts.Store, b)
	switch {
	case err == nil:
		for _, s := range batch {
			s.sb.mu.Lock()
			s.sb.shipped = max(s.sb.shipped, s.n)
			s.sb.mu.Unlock()
		}
		return nil
	case len(batch) == 1:
		return []error{fmt.Errorf("ship trajectory of %s: %w", batch[0].sb.id, err)}
	case ctx.Err() != nil:
		return []error{fmt.Errorf("ship %d trajectories: %w", len(batch), err)}
	}
	var errs []error
	for i := range batch {
		errs = append(errs, l.writeShipments(ctx, batch[i:i+1])...)
	}
	return errs
}
