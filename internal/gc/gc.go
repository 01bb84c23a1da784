// Package gc collects the blobs of a blob store that nothing needs any
// more: layers and manifests of deleted images and snapshots, data of
// trajectories that are gone, leftovers of failed imports. It is a mark and
// sweep over a blobstore.Repository, plus a function naming the layers the
// cluster's nodes hold; it keeps no state between runs.
//
// # Mark
//
// A blob is live when any of these holds:
//
//   - It is reachable from a ref. Every ref under every prefix counts
//     (images/..., tenant images images/t/<tenant>/..., trajectories/...,
//     tenants/..., and prefixes added later): the blob a ref names is live,
//     and so is every blob that blob names. A blob names another through a
//     JSON object with a "digest" field: an image manifest's layers
//     ({"digest","size"}), a shipped trajectory's data ({"digest","size",
//     "inline"}, one JSONL record per line). Blobs named by images/ and
//     trajectories/ refs must parse (a manifest or trajectory that cannot be
//     read might name anything, so the run stops with an error rather than
//     free what it might name); blobs named by other refs are read only when
//     they start like JSON, and are otherwise opaque. Marking is one level
//     deep: layers and data blobs are not read. A ref naming a missing blob
//     is reported in the log and otherwise ignored.
//   - A shipped trajectory blob may be a pack: the trajectories of several
//     sandboxes, named by a trajectories/<id> ref each (see
//     trajectory.Ship). It is read once however many refs name it, and
//     only the records of the sandboxes whose refs name it count (the
//     lines trajectory.LinesOf gives them, the only ones any reader takes):
//     the lines of a sandbox whose ref has moved on to a newer ship, or was
//     deleted, keep nothing. Those lines must parse; the others are read
//     only for the digest check. A blob that holds no line of a sandbox
//     whose ref names it (damage, or a blob not written by a ship) counts
//     whole, as any other ref's blob does. When a ref outside
//     trajectories/ names the blob too, it counts whole.
//   - A node holds it (Options.Held): the layers of the sandboxes running
//     on a node, as its heartbeats report them. A sandbox running on an
//     image whose tag was deleted keeps its layers this way, and so do the
//     snapshots and checkpoints it may still take (a snapshot's image is
//     the sandbox's layers plus a new one). Checkpoint layers live in each
//     node's own store, not in the shared one, and need nothing here.
//   - It is young: it entered the store less than the grace period
//     (Options.Grace, DefaultGrace by default) before the run started. An
//     import, create or snapshot in flight writes its blobs before the ref
//     that names them (layers, then the manifest, then the tag), and a
//     running sandbox's trajectory stores data blobs some time before the
//     next ship names them in trajectories/<id>. The grace period is what
//     lets collection run while all of that goes on; it must exceed the
//     longest such gap: for an import, from its first layer stored to its
//     tag set (an upload is spooled before any layer is built, so only the
//     conversion counts); for trajectories, the ship interval.
//
// # Sweep
//
// The blobs are listed (Store.Walk) before the refs are: a blob stored
// after the listing is not a candidate at all, and one stored before it
// whose ref is set before the refs are read is marked. Every listed blob
// that is not marked is then checked for age once more, right before it is
// deleted, and deleted when it is older than the grace period (measured
// from the start of the run). A dry run deletes nothing and reports what
// it would have freed.
//
// The age of a blob is when it entered the store: for stores keeping blobs
// as local files (blobstore.Local, the dir store), the later of the file's
// modification and change times (the dir store chmods a blob right before
// renaming it into place); for stores that know it (blobstore.Ager, the s3
// store), what they say: an object's LastModified, which storing the
// content again moves to now once it is a minute old.
//
// # Limits
//
//   - Storing content that is already present does not make it young
//     again in the dir store (Put and Ingest keep the existing file as it
//     is). If such content was unreferenced and old, a writer that stores
//     it again and then names it in a ref races with a run that has
//     already read the refs: the blob can be deleted under the new ref.
//     The post-sweep check (Result.Broken) reports refs that ended up
//     naming a freed blob. Refreshing the file's times when Put or Ingest
//     finds the blob present would make the re-check before deletion
//     catch this, leaving only the instant between check and unlink.
//   - Held layers are only as fresh as the last heartbeat: a sandbox
//     created from a tag deleted a moment later is protected by its layers'
//     refs until the delete, and by its node's heartbeats from the next beat
//     on; a run in between could free its layers. The caller should also
//     not run before every live node has heartbeated (after a server
//     restart).
//   - Every shipped trajectory blob (a pack of many, or one alone) is read
//     on every run, once.
//   - A pack's bytes stay while any ref names it, even when most of its
//     sandboxes' refs have moved on or gone; only the data blobs their
//     dead lines name are freed.
package gc

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// DefaultGrace is how old an unreferenced blob must be before it is freed.
const DefaultGrace = 15 * time.Minute

// Ref prefixes whose blobs must be readable for a run to go on.
const (
	imagesPrefix       = "images/"
	trajectoriesPrefix = "trajectories/"
)

// markWorkers bounds how many referenced blobs are read at once.
const markWorkers = 8

// Options configure a Run.
type Options struct {
	// Grace: blobs that entered the store less than this before the run
	// started are kept. Zero keeps only blobs stored after the start;
	// negative is an error.
	Grace time.Duration
	// DryRun reports what would be freed and deletes nothing.
	DryRun bool
	// Held returns the digests of the layers that nodes hold (may be nil).
	Held func(ctx context.Context) ([]string, error)
	// BlobTime returns when a blob entered the store; an error wrapping
	// blobstore.ErrNotFound means it is gone. Default: the blob file's
	// times, for stores implementing blobstore.Local; the store's own
	// for stores implementing blobstore.Ager (s3: the object's
	// LastModified). A store without any can only be collected with
	// Grace 0.
	BlobTime func(ctx context.Context, digest string) (time.Time, error)
	// Now is the clock (default time.Now).
	Now    func() time.Time
	Logger *slog.Logger
}

// Result reports a run. In a dry run, the Freed fields say what would have
// been freed.
type Result struct {
	DryRun       bool
	ScannedBlobs int64
	ScannedBytes int64
	KeptBlobs    int64
	KeptBytes    int64
	// Why blobs were kept; each kept blob counts under the first reason
	// that applies, in this order.
	Referenced int64
	Held       int64
	Young      int64
	FreedBlobs int64
	FreedBytes int64
	// Freed lists the freed digests, sorted.
	Freed []string
	// Broken lists refs that, read again after the sweep, name a blob the
	// sweep deleted (see Limits in the package doc): they were set while
	// the run went on, to content the store already held. Empty normally.
	Broken []string
}

// reason a blob is live.
type reason uint8

const (
	byRef reason = iota + 1
	byNode
)

// Run collects repo's garbage.
func Run(ctx context.Context, repo blobstore.Repository, opts Options) (Result, error) {
	if opts.Grace < 0 {
		return Result{}, fmt.Errorf("gc: grace %v is negative", opts.Grace)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	blobTime := opts.BlobTime
	if blobTime == nil {
		// A store that knows its blobs' ages says so first: a Cache is
		// Local too, but its files are this node's copies, and asking
		// for a path would fetch the blob.
		if a, ok := repo.(blobstore.Ager); ok {
			blobTime = a.BlobTime
		} else if local, ok := repo.(blobstore.Local); ok {
			blobTime = localBlobTime(local)
		} else if opts.Grace > 0 {
			return Result{}, fmt.Errorf("gc: the store (%T) cannot tell how old its blobs are; only a run with grace 0 can collect it", repo)
		}
	}
	start := opts.Now()
	cutoff := start.Add(-opts.Grace)
	res := Result{DryRun: opts.DryRun}

	// Candidates first, refs second: see the package doc.
	var blobs []blobstore.Descriptor
	if err := repo.Walk(ctx, func(d blobstore.Descriptor) error {
		blobs = append(blobs, d)
		return nil
	}); err != nil {
		return Result{}, fmt.Errorf("gc: list blobs: %w", err)
	}

	refs, err := repo.Refs().List(ctx, "")
	if err != nil {
		return Result{}, fmt.Errorf("gc: list refs: %w", err)
	}
	live, err := markRefs(ctx, repo, refs, opts.Logger)
	if err != nil {
		return Result{}, err
	}
	if opts.Held != nil {
		held, err := opts.Held(ctx)
		if err != nil {
			return Result{}, fmt.Errorf("gc: layers held by nodes: %w", err)
		}
		for _, d := range held {
			if _, ok := live[d]; !ok {
				live[d] = byNode
			}
		}
	}

	freed := map[string]bool{}
	for _, b := range blobs {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		res.ScannedBlobs++
		res.ScannedBytes += b.Size
		keep := func() { res.KeptBlobs++; res.KeptBytes += b.Size }
		switch live[b.Digest] {
		case byRef:
			res.Referenced++
			keep()
			continue
		case byNode:
			res.Held++
			keep()
			continue
		}
		// Read the age as late as possible: right before the delete.
		if blobTime != nil {
			t, err := blobTime(ctx, b.Digest)
			if errors.Is(err, blobstore.ErrNotFound) {
				continue // deleted meanwhile (by another run, say)
			}
			if err != nil {
				opts.Logger.Warn("gc: cannot tell a blob's age; keeping it", "blob", b.Digest, "err", err)
				res.Young++
				keep()
				continue
			}
			if t.After(cutoff) {
				res.Young++
				keep()
				continue
			}
		}
		if !opts.DryRun {
			if err := repo.Delete(ctx, b.Digest); errors.Is(err, blobstore.ErrNotFound) {
				continue
			} else if err != nil {
				slices.Sort(res.Freed)
				return res, fmt.Errorf("gc: delete %s: %w", b.Digest, err)
			}
		}
		freed[b.Digest] = true
		res.FreedBlobs++
		res.FreedBytes += b.Size
		res.Freed = append(res.Freed, b.Digest)
	}
	slices.Sort(res.Freed)

	if !opts.DryRun && len(freed) > 0 {
		res.Broken = checkRefs(ctx, repo, refs, freed, opts.Logger)
	}
	return res, nil
}

// markRefs returns every blob reachable from refs.
func markRefs(ctx context.Context, repo blobstore.Repository, refs []blobstore.Ref, log *slog.Logger) (map[string]reason, error) {
	live := map[string]reason{}
	// Each blob is read once however many refs name it; strictly if any
	// of them requires it.
	type target struct {
		ref    string // one ref naming it, for messages
		strict bool
		owners owners
	}
	targets := map[string]*target{}
	for _, r := range refs {
		live[r.Digest] = byRef
		t := targets[r.Digest]
		if t == nil {
			t = &target{ref: r.Name, owners: owners{}}
			targets[r.Digest] = t
		}
		if strictPrefix(r.Name) && !t.strict {
			t.strict, t.ref = true, r.Name
		}
		t.owners = t.owners.add(r.Name)
	}

	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	work := make(chan string)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for range markWorkers {
		wg.Go(func() {
			for digest := range work {
				t := targets[digest]
				var children []string
				err := scan(ctx, repo, digest, t.strict, t.owners, func(_, d string) { children = append(children, d) })
				mu.Lock()
				switch {
				case errors.Is(err, blobstore.ErrNotFound):
					log.Warn("gc: ref names a missing blob", "ref", t.ref, "blob", digest)
				case err != nil && !errors.Is(err, context.Canceled):
					errs = append(errs, fmt.Errorf("gc: ref %q: blob %s: %w (nothing is freed while what it names is unknown; fix or delete the ref)", t.ref, digest, err))
					cancel()
				}
				for _, c := range children {
					live[c] = byRef
				}
				mu.Unlock()
			}
		})
	}
	for digest := range targets {
		if ctx.Err() != nil {
			break
		}
		work <- digest
	}
	close(work)
	wg.Wait()
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return live, nil
}

func strictPrefix(ref string) bool {
	return strings.HasPrefix(ref, imagesPrefix) || strings.HasPrefix(ref, trajectoriesPrefix)
}

// owners are the sandboxes whose trajectory refs name a blob, when only
// trajectory refs do; nil when another ref names it, and the blob counts
// whole.
type owners map[string]bool

// add returns o with the ref name added.
func (o owners) add(name string) owners {
	id, ok := strings.CutPrefix(name, trajectoriesPrefix)
	if !ok || o == nil {
		return nil
	}
	o[id] = true
	return o
}

// scan calls fn with every digest blob names and the sandbox whose record
// names it ("" when the blob counts whole): with owners, the "digest"
// fields of the owners' records only (see the package doc), otherwise of
// every JSON object in it (a JSON value or a sequence of them, as JSONL).
// When strict, the blob must be JSON (with owners, the owners' records)
// and is read to its end, so that its digest is verified; otherwise a blob
// that does not start like JSON names nothing.
func scan(ctx context.Context, repo blobstore.Store, digest string, strict bool, o owners, fn func(owner, digest string)) error {
	if len(o) > 0 {
		whole, err := scanOwners(ctx, repo, digest, strict, o, fn)
		if err != nil || !whole {
			return err
		}
	}
	rc, err := repo.Open(ctx, digest)
	if err != nil {
		return err
	}
	defer rc.Close()
	br := bufio.NewReader(blobstore.ContextReader(ctx, rc))
	if !strict {
		c, err := firstNonSpace(br)
		if err == io.EOF || (err == nil && c != '{' && c != '[') {
			return nil
		}
		if err != nil {
			return err
		}
	}
	dec := json.NewDecoder(br)
	for {
		var v any
		err := dec.Decode(&v)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			if strict {
				return err
			}
			return nil
		}
		walk(v, func(d string) { fn("", d) })
	}
}

// scanOwners is scan of a shipped trajectory blob for its owners' records.
// whole is true when some owner has no record in it: the blob must then be
// scanned whole.
func scanOwners(ctx context.Context, repo blobstore.Store, digest string, strict bool, o owners, fn func(owner, digest string)) (whole bool, err error) {
	rc, err := repo.Open(ctx, digest)
	if err != nil {
		return false, err
	}
	defer rc.Close()
	br := bufio.NewReaderSize(blobstore.ContextReader(ctx, rc), 64<<10)
	found := map[string]bool{}
	for n := 1; ; n++ {
		line, err := br.ReadBytes('\n')
		if id, ok := trajectory.LineSandbox(line); ok && o[id] {
			found[id] = true
			var v any
			if jerr := json.Unmarshal(line, &v); jerr == nil {
				walk(v, func(d string) { fn(id, d) })
			} else if strict {
				return false, fmt.Errorf("line %d, a record of sandbox %s: %w", n, id, jerr)
			}
		}
		if err == io.EOF {
			return len(found) < len(o), nil
		}
		if err != nil {
			return false, err
		}
	}
}

func firstNonSpace(br *bufio.Reader) (byte, error) {
	for {
		c, err := br.ReadByte()
		if err != nil {
			return 0, err
		}
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		}
		return c, br.UnreadByte()
	}
}

func walk(v any, fn func(string)) {
	switch v := v.(type) {
	case map[string]any:
		if d, ok := v["digest"].(string); ok && blobstore.ValidateDigest(d) == nil {
			fn(d)
		}
		for _, x := range v {
			walk(x, fn)
		}
	case []any:
		for _, x := range v {
			walk(x, fn)
		}
	}
}

// checkRefs reads the refs again after a sweep and returns those that now
// name a freed blob, directly or through the blob they name. Refs unchanged
// since the mark were marked whole and are skipped. A blob named by many
// new refs (a trajectory pack) is read once.
func checkRefs(ctx context.Context, repo blobstore.Repository, before []blobstore.Ref, freed map[string]bool, log *slog.Logger) []string {
	after, err := repo.Refs().List(ctx, "")
	if err != nil {
		log.Warn("gc: cannot list refs after the sweep to check them", "err", err)
		return nil
	}
	seen := make(map[blobstore.Ref]bool, len(before))
	for _, r := range before {
		seen[r] = true
	}
	var fresh []blobstore.Ref
	targets := map[string]owners{}
	for _, r := range after {
		if seen[r] {
			continue
		}
		fresh = append(fresh, r)
		o, ok := targets[r.Digest]
		if !ok {
			o = owners{}
		}
		targets[r.Digest] = o.add(r.Name)
	}
	// lost: per blob, the owners whose records name a freed blob ("" for
	// the blob read whole).
	lost := map[string]map[string]bool{}
	for digest, o := range targets {
		if freed[digest] {
			continue
		}
		bad := map[string]bool{}
		err := scan(ctx, repo, digest, false, o, func(owner, d string) {
			if freed[d] {
				bad[owner] = true
			}
		})
		if err != nil && !errors.Is(err, blobstore.ErrNotFound) {
			log.Warn("gc: cannot check a blob named by refs set during the run", "blob", digest, "err", err)
		}
		lost[digest] = bad
	}
	var broken []string
	for _, r := range fresh {
		bad := freed[r.Digest] || lost[r.Digest][""]
		if id, ok := strings.CutPrefix(r.Name, trajectoriesPrefix); ok && !bad {
			bad = lost[r.Digest][id]
		}
		if bad {
			log.Error("gc: a ref set during the run names a blob the run freed", "ref", r.Name, "blob", r.Digest)
			broken = append(broken, r.Name)
		}
	}
	return broken
}

// localBlobTime reads a blob file's times.
func localBlobTime(l blobstore.Local) func(context.Context, string) (time.Time, error) {
	return func(_ context.Context, digest string) (time.Time, error) {
		p, err := l.Path(digest)
		if err != nil {
			return time.Time{}, err
		}
		info, err := os.Stat(p)
		if errors.Is(err, os.ErrNotExist) {
			return time.Time{}, fmt.Errorf("blob %s: %w", digest, blobstore.ErrNotFound)
		}
		if err != nil {
			return time.Time{}, err
		}
		t := info.ModTime()
		if c, ok := changeTime(info); ok && c.After(t) {
			t = c
		}
		return t, nil
	}
}
