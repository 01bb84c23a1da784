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

// Small trajectories are shipped in packs: one blob holding the JSONL of
// several sandboxes of one tenant, each sandbox's lines together and in
// order, and a ref per sandbox naming it. Two new files per ended sandbox
// (its blob and its ref) cost more than the writing: on ext4 without a
// journal every inode allocation scans the inodes its block group freed in
// the last minutes, which under a create/destroy loop made shipping 4-10 %
// of the machine's CPU. A pack and a batch's refs to it (which share one
// inode, see blobstore.Dir.WriteBatch) are two inodes per batch instead.
//
// A trajectory larger than packMaxItem is shipped alone: it is not small,
// and readers of a pack read it whole (LinesOf). A pack stops growing at
// packMaxBytes. A pack never mixes tenants, so a pack's bytes are one
// tenant's whoever holds it. Its bytes stay while any ref names it: a
// running sandbox shipped again, or a trajectory deleted, leaves its
// lines in the pack as dead bytes until the pack's other sandboxes go too.
const (
	packMaxItem  = 64 << 10
	packMaxBytes = 1 << 20
)

// ShipRef is the blob-store ref under which sandbox id's shipped
// trajectory (a JSONL blob) is kept.
func ShipRef(id string) string { return "trajectories/" + id }

// Ship copies sandbox id's trajectory to the blob store as one JSONL blob
// and points ShipRef(id) at it, so that the trajectory outlives the node.
// It does nothing when nothing was appended since the last ship. Readers
// take the sandbox's lines out of the blob with LinesOf: a blob shipped by
// ShipBatch or ShipAll may be a pack holding other sandboxes' lines too.
func (l *Log) Ship(ctx context.Context, id string) error {
	l.shipMu.Lock()
	defer l.shipMu.Unlock()
	sb, err := l.sandbox(id)
	if err != nil {
		return err
	}
	return l.ship(ctx, []*sbLog{sb})
}

// ShipBatch ships the trajectories of the sandboxes ids as Ship does, a ref
// each, written together as blob store batches (blobstore.WriteBatch), so
// that the flushes they cost do not grow with their number. Small
// trajectories of one tenant share a blob, a pack (see packMaxItem), so
// that the files they cost do not either. Sandboxes the log does not know
// are skipped: Forget ships before it forgets.
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
// records, as JSONL, and the tenant it belongs to.
type shipment struct {
	sb     *sbLog
	n      int
	tenant string
	blob   []byte
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
	tenant := ""
	if sb.env != nil {
		tenant = sb.env.Tenant
	}
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
	return shipment{sb: sb, n: len(locs), tenant: tenant, blob: blob}, nil
}

// writeShipments writes a batch of shipments, the small ones in packs.
// When the batch fails as a whole, the shipments whose refs it did not set
// are written one by one, so that one that cannot be written does not hold
// back the others and its error names its sandbox.
func (l *Log) writeShipments(ctx context.Context, batch []shipment) []error {
	blobs, of := pack(batch)
	digests := make([]string, len(blobs))
	for i, blob := range blobs {
		digests[i] = blobstore.Digest(blob)
	}
	b := blobstore.Batch{Blobs: blobs, Refs: make([]blobstore.Ref, len(batch))}
	for i, s := range batch {
		b.Refs[i] = blobstore.Ref{Name: ShipRef(s.sb.id), Digest: digests[of[i]]}
	}
	err := blobstore.WriteBatch(ctx, l.opts.Store, b)
	switch {
	case err == nil:
		for _, s := range batch {
			s.done()
		}
		return nil
	case len(batch) == 1:
		return []error{fmt.Errorf("ship trajectory of %s: %w", batch[0].sb.id, err)}
	case ctx.Err() != nil:
		return []error{fmt.Errorf("ship %d trajectories: %w", len(batch), err)}
	}
	// Refs are set only once every blob is stored, so a ref that names
	// its pack now is shipped: writing it again alone would move it to a
	// blob of its own, a file more, and leave its lines in the pack dead.
	var errs []error
	refs := l.opts.Store.Refs()
	for i, s := range batch {
		if d, err := refs.Get(ctx, b.Refs[i].Name); err == nil && d == b.Refs[i].Digest {
			s.done()
			continue
		}
		errs = append(errs, l.writeShipments(ctx, batch[i:i+1])...)
	}
	return errs
}

// done records that s is shipped.
func (s shipment) done() {
	s.sb.mu.Lock()
	s.sb.shipped = max(s.sb.shipped, s.n)
	s.sb.mu.Unlock()
}

// pack groups a batch's shipments into the blobs that ship them and
// returns those and, for each shipment, the index of its blob. A
// shipment larger than packMaxItem is a blob of its own; the others are
// concatenated, in batch order, into packs of one tenant each of at most
// packMaxBytes.
func pack(batch []shipment) (blobs [][]byte, of []int) {
	of = make([]int, len(batch))
	open := map[string]int{} // tenant: its pack still growing
	for i, s := range batch {
		j, ok := open[s.tenant]
		switch {
		case len(s.blob) > packMaxItem:
			of[i] = len(blobs)
			blobs = append(blobs, s.blob)
			continue
		case ok && len(blobs[j])+len(s.blob) <= packMaxBytes:
			blobs[j] = append(blobs[j], s.blob...)
		default:
			// Clipped: appending the next shipment's lines must copy,
			// not write past this one's.
			j = len(blobs)
			open[s.tenant] = j
			blobs = append(blobs, slices.Clip(s.blob))
		}
		of[i] = j
	}
	return blobs, of
}
