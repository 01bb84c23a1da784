// Command reclaimbench compares the ways cgroup v1 offers to take memory
// back from idle sandboxes first, on a node bounded by a memory cgroup
// with a swap file: what the container backend's idle reclaim (issue 14)
// was chosen from.
//
// Each round, per mechanism: a parent memory cgroup limited to -node holds
// -idle children, each with a process holding -hold MiB of touched
// anonymous memory (the idle sandboxes), then the mechanism runs on the
// idle children (timed), then -active children each touch -touch MiB at
// once (the burst of active sandboxes; together more than the parent has
// left, so something must go to swap), timed until every one has touched
// all of it. Reported: the mechanism's time and what it moved to swap,
// the burst's time, and where the swap came from (idle or active
// children) once the burst is in.
//
//	kernel      nothing: the parent's limit reclaim picks (the baseline)
//	softlimit   idle children's memory.soft_limit_in_bytes = 0
//	limit       idle children's memory.limit_in_bytes lowered to 0 and put back
//	            (the kernel reclaims until it cannot; what the backend does)
//	force_empty memory.force_empty written in each idle child
//	pageout     process_madvise(MADV_PAGEOUT) over every mapping of each idle process
//
// Usage (as root; it makes and removes its own swap file and cgroups):
//
//	go run ./bench/reclaimbench [-node 256m] [-swap 256m] [-idle 4] [-hold 48] [-active 2] [-touch 64] [-rounds 3]
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/swap"
)

const memRoot = "/sys/fs/cgroup/memory"

func main() {
	holdMiB := flag.Int("holder", 0, "internal: hold this many MiB of touched memory")
	nodeMiB := flag.Int("node", 256, "the parent cgroup's memory limit, MiB")
	swapMiB := flag.Int("swap", 256, "swap file size, MiB")
	idle := flag.Int("idle", 4, "idle children")
	hold := flag.Int("hold", 48, "MiB each idle child holds")
	active := flag.Int("active", 2, "active children in the burst")
	touch := flag.Int("touch", 64, "MiB each active child touches")
	rounds := flag.Int("rounds", 3, "rounds (every mechanism once per round)")
	mechs := flag.String("mechanisms", "kernel,softlimit,limit,force_empty,pageout", "mechanisms to compare")
	flag.Parse()
	if *holdMiB > 0 {
		holder(*holdMiB)
		return
	}
	if err := run(*nodeMiB, *swapMiB, *idle, *hold, *active, *touch, *rounds, strings.Split(*mechs, ",")); err != nil {
		fmt.Fprintln(os.Stderr, "reclaimbench:", err)
		os.Exit(1)
	}
}

// holder waits for a line on stdin (it has been moved into its cgroup),
// touches n MiB, says "ready", and waits for stdin to close.
func holder(n int) {
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		os.Exit(1)
	}
	b, err := unix.Mmap(-1, 0, n<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		fmt.Println("mmap:", err)
		os.Exit(1)
	}
	for i := 0; i < len(b); i += 4096 {
		b[i] = byte(i>>12) | 1
	}
	fmt.Println("ready")
	io.Copy(io.Discard, in)
	runtimeKeep(b)
}

//go:noinline
func runtimeKeep(b []byte) { _ = b[0] }

type child struct {
	dir string
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

// start runs a holder of mib MiB in a new child cgroup dir of parent and
// returns once it is in there (it touches its memory after "go").
func start(parent, name string, mib int) (*child, error) {
	dir := filepath.Join(parent, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	// Each child may hold all it touches, in RAM or swap together, as a
	// sandbox's limit (memsw = limit) allows.
	lim := strconv.Itoa((mib + 32) << 20)
	if err := writeAll(dir, "memory.limit_in_bytes", lim, "memory.memsw.limit_in_bytes", lim); err != nil {
		return nil, err
	}
	self, _ := os.Executable()
	cmd := exec.Command(self, "-holder", strconv.Itoa(mib))
	in, _ := cmd.StdinPipe()
	outPipe, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{dir: dir, cmd: cmd, in: in, out: bufio.NewReader(outPipe)}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
		c.stop()
		return nil, err
	}
	return c, nil
}

func (c *child) touch() error {
	if _, err := io.WriteString(c.in, "go\n"); err != nil {
		return err
	}
	line, err := c.out.ReadString('\n')
	if err != nil || line != "ready\n" {
		return fmt.Errorf("holder: %q %v", line, err)
	}
	return nil
}

func (c *child) stop() {
	c.in.Close()
	c.cmd.Process.Kill()
	c.cmd.Wait()
	for i := 0; i < 100 && os.Remove(c.dir) != nil; i++ {
		time.Sleep(10 * time.Millisecond) // the charge of a dying process goes away asynchronously
	}
}

func writeAll(dir string, kv ...string) error {
	for i := 0; i < len(kv); i += 2 {
		if err := os.WriteFile(filepath.Join(dir, kv[i]), []byte(kv[i+1]), 0); err != nil {
			return fmt.Errorf("%s=%s: %w", kv[i], kv[i+1], err)
		}
	}
	return nil
}

// stat returns key of dir's memory.stat, in bytes.
func stat(dir, key string) int64 {
	b, _ := os.ReadFile(filepath.Join(dir, "memory.stat"))
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

type result struct {
	reclaim      time.Duration // the mechanism, over all idle children
	moved        int64         // swap of the idle children after it
	burst        time.Duration
	idleSwap     int64 // after the burst
	activeSwap   int64
	activeResMiB int64
	oom          bool
}

func run(nodeMiB, swapMiB, idle, hold, active, touch, rounds int, mechs []string) error {
	if os.Geteuid() != 0 {
		return errors.New("must run as root")
	}
	if _, err := os.Stat(filepath.Join(memRoot, "memory.memsw.limit_in_bytes")); err != nil {
		return fmt.Errorf("needs cgroup v1 memory with swap accounting: %w", err)
	}
	tmp, err := os.MkdirTemp("/var/tmp", "reclaimbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	area, err := swap.Open(swap.Options{File: filepath.Join(tmp, "swap.img"), Size: int64(swapMiB) << 20})
	if err != nil {
		return err
	}
	defer area.Close()
	parent := filepath.Join(memRoot, fmt.Sprintf("dsec-reclaimbench-%d", os.Getpid()))
	if err := os.Mkdir(parent, 0o755); err != nil {
		return err
	}
	defer os.Remove(parent)
	if err := writeAll(parent, "memory.limit_in_bytes", strconv.Itoa(nodeMiB<<20)); err != nil {
		return err
	}
	fmt.Printf("node %d MiB, swap %d MiB; %d idle x %d MiB, then %d active x %d MiB at once\n\n",
		nodeMiB, swapMiB, idle, hold, active, touch)
	all := map[string][]result{}
	for r := 0; r < rounds; r++ {
		for _, m := range mechs {
			res, err := round(parent, m, idle, hold, active, touch)
			if err != nil {
				return fmt.Errorf("%s: %w", m, err)
			}
			all[m] = append(all[m], res)
		}
	}
	fmt.Println("| mechanism | its time, ms (all idle children) | idle MiB moved to swap by it | burst, ms | swap after the burst: idle MiB | active MiB | OOM |")
	fmt.Println("|---|---|---|---|---|---|---|")
	for _, m := range mechs {
		rs := all[m]
		col := func(f func(result) string) string {
			var s []string
			for _, r := range rs {
				s = append(s, f(r))
			}
			return strings.Join(s, " / ")
		}
		fmt.Printf("| %s | %s | %s | %s | %s | %s | %s |\n", m,
			col(func(r result) string { return fmt.Sprintf("%.0f", float64(r.reclaim.Microseconds())/1000) }),
			col(func(r result) string { return strconv.FormatInt(r.moved>>20, 10) }),
			col(func(r result) string { return fmt.Sprintf("%.0f", float64(r.burst.Microseconds())/1000) }),
			col(func(r result) string { return strconv.FormatInt(r.idleSwap>>20, 10) }),
			col(func(r result) string { return strconv.FormatInt(r.activeSwap>>20, 10) }),
			col(func(r result) string { return strconv.FormatBool(r.oom) }))
	}
	return nil
}

func round(parent, mech string, idle, hold, active, touch int) (res result, err error) {
	var idles, actives []*child
	defer func() {
		for _, c := range append(idles, actives...) {
			c.stop()
		}
	}()
	for i := 0; i < idle; i++ {
		c, err := start(parent, fmt.Sprintf("idle%d", i), hold)
		if err != nil {
			return res, err
		}
		idles = append(idles, c)
		if err := c.touch(); err != nil {
			return res, err
		}
	}
	t0 := time.Now()
	for _, c := range idles {
		if err := reclaim(mech, c); err != nil {
			return res, err
		}
	}
	res.reclaim = time.Since(t0)
	for _, c := range idles {
		res.moved += stat(c.dir, "swap")
	}
	for i := 0; i < active; i++ {
		c, err := start(parent, fmt.Sprintf("active%d", i), touch)
		if err != nil {
			return res, err
		}
		actives = append(actives, c)
	}
	t0 = time.Now()
	errs := make(chan error, active)
	for _, c := range actives {
		go func() { errs <- c.touch() }()
	}
	for range actives {
		if err := <-errs; err != nil {
			res.oom = true
		}
	}
	res.burst = time.Since(t0)
	for _, c := range idles {
		res.idleSwap += stat(c.dir, "swap")
		if !alive(c) {
			res.oom = true
		}
	}
	for _, c := range actives {
		res.activeSwap += stat(c.dir, "swap")
	}
	return res, nil
}

func alive(c *child) bool { return c.cmd.Process.Signal(syscall.Signal(0)) == nil }

func reclaim(mech string, c *child) error {
	switch mech {
	case "kernel":
		return nil
	case "softlimit":
		return writeAll(c.dir, "memory.soft_limit_in_bytes", "0")
	case "limit":
		lim, err := os.ReadFile(filepath.Join(c.dir, "memory.limit_in_bytes"))
		if err != nil {
			return err
		}
		// EBUSY: it could not get down to 0, having taken what it could.
		if err := writeAll(c.dir, "memory.limit_in_bytes", "0"); err != nil && !errors.Is(err, unix.EBUSY) {
			return err
		}
		return writeAll(c.dir, "memory.limit_in_bytes", strings.TrimSpace(string(lim)))
	case "force_empty":
		return writeAll(c.dir, "memory.force_empty", "0")
	case "pageout":
		return pageout(c.cmd.Process.Pid)
	}
	return fmt.Errorf("unknown mechanism %q", mech)
}

// pageout advises MADV_PAGEOUT over every mapping of pid.
func pageout(pid int) error {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return err
	}
	defer unix.Close(pidfd)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return err
	}
	// struct iovec {base, len} pairs, addresses in pid's address space.
	var iov [][2]uint64
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		rng, _, _ := strings.Cut(line, " ")
		lo, hi, _ := strings.Cut(rng, "-")
		a, _ := strconv.ParseUint(lo, 16, 64)
		z, _ := strconv.ParseUint(hi, 16, 64)
		// The kernel's special mappings make the whole call fail (EINVAL).
		if strings.HasSuffix(line, "[vsyscall]") || strings.HasSuffix(line, "[vvar]") ||
			strings.HasSuffix(line, "[vvar_vclock]") || strings.HasSuffix(line, "[vdso]") || z <= a {
			continue
		}
		iov = append(iov, [2]uint64{a, z - a})
	}
	for c := range slices.Chunk(iov, 1024) {
		n, _, e := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pidfd), uintptr(unsafe.Pointer(&c[0])), uintptr(len(c)), unix.MADV_PAGEOUT, 0, 0)
		var want uint64
		for _, v := range c {
			want += v[1]
		}
		if e == 0 && uint64(n) < want {
			return fmt.Errorf("process_madvise advised %d of %d bytes", n, want)
		}
		if e != 0 {
			return fmt.Errorf("process_madvise: %w", e)
		}
	}
	return nil
}
