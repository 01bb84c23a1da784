// Command lazybench measures layers loaded on demand (internal/lazyfs)
// against the eager whole-layer fetch (blobstore.Cache), in one run, from a
// real S3 server (SeaweedFS's weed) on loopback behind a throttling proxy
// that models a node's share of the network (default 1 Gbit/s for all of
// the node's connections together).
//
// One image: a Debian rootfs (default the fncall language rootfs,
// /var/cache/dsec/lang-rootfs: Debian bookworm with python3, node, go,
// gcc) built into one EROFS layer and stored in the bucket. Each scenario
// runs on a node directory of its own (nothing cached) a burst of -n
// "creates": each resolves the layer to a file (fetch), mounts it
// (layer.Mounts: once per node, shared), runs /bin/true in a chroot of it
// (time to first exec) and then python3 -c 'import json, sqlite3, email'
// (time to first useful result).
//
// Scenarios: eager (whole layer fetched into the node's cache, then
// mounted), lazy (chunks on demand, no prefetch list: the first run, which
// records one), lazy+prefetch (another fresh node, reading ahead along the
// list). Then cold Python starts: a fresh EROFS mount of the lazy layer
// with its chunks in the node's cache (a restarted loader) against a fresh
// mount of the same layer held whole locally.
//
// Must run as root (mounts, chroot). Usage:
//
//	go run ./bench/lazybench [-rootfs DIR] [-n 8] [-mbit 1000]
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/blobstore/s3store"
	"github.com/dsec-dev/dsec/internal/blobstore/s3test"
	"github.com/dsec-dev/dsec/internal/layer"
	"github.com/dsec-dev/dsec/internal/lazyfs"
)

var (
	rootfs = flag.String("rootfs", "/var/cache/dsec/lang-rootfs", "Debian rootfs with python3 to build the image from")
	burst  = flag.Int("n", 8, "creates in one burst")
	mbit   = flag.Float64("mbit", 1000, "bandwidth of the node's link to the store, Mbit/s (0: unlimited)")
	colds  = flag.Int("cold", 5, "cold Python starts per side")
	work   = flag.String("work", "", "work directory (default a temp dir, removed)")
)

const pyCmd = "import json, sqlite3, email"

func main() {
	flag.Parse()
	log.SetFlags(0)
	if os.Geteuid() != 0 {
		log.Fatal("lazybench must run as root")
	}
	slog.SetLogLoggerLevel(slog.LevelError)
	dir := *work
	if dir == "" {
		d, err := os.MkdirTemp("/var/tmp", "lazybench-")
		must(err)
		defer os.RemoveAll(d)
		dir = d
	}
	must(os.MkdirAll(filepath.Join(dir, "s3"), 0o755))
	srv, err := s3test.StartIn(filepath.Join(dir, "s3"))
	must(err)
	defer srv.Stop()
	px := newProxy(strings.TrimPrefix(srv.Endpoint, "http://"), *mbit*1e6/8)
	ctx := context.Background()
	open := func(endpoint string) *s3store.Store {
		s, err := s3store.Open(ctx, s3store.Config{Bucket: srv.Bucket, Prefix: "bench", Endpoint: endpoint,
			AccessKey: srv.AccessKey, SecretKey: srv.SecretKey, TempDir: filepath.Join(dir, "tmp")})
		must(err)
		return s
	}
	must(os.MkdirAll(filepath.Join(dir, "tmp"), 0o755))
	direct, throttled := open(srv.Endpoint), open(px.addr())

	t0 := time.Now()
	desc, err := layer.Build(ctx, direct, *rootfs)
	must(err)
	idx, err := layer.LoadChunkIndex(ctx, direct, desc.Digest, desc.Size)
	must(err)
	fmt.Printf("image: %s, one EROFS layer of %s (%d chunks of %d KiB; metadata %s in %d extents), built and stored in %s\n",
		*rootfs, mib(desc.Size), idx.Chunks(), idx.ChunkSize>>10, mib(idx.MetaBytes()), len(idx.Meta), time.Since(t0).Round(time.Second))
	fmt.Printf("store: SeaweedFS weed mini on loopback behind a proxy limited to %.0f Mbit/s (all connections together)\n", *mbit)
	fmt.Printf("burst: %d creates at once on a fresh node; first exec = chroot /bin/true, useful = python3 -c '%s'\n\n", *burst, pyCmd)
	fmt.Printf("%-14s %10s %10s %10s %10s %12s %12s %8s %8s %12s\n",
		"scenario", "exec p50", "exec max", "py p50", "py max", "fetched", "kernel read", "ratio", "touched", "node disk")

	// eager: the whole layer into the node's cache, then mounted.
	eagerNode := filepath.Join(dir, "eager")
	eagerCache := newCache(throttled, eagerNode)
	px.reset()
	r := runBurst(eagerNode, desc.Digest, *burst, func(ctx context.Context) (string, error) { return eagerCache.Fetch(ctx, desc.Digest) })
	r.fetched = px.bytes.Load()
	r.disk = du(filepath.Join(eagerNode, "blobcache"))
	r.print("eager", desc.Size, -1)

	// lazy, first run: records the prefetch list.
	lazyNode := filepath.Join(dir, "lazy")
	lz := newLazy(throttled, lazyNode)
	px.reset()
	r = runBurst(lazyNode, desc.Digest, *burst, func(ctx context.Context) (string, error) { return lz.Fetch(ctx, desc.Digest) })
	r.fetched = px.bytes.Load()
	st := lz.FS().Stats()
	r.disk = du(filepath.Join(lazyNode, "lazy", "chunks"))
	r.print("lazy", desc.Size, st.ReadBytes)
	fmt.Printf("%-14s %d range reads, mean %s each\n", "", st.Fetches, (st.FetchTime / time.Duration(max(st.Fetches, 1))).Round(time.Millisecond))
	must(lz.FS().SavePrefetch(ctx, desc.Digest))

	// lazy on another fresh node, with the list.
	preNode := filepath.Join(dir, "prefetch")
	lp := newLazy(throttled, preNode)
	px.reset()
	r = runBurst(preNode, desc.Digest, *burst, func(ctx context.Context) (string, error) { return lp.Fetch(ctx, desc.Digest) })
	r.fetched = px.bytes.Load()
	r.disk = du(filepath.Join(preNode, "lazy", "chunks"))
	r.print("lazy+prefetch", desc.Size, lp.FS().Stats().ReadBytes)
	must(lp.FS().Close())

	// Cold Python starts: fresh EROFS mounts; the lazy side on a restarted
	// loader over the first lazy node's chunk cache.
	must(lz.FS().Close())
	lzw := newLazy(throttled, lazyNode)
	local, err := eagerCache.Fetch(ctx, desc.Digest)
	must(err)
	px.reset()
	var lazyT, localT []time.Duration
	for range *colds {
		lazyT = append(lazyT, coldPython(filepath.Join(lazyNode, "cold"), desc.Digest, func() (string, error) { return lzw.Fetch(ctx, desc.Digest) }))
		localT = append(localT, coldPython(filepath.Join(eagerNode, "cold"), desc.Digest, func() (string, error) { return local, nil }))
	}
	fmt.Printf("\ncold python3 -c '%s' on a fresh EROFS mount, median of %d:\n", pyCmd, *colds)
	fmt.Printf("  lazy layer, chunks cached (restarted loader): %s   local layer file: %s   ratio %.2fx   fetched from the store meanwhile: %s\n",
		med(lazyT), med(localT), float64(med(lazyT))/float64(med(localT)), mib(px.bytes.Load()))
	must(lzw.FS().Close())
}

type result struct {
	exec, py []time.Duration
	fetched  int64
	disk     int64
}

func (r result) print(name string, size, kernel int64) {
	k, ratio := "-", "-"
	if kernel >= 0 {
		k = mib(kernel)
		ratio = fmt.Sprintf("%.2fx", float64(r.fetched)/float64(kernel))
	}
	fmt.Printf("%-14s %10s %10s %10s %10s %12s %12s %8s %7.1f%% %12s\n", name,
		med(r.exec), maxd(r.exec), med(r.py), maxd(r.py), mib(r.fetched), k, ratio,
		100*float64(r.fetched)/float64(size), mib(r.disk))
}

// runBurst runs n creates at once on a node: fetch (file of the layer),
// mount (shared), first exec, python.
func runBurst(node, digest string, n int, fetch func(context.Context) (string, error)) result {
	mounts, err := layer.NewMounts(filepath.Join(node, "layers"))
	must(err)
	defer mounts.Close()
	var (
		mu sync.Mutex
		r  result
		wg sync.WaitGroup
	)
	start := time.Now()
	for range n {
		wg.Go(func() {
			ctx := context.Background()
			p, err := fetch(ctx)
			must(err)
			dir, err := mounts.Acquire(ctx, digest, p)
			must(err)
			defer mounts.Release(digest)
			run(dir, "/bin/true")
			te := time.Since(start)
			run(dir, "/usr/bin/python3", "-c", pyCmd)
			tp := time.Since(start)
			mu.Lock()
			r.exec = append(r.exec, te)
			r.py = append(r.py, tp)
			mu.Unlock()
		})
	}
	wg.Wait()
	return r
}

// coldPython mounts the layer afresh and times one python start in it.
func coldPython(root, digest string, file func() (string, error)) time.Duration {
	mounts, err := layer.NewMounts(root)
	must(err)
	defer mounts.Close()
	p, err := file()
	must(err)
	dir, err := mounts.Acquire(context.Background(), digest, p)
	must(err)
	defer mounts.Release(digest)
	t := time.Now()
	run(dir, "/usr/bin/python3", "-c", pyCmd)
	return time.Since(t)
}

// run runs argv chrooted into root through the host's chroot(8), not
// SysProcAttr.Chroot: Go forks with vfork and the forking thread keeps its
// P until the child has exec'd, so a child exec'ing a binary from a lazy
// layer this process serves would, with GOMAXPROCS such forks at once,
// leave no P to serve the FUSE reads that exec waits for. The edge never
// does that: the sandboxes' own processes exec from layers, not the edge.
func run(root string, argv ...string) {
	cmd := exec.Command("/usr/sbin/chroot", append([]string{root}, argv...)...)
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8"}
	if out, err := cmd.CombinedOutput(); err != nil {
		log.Fatalf("chroot %s %v: %v: %s", root, argv, err, out)
	}
}

func newCache(remote *s3store.Store, node string) *blobstore.Cache {
	local, err := blobstore.NewDir(filepath.Join(node, "blobcache"))
	must(err)
	return blobstore.NewCache(remote, local)
}

func newLazy(remote *s3store.Store, node string) *lazyfs.Store {
	fs, err := lazyfs.Mount(lazyfs.Options{Remote: remote, Dir: filepath.Join(node, "lazy"), CacheBytes: 64 << 30})
	must(err)
	return lazyfs.NewStore(newCache(remote, node), fs, 0)
}

// proxy relays TCP to the store, all connections together limited to rate
// bytes per second (a token bucket with no burst), and counts the bytes
// the store sent.
type proxy struct {
	ln     net.Listener
	target string
	rate   float64
	mu     sync.Mutex
	next   time.Time
	bytes  atomic.Int64
}

func newProxy(target string, rate float64) *proxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(err)
	p := &proxy{ln: ln, target: target, rate: rate}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.relay(c)
		}
	}()
	return p
}

func (p *proxy) addr() string { return "http://" + p.ln.Addr().String() }
func (p *proxy) reset()       { p.bytes.Store(0) }

func (p *proxy) relay(c net.Conn) {
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	go func() { io.Copy(u, c); u.Close() }()
	buf := make([]byte, 64<<10)
	for {
		n, err := u.Read(buf)
		if n > 0 {
			p.wait(n)
			p.bytes.Add(int64(n))
			if _, werr := c.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	c.Close()
}

// wait delays n bytes by their share of the link.
func (p *proxy) wait(n int) {
	if p.rate <= 0 {
		return
	}
	p.mu.Lock()
	now := time.Now()
	if p.next.Before(now) {
		p.next = now
	}
	at := p.next
	p.next = p.next.Add(time.Duration(float64(n) / p.rate * float64(time.Second)))
	p.mu.Unlock()
	time.Sleep(time.Until(at))
}

func du(dir string) int64 {
	var n int64
	filepath.Walk(dir, func(_ string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() {
			n += info.Size()
		}
		return nil
	})
	return n
}

func med(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2].Round(time.Millisecond)
}

func maxd(d []time.Duration) time.Duration {
	m := time.Duration(0)
	for _, x := range d {
		m = max(m, x)
	}
	return m.Round(time.Millisecond)
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

func must(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
