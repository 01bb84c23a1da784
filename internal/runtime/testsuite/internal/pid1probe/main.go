// Command pid1probe changes another process's resource limit for the
// conformance suite's checks that a sandbox's workload cannot change its
// PID 1 (busybox has no prlimit applet):
//
//	pid1probe prlimit PID RES SOFT HARD   prlimit64(PID, RES, {SOFT, HARD})
//
// It prints "ok" or the error, and exits 0 either way (1 on bad usage).
// It uses raw system calls only, so it builds as a small static binary
// that runs in any sandbox of the host's architecture.
package main

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
	"unsafe"
)

func main() {
	if len(os.Args) != 6 || os.Args[1] != "prlimit" {
		fmt.Fprintln(os.Stderr, "usage: pid1probe prlimit PID RES SOFT HARD")
		os.Exit(1)
	}
	var v [4]uint64
	for i, a := range os.Args[2:] {
		n, err := strconv.ParseUint(a, 10, 64)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		v[i] = n
	}
	lim := [2]uint64{v[2], v[3]}
	_, _, e := syscall.RawSyscall6(syscall.SYS_PRLIMIT64, uintptr(v[0]), uintptr(v[1]), uintptr(unsafe.Pointer(&lim)), 0, 0, 0)
	if e != 0 {
		fmt.Println(e.Error())
		return
	}
	fmt.Println("ok")
}
