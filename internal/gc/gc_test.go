package gc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/gc"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/trajectory"
)

// fixture is a dir store whose blobs, as far as a run with its clock can
// tell, were all stored an hour ago unless made young.
type fixture struct {
	t     *testing.T
	ctx   context.Context
	store *blobstore.Dir
	imgs  *image.Store
	now   time.Time
}

const grace = 15 * time.Minute

func newFixture(t *testing.T) *fixture {
	store, err := blobstore.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{t: t, ctx: t.Context(), store: store, imgs: image.NewStore(store, store.Refs()), now: time.Now().Add(time.Hour)}
}

func (f *fixture) put(content string) blobstore.Descriptor {
	f.t.Helper()
	d, err := f.store.Put(f.ctx, strings.NewReader(content))
	if err != nil {
		f.t.Fatal(err)
	}
	return d
}

// young makes a blob look stored a minute before the run starts.
func (f *fixture) young(d blobstore.Descriptor) {
	f.t.Helper()
	p, err := f.store.Path(d.Digest)
	if err != nil {
		f.t.Fatal(err)
	}
	at := f.now.Add(-time.Minute)
	if err := os.Chtimes(p, at, at); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fixture) image(ref string, layers ...blobstore.Descriptor) string {
	f.t.Helper()
	digest, err := f.imgs.Put(f.ctx, ref, image.Manifest{Layers: layers})
	if err != nil {
		f.t.Fatal(err)
	}
	return digest
}

func (f *fixture) run(opts gc.Options) gc.Result {
	f.t.Helper()
	if opts.Grace == 0 {
		opts.Grace = grace
	}
	opts.Now = func() time.Time { return f.now }
	res, err := gc.Run(f.ctx, f.store, opts)
	if err != nil {
		f.t.Fatal(err)
	}
	f.checkCounts(res)
	return res
}

func (f *fixture) checkCounts(res gc.Result) {
	f.t.Helper()
	if res.KeptBlobs+res.FreedBlobs != res.ScannedBlobs || res.KeptBytes+res.FreedBytes != res.ScannedBytes ||
		res.Referenced+res.Held+res.Young != res.KeptBlobs || int64(len(res.Freed)) != res.FreedBlobs {
		f.t.Fatalf("inconsistent result %+v", res)
	}
}

func (f *fixture) exists(d string) bool {
	f.t.Helper()
	_, err := f.store.Stat(f.ctx, d)
	if err != nil && !errors.Is(err, blobstore.ErrNotFound) {
		f.t.Fatal(err)
	}
	return err == nil
}

// want checks which blobs are still there.
func (f *fixture) want(kept []string, freed []string) {
	f.t.Helper()
	for _, d := range kept {
		if !f.exists(d) {
			f.t.Errorf("blob %s was freed, want it kept", d)
		}
	}
	for _, d := range freed {
		if f.exists(d) {
			f.t.Errorf("blob %s was kept, want it freed", d)
		}
	}
}

func sorted(ds ...string) []string {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	return ds
}

func TestImagesAndLayers(t *testing.T) {
	f := newFixture(t)
	base := f.put("base layer")
	shared := f.put("shared layer")
	gone := f.put("layer of a deleted image")
	orphan := f.put("layer of an import that never finished")
	m1 := f.image("busybox:1", base, shared)
	tenant := f.image("t/alice/mine:1", shared)
	dropped := f.image("old:1", gone, shared)
	if err := f.imgs.Delete(f.ctx, "old:1"); err != nil {
		t.Fatal(err)
	}

	st, err := f.store.Stat(f.ctx, dropped)
	if err != nil {
		t.Fatal(err)
	}

	res := f.run(gc.Options{})
	f.want([]string{base.Digest, shared.Digest, m1, tenant}, []string{gone.Digest, orphan.Digest, dropped})
	if want := sorted(gone.Digest, orphan.Digest, dropped); !slices.Equal(res.Freed, want) {
		t.Fatalf("freed %v, want %v", res.Freed, want)
	}
	if res.ScannedBlobs != 7 || res.KeptBlobs != 4 || res.Referenced != 4 || res.FreedBytes != gone.Size+orphan.Size+st.Size {
		t.Fatalf("result %+v", res)
	}
	if len(res.Broken) != 0 {
		t.Fatalf("broken refs %v", res.Broken)
	}
	// The images still resolve, and a second run finds nothing to free.
	if _, err := f.imgs.Resolve(f.ctx, "busybox:1", "t/alice/mine:1"); err != nil {
		t.Fatal(err)
	}
	if res := f.run(gc.Options{}); res.FreedBlobs != 0 || res.ScannedBlobs != 4 {
		t.Fatalf("second run %+v", res)
	}
}

func TestTrajectoryData(t *testing.T) {
	f := newFixture(t)
	stdout := f.put(strings.Repeat("stdout of a step\n", 100))
	written := f.put(strings.Repeat("a file written\n", 100))
	unshipped := f.put("data of a trajectory that was never shipped")
	small := trajectory.NewData([]byte("ok\n")) // inline: no blob
	recs := []*trajectory.Record{
		{Sandbox: "sb1", Seq: 0, Kind: trajectory.KindCreate, Environment: &trajectory.Environment{Image: "busybox:1", Layers: []string{unshipped.Digest}}},
		{Sandbox: "sb1", Seq: 1, Kind: trajectory.KindExec, Exec: &trajectory.Exec{Argv: []string{"true"},
			Stdout: &trajectory.Data{Digest: stdout.Digest, Size: stdout.Size}, Stderr: small}},
		{Sandbox: "sb1", Seq: 2, Kind: trajectory.KindWriteFile, File: &trajectory.File{Path: "/f",
			Data: &trajectory.Data{Digest: written.Digest, Size: written.Size}}},
	}
	var buf bytes.Buffer
	for _, r := range recs {
		line, err := r.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		buf.Write(line)
		buf.WriteByte('\n')
	}
	log := f.put(buf.String())
	if err := f.store.Refs().Set(f.ctx, trajectory.ShipRef("sb1"), log.Digest); err != nil {
		t.Fatal(err)
	}
	res := f.run(gc.Options{})
	// A creation record's layer list does not keep layers: only data does.
	f.want([]string{log.Digest, stdout.Digest, written.Digest}, []string{unshipped.Digest})
	if res.Referenced != 3 || res.FreedBlobs != 1 {
		t.Fatalf("result %+v", res)
	}
}

func TestYoungBlobsKept(t *testing.T) {
	f := newFixture(t)
	layer := f.put("layer an import just wrote")
	data := f.put("data a running sandbox just stored")
	old := f.put("old garbage")
	f.young(layer)
	f.young(data)
	res := f.run(gc.Options{})
	f.want([]string{layer.Digest, data.Digest}, []string{old.Digest})
	if res.Young != 2 || res.FreedBlobs != 1 {
		t.Fatalf("result %+v", res)
	}
	// Past the grace period they go.
	f.now = f.now.Add(grace)
	res = f.run(gc.Options{})
	f.want(nil, []string{layer.Digest, data.Digest})
	if res.FreedBlobs != 2 {
		t.Fatalf("result %+v", res)
	}
}

func TestHeldLayersKept(t *testing.T) {
	f := newFixture(t)
	held := f.put("layer of a sandbox whose tag was deleted")
	free := f.put("layer nobody runs on")
	f.image("gone:1", held, free)
	if err := f.imgs.Delete(f.ctx, "gone:1"); err != nil {
		t.Fatal(err)
	}
	res := f.run(gc.Options{Held: func(context.Context) ([]string, error) {
		return []string{held.Digest, "sha256:" + strings.Repeat("0", 64)}, nil
	}})
	f.want([]string{held.Digest}, []string{free.Digest})
	if res.Held != 1 || res.FreedBlobs != 2 {
		t.Fatalf("result %+v", res)
	}

	_, err := gc.Run(f.ctx, f.store, gc.Options{Held: func(context.Context) ([]string, error) { return nil, errors.New("registry down") }})
	if err == nil || !strings.Contains(err.Error(), "registry down") {
		t.Fatalf("a failing Held: %v", err)
	}
	f.want([]string{held.Digest}, nil)
}

func TestDryRun(t *testing.T) {
	f := newFixture(t)
	keep := f.put("kept")
	junk := f.put("junk")
	f.image("a:1", keep)
	res := f.run(gc.Options{DryRun: true})
	if !res.DryRun || res.FreedBlobs != 1 || res.FreedBytes != junk.Size || !slices.Equal(res.Freed, []string{junk.Digest}) {
		t.Fatalf("dry run %+v", res)
	}
	f.want([]string{keep.Digest, junk.Digest}, nil)
	res = f.run(gc.Options{})
	f.want([]string{keep.Digest}, []string{junk.Digest})
}

func TestOtherRefs(t *testing.T) {
	f := newFixture(t)
	opaque := f.put("\x00\x01 not json at all")
	named := f.put("named by a JSON blob under an unknown prefix")
	doc := f.put(fmt.Sprintf(`{"kind":"future","parts":[{"digest":%q,"size":%d}]}`, named.Digest, named.Size))
	tenant := f.put(`{"name":"alice","quota":{}}`)
	junk := f.put("junk")
	for name, d := range map[string]string{"other/opaque": opaque.Digest, "future/doc": doc.Digest, "tenants/alice": tenant.Digest,
		"dangling/x": "sha256:" + strings.Repeat("1", 64)} {
		if err := f.store.Refs().Set(f.ctx, name, d); err != nil {
			t.Fatal(err)
		}
	}
	f.run(gc.Options{})
	f.want([]string{opaque.Digest, named.Digest, doc.Digest, tenant.Digest}, []string{junk.Digest})
}

func TestUnreadableManifestStopsTheRun(t *testing.T) {
	f := newFixture(t)
	layer := f.put("layer")
	notJSON := f.put("this is not a manifest")
	junk := f.put("junk")
	if err := f.store.Refs().Set(f.ctx, "images/broken:1", notJSON.Digest); err != nil {
		t.Fatal(err)
	}
	f.image("ok:1", layer)
	_, err := gc.Run(f.ctx, f.store, gc.Options{Grace: grace, Now: func() time.Time { return f.now }})
	if err == nil || !strings.Contains(err.Error(), "images/broken:1") {
		t.Fatalf("run over an unreadable manifest: %v", err)
	}
	f.want([]string{layer.Digest, notJSON.Digest, junk.Digest}, nil)

	// A corrupt trajectory stops it too: its data would be unknown.
	if err := f.store.Refs().Delete(f.ctx, "images/broken:1"); err != nil {
		t.Fatal(err)
	}
	traj := f.put(`{"sandbox":"sb"}` + "\n")
	if err := f.store.Refs().Set(f.ctx, trajectory.ShipRef("sb"), traj.Digest); err != nil {
		t.Fatal(err)
	}
	p, _ := f.store.Path(traj.Digest)
	os.Chmod(p, 0o644)
	if err := os.WriteFile(p, []byte(`{"sandbox":"xx"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = gc.Run(f.ctx, f.store, gc.Options{Grace: grace, Now: func() time.Time { return f.now }})
	if !errors.Is(err, blobstore.ErrDigestMismatch) {
		t.Fatalf("run over a corrupt trajectory: %v", err)
	}
	f.want([]string{junk.Digest}, nil)
}

func TestNegativeGrace(t *testing.T) {
	f := newFixture(t)
	if _, err := gc.Run(f.ctx, f.store, gc.Options{Grace: -time.Second}); err == nil {
		t.Fatal("negative grace accepted")
	}
}

// TestBrokenRefReported shows the limit the package doc describes: a ref
// set during a run to content the store already held, unreferenced and
// old, loses its blob, and the run says so.
func TestBrokenRefReported(t *testing.T) {
	f := newFixture(t)
	old := f.put("old unreferenced content, stored again by a writer")
	res, err := gc.Run(f.ctx, f.store, gc.Options{Grace: grace, Now: func() time.Time { return f.now },
		Held: func(ctx context.Context) ([]string, error) {
			// Runs after the refs were read.
			return nil, f.store.Refs().Set(ctx, "other/late", old.Digest)
		}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Broken, []string{"other/late"}) {
		t.Fatalf("broken = %v, want other/late", res.Broken)
	}
}

// TestConcurrentWriters runs collections while writers import images the
// way layer.Import does (layers, then the manifest, then the tag) and
// delete them again: with a grace period, no tag ever names a missing blob.
func TestConcurrentWriters(t *testing.T) {
	store, err := blobstore.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	imgs := image.NewStore(store, store.Refs())
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errc := make(chan error, 16)
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				var layers []blobstore.Descriptor
				for j := range 3 {
					d, err := store.Put(ctx, strings.NewReader(fmt.Sprintf("writer %d image %d layer %d", w, i, j)))
					if err != nil {
						errc <- err
						return
					}
					layers = append(layers, d)
				}
				ref := fmt.Sprintf("w%d:%d", w, i)
				if _, err := imgs.Put(ctx, ref, image.Manifest{Layers: layers}); err != nil {
					errc <- fmt.Errorf("import %s: %w", ref, err)
					return
				}
				if _, err := imgs.Resolve(ctx, ref, ""); err != nil {
					errc <- fmt.Errorf("resolve %s: %w", ref, err)
					return
				}
				if i%2 == 0 {
					if err := imgs.Delete(ctx, ref); err != nil {
						errc <- err
						return
					}
				}
			}
		})
	}
	// Collect for a few seconds with a one-second grace period: the
	// images deleted early are freed while the writers go on.
	var freed int64
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); {
		res, err := gc.Run(ctx, store, gc.Options{Grace: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Broken) > 0 {
			t.Fatalf("broken refs %v", res.Broken)
		}
		freed += res.FreedBlobs
		time.Sleep(20 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	entries, err := imgs.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if _, err := imgs.Resolve(ctx, e.Ref, ""); err != nil {
			t.Fatalf("image %s after collections: %v", e.Ref, err)
		}
		m, _, _ := imgs.Get(ctx, e.Ref)
		for _, l := range m.Layers {
			if _, err := store.Stat(ctx, l.Digest); err != nil {
				t.Fatalf("image %s: %v", e.Ref, err)
			}
		}
	}
	if freed == 0 {
		t.Fatal("nothing was freed while the writers ran")
	}
	// Once everything is old, the deleted images go and the rest stay.
	res, err := gc.Run(ctx, store, gc.Options{Grace: time.Minute, Now: func() time.Time { return time.Now().Add(time.Hour) }})
	if err != nil {
		t.Fatal(err)
	}
	if res.FreedBlobs == 0 || res.Referenced != int64(len(entries))*4 {
		t.Fatalf("final run %+v for %d images", res, len(entries))
	}
}
