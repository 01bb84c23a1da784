package microvm_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cavaliergopher/cpio"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/microvm"
	"github.com/dsec-dev/dsec/internal/runtime/qemu"
)

// floorInitrd writes an initramfs whose /init is a busybox shell script
// that prints and powers the guest off: the floor of a create (the same
// QEMU, kernel and devices, no agent and no sandbox set-up).
func floorInitrd(b *testing.B) string {
	b.Helper()
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		b.Skipf("busybox-static: %v", err)
	}
	path := filepath.Join(b.TempDir(), "floor.cpio")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	w := cpio.NewWriter(f)
	add := func(name string, mode cpio.FileMode, data []byte) {
		if err := w.WriteHeader(&cpio.Header{Name: name, Mode: mode, Size: int64(len(data)), Links: 1}); err != nil {
			b.Fatal(err)
		}
		if _, err := w.Write(data); err != nil {
			b.Fatal(err)
		}
	}
	for _, d := range []string{"bin", "dev", "proc"} {
		if err := w.WriteHeader(&cpio.Header{Name: d, Mode: cpio.TypeDir | 0o755, Links: 2}); err != nil {
			b.Fatal(err)
		}
	}
	add("bin/busybox", cpio.TypeReg|0o755, bb)
	add("init", cpio.TypeReg|0o755, []byte("#!/bin/busybox sh\n/bin/busybox echo ready\n/bin/busybox poweroff -f\n"))
	if err := w.Close(); err != nil {
		b.Fatal(err)
	}
	f.Close()
	return path
}

// BenchmarkCreateFirstExec: create → first exec result, against the floor
// (the same QEMU and kernel booting a trivial /init to power-off), run
// one after the other in the same run; ratio = create / floor.
func BenchmarkCreateFirstExec(b *testing.B) {
	e := newEnv(b, func(o *microvm.Options) { o.Console = false })
	ctx := context.Background()
	initrd := floorInitrd(b)
	var create, floor time.Duration
	for i := 0; b.Loop(); i++ {
		// Floor.
		dir, err := os.MkdirTemp(e.root, "f")
		if err != nil {
			b.Fatal(err)
		}
		spec := rt.Spec{ID: "floor", Layers: []rt.Layer{e.layer}, Resources: rt.Resources{MemoryBytes: 128 << 20}}
		t0 := time.Now()
		cfg, err := e.backend.FloorConfig(ctx, dir, spec, filepath.Join(dir, "rw.img"))
		if err != nil {
			b.Fatal(err)
		}
		cfg.Initrd = initrd
		vm, err := qemu.Start(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		<-vm.Done()
		floor += time.Since(t0)
		vm.Kill()
		os.RemoveAll(dir)

		// Create → first exec.
		t0 = time.Now()
		sb, err := e.backend.Create(ctx, rt.Spec{ID: fmt.Sprintf("b%d", i), Layers: []rt.Layer{e.layer}, Resources: rt.Resources{MemoryBytes: 128 << 20}})
		if err != nil {
			b.Fatal(err)
		}
		res, err := sb.Exec(ctx, rt.ExecRequest{Argv: []string{"echo", "ready"}}, nil)
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("exec: %+v %v", res, err)
		}
		create += time.Since(t0)
		sb.Destroy(ctx)
	}
	n := float64(b.N)
	b.ReportMetric(float64(create.Milliseconds())/n, "create-ms")
	b.ReportMetric(float64(floor.Milliseconds())/n, "floor-ms")
	b.ReportMetric(float64(create)/float64(floor), "ratio")
}

// BenchmarkCreateParallel: creates (to a first exec result) per second
// with 4 and 16 in flight.
func BenchmarkCreateParallel(b *testing.B) {
	// 16 TCG guests booting at once on two cores take minutes.
	e := newEnv(b, func(o *microvm.Options) { o.Console = false; o.BootTimeout = 10 * time.Minute })
	for _, inFlight := range []int{4, 16} {
		b.Run(strconv.Itoa(inFlight), func(b *testing.B) {
			ctx := context.Background()
			var total time.Duration
			var n int
			for b.Loop() {
				t0 := time.Now()
				var wg sync.WaitGroup
				errs := make(chan error, inFlight)
				for i := 0; i < inFlight; i++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						id := fmt.Sprintf("p%d-%d", inFlight, int(e.n.Add(1)))
						sb, err := e.backend.Create(ctx, rt.Spec{ID: id, Layers: []rt.Layer{e.layer}, Resources: rt.Resources{MemoryBytes: 128 << 20}})
						if err != nil {
							errs <- err
							return
						}
						defer sb.Destroy(ctx)
						if _, err := sb.Exec(ctx, rt.ExecRequest{Argv: []string{"true"}}, nil); err != nil {
							errs <- err
						}
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					b.Fatal(err)
				}
				total += time.Since(t0)
				n += inFlight
			}
			b.ReportMetric(float64(n)/total.Seconds(), "creates/s")
		})
	}
}

// smaps reads Rss and Pss (KiB) of pid from smaps_rollup.
func smaps(b *testing.B, pid int) (rss, pss int64) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		v, _ := strconv.ParseInt(fields[1], 10, 64)
		switch fields[0] {
		case "Rss:":
			rss = v
		case "Pss:":
			pss = v
		}
	}
	return rss, pss
}

// idleMemory boots n guests of memBytes on layers, has each run script,
// lets them settle, and returns the QEMU processes' mean and total RSS
// and PSS in MiB.
func idleMemory(b *testing.B, e *env, n int, memBytes int64, layers []rt.Layer, script string) (meanRSS, meanPSS, totalPSS float64) {
	return idleMemoryHook(b, e, n, memBytes, layers, script, nil)
}

// idleMemoryHook is idleMemory calling measured (if set) while every
// guest is up and idle.
func idleMemoryHook(b *testing.B, e *env, n int, memBytes int64, layers []rt.Layer, script string, measured func()) (meanRSS, meanPSS, totalPSS float64) {
	ctx := context.Background()
	var sbs []rt.Sandbox
	defer func() {
		for _, sb := range sbs {
			sb.Destroy(ctx)
		}
	}()
	for i := 0; i < n; i++ {
		sb, err := e.backend.Create(ctx, rt.Spec{ID: fmt.Sprintf("m%d", e.n.Add(1)), Layers: layers, Resources: rt.Resources{MemoryBytes: memBytes}})
		if err != nil {
			b.Fatal(err)
		}
		sbs = append(sbs, sb)
		if res, err := sb.Exec(ctx, rt.ExecRequest{Shell: script}, nil); err != nil || res.ExitCode != 0 {
			b.Fatalf("exec: %+v %v", res, err)
		}
	}
	// Idle: the agent releases its heap after 10 s; free-page reporting
	// hands freed guest pages back in the seconds after.
	time.Sleep(15 * time.Second)
	if measured != nil {
		measured()
	}
	var rss, pss int64
	for _, sb := range sbs {
		r, p := smaps(b, microvm.QEMUPid(sb))
		rss += r
		pss += p
	}
	return float64(rss) / 1024 / float64(n), float64(pss) / 1024 / float64(n), float64(pss) / 1024
}

// BenchmarkIdleMemory: host memory (the QEMU process's RSS and PSS) per
// idle microVM with a 128 MiB guest, 4 guests booted.
func BenchmarkIdleMemory(b *testing.B) {
	e := newEnv(b, func(o *microvm.Options) { o.Console = false })
	for b.Loop() {
		rss, pss, _ := idleMemory(b, e, 4, 128<<20, []rt.Layer{e.layer}, "true")
		b.ReportMetric(rss, "rss-MiB/vm")
		b.ReportMetric(pss, "pss-MiB/vm")
	}
}

// memAvailable is the host's MemAvailable in MiB.
func memAvailable(b *testing.B) float64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemAvailable:"); ok {
			kb, _ := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			return float64(kb) / 1024
		}
	}
	return 0
}

// BenchmarkDAX: N guests (20; DSEC_BENCH_DAX_N) on one image whose layer
// holds 48 MiB of data every guest reads, on -M q35 with the layer as
// virtio-pmem + DAX against virtio-blk: the QEMU processes' total PSS and
// the drop of the host's MemAvailable with all of them up (peak host
// memory). QEMU 7.2's microvm cannot take virtio-pmem, hence q35 for both.
func BenchmarkDAX(b *testing.B) {
	n := 20
	if v, err := strconv.Atoi(os.Getenv("DSEC_BENCH_DAX_N")); err == nil && v > 0 {
		n = v
	}
	rootfs := testsuiteBusybox(b)
	data := make([]byte, 48<<20)
	for i := range data {
		data[i] = byte(i*7 + i>>9)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "data.bin"), data, 0o644); err != nil {
		b.Fatal(err)
	}
	results := map[bool][2]float64{}
	for _, dax := range []bool{false, true} {
		e := newEnvRootfs(b, rootfs, func(o *microvm.Options) {
			o.Console = false
			o.Machine = "q35"
			o.DAX = dax
			o.BootTimeout = 10 * time.Minute
		})
		// Not b.Loop: it may run once per benchmark, and each mode needs
		// its own loop.
		for range b.N {
			before := memAvailable(b)
			var drop float64
			_, _, total := idleMemoryHook(b, e, n, 256<<20, []rt.Layer{e.layer}, "cat /data.bin > /dev/null", func() {
				drop = before - memAvailable(b)
			})
			results[dax] = [2]float64{total, drop}
		}
	}
	b.ReportMetric(results[false][0], "pss-total-MiB-blk")
	b.ReportMetric(results[true][0], "pss-total-MiB-dax")
	b.ReportMetric(results[false][1], "host-used-MiB-blk")
	b.ReportMetric(results[true][1], "host-used-MiB-dax")
	if results[false][1] > 0 {
		b.ReportMetric(100*(results[false][1]-results[true][1])/results[false][1], "host-saving-%")
	}
}
