package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/s3test"
	"github.com/dsec-dev/dsec/internal/trajectory"
	"github.com/dsec-dev/dsec/sdk/go/dsec"
)

// TestS3Store runs `dsec up --store s3://...` against a real S3 server
// (SeaweedFS): an imported image's layers and tag land in the bucket, not
// on the node; a sandbox runs from them; an image pulled from a registry
// converts into the bucket and runs; its trajectory ships to the
// bucket and is read back from there after the sandbox is gone. A second
// `dsec up` on a fresh data directory, sharing only the bucket, sees the
// image, fetches its layer into its own cache and runs it, and runs a
// snapshot the first one took: what a second node of a cluster does.
func TestS3Store(t *testing.T) {
	bins := build(t)
	srv := s3test.Start(t)
	// The daemons take the credentials from the environment, as in
	// production.
	for _, kv := range srv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	const prefix = "cluster-a"
	store := "s3://" + srv.Bucket + "/" + prefix
	s3c, err := srv.Client()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	keys := func(under string) []string {
		t.Helper()
		var out []string
		for obj := range s3c.ListObjects(ctx, srv.Bucket, minio.ListObjectsOptions{Prefix: prefix + "/" + under, Recursive: true}) {
			if obj.Err != nil {
				t.Fatal(obj.Err)
			}
			out = append(out, strings.TrimPrefix(obj.Key, prefix+"/"))
		}
		return out
	}
	up := func(data string, extra ...string) cli {
		addr := freeAddr(t)
		args := append([]string{"up", "--data-dir", data, "--listen", addr,
			"--store", store, "--s3-endpoint", srv.Endpoint,
			"--agent", bins.agent, "--node-id", "solo", "--log-level", "warn"}, extra...)
		d := startDaemon(t, "dsec up "+data, bins.dsec, args...)
		d.waitHealthy(t, "http://"+addr)
		return cli{bin: bins.dsec, endpoint: "http://" + addr, token: readToken(t, filepath.Join(data, "admin.token"))}
	}

	data := t.TempDir()
	c := up(data)
	out := c.ok(t, "image", "import", "busybox:latest", busyboxRootfs(t))
	if !strings.HasPrefix(out, "busybox:latest sha256:") {
		t.Fatalf("image import printed %q", out)
	}
	refs := keys("refs/images/")
	if len(refs) != 1 || !strings.Contains(refs[0], "busybox") {
		t.Fatalf("image refs in the bucket: %q, want busybox's tag", refs)
	}
	blobs := keys("blobs/sha256/")
	if len(blobs) < 2 {
		t.Fatalf("blobs in the bucket after an import: %q, want a layer and a manifest at least", blobs)
	}
	if _, err := os.Stat(filepath.Join(data, "blobs")); !os.IsNotExist(err) {
		t.Fatalf("the node made a dir store (%v): --store s3:// was not used for everything", err)
	}

	if got := c.ok(t, "run", "--image", "busybox:latest", "--", "echo", "hello from s3"); got != "hello from s3" {
		t.Fatalf("run printed %q", got)
	}

	// An image pulled from a registry is converted into the bucket too.
	testPull(t, c, startRegistry(t))

	// A sandbox's trajectory ships to the bucket when it ends, and is read
	// back from there.
	cl := dsec.New(c.endpoint, c.token)
	sb, err := cl.Create(ctx, dsec.Spec{Image: "busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.ExecShell(ctx, "echo shipped; exit 5"); err != nil {
		t.Fatal(err)
	}
	// A snapshot's new layer is built on the node and uploaded: the
	// second node runs it below.
	if _, err := sb.ExecShell(ctx, "echo made-on-node-1 > /snapshot-marker"); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Snapshot(ctx, "snap:1"); err != nil {
		t.Fatal(err)
	}
	if err := sb.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	shipRef := "refs/" + trajectory.ShipRef(sb.ID)
	poll(t, time.Minute, "the trajectory shipped to the bucket", func() (bool, error) {
		return len(keys(shipRef)) == 1, nil
	})
	log := c.ok(t, "sandbox", "log", sb.ID)
	if !strings.Contains(log, "exit 5") || !strings.Contains(log, "destroy") {
		t.Fatalf("sandbox log of a shipped trajectory:\n%s", log)
	}

	// A second node: a fresh data dir, the same bucket. Every layer with a
	// chunk index (busybox's, over one chunk) is loaded on demand there.
	data2 := t.TempDir()
	c2 := up(data2, "--lazy-min-size", "1")
	if got := c2.ok(t, "image", "ls"); !strings.Contains(got, "busybox:latest") {
		t.Fatalf("the second node's image ls:\n%s", got)
	}
	if got := c2.ok(t, "run", "--image", "busybox:latest", "--", "cat", "/etc/passwd"); !strings.HasPrefix(got, "root:") {
		t.Fatalf("run on the second node printed %q", got)
	}
	if got := c2.ok(t, "run", "--image", "snap:1", "--", "cat", "/snapshot-marker"); got != "made-on-node-1" {
		t.Fatalf("the snapshot taken on the first node, run on the second, has %q", got)
	}
	cache, err := blobstore.NewDir(filepath.Join(data2, "blobcache"))
	if err != nil {
		t.Fatal(err)
	}
	var cached int
	cache.Walk(ctx, func(blobstore.Descriptor) error { cached++; return nil })
	if cached == 0 {
		t.Fatal("the second node ran the snapshot without fetching its small layer (no chunk index) into its cache")
	}
	// busybox's layer came in chunks, verified, into the lazy cache, and
	// is not in the whole-blob cache.
	chunks, _ := os.ReadDir(filepath.Join(data2, "lazy", "chunks"))
	if len(chunks) == 0 {
		t.Fatal("the second node ran busybox without fetching any chunk: its layer was not loaded on demand")
	}
	if idx := keys("refs/lazy/chunks/"); len(idx) == 0 {
		t.Fatal("no chunk index stored beside the imported layers")
	} else {
		for _, k := range idx {
			hex := k[strings.LastIndex(k, "/")+1:]
			if _, err := cache.Path("sha256:" + hex); err == nil {
				t.Fatalf("layer %s has a chunk index but was fetched whole", hex)
			}
		}
	}
}
