// Package filter holds a compiled seccomp program and installs it. It is
// the only part of the seccomp code linked into dsec-agent, so it depends on
// nothing but x/sys: the agent's memory is paid once per sandbox.
package filter

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Program is a compiled classic BPF seccomp filter for x86_64.
type Program []unix.SockFilter

// insnSize is the size of struct sock_filter.
const insnSize = 8

// MarshalBinary encodes p as the kernel lays out struct sock_filter on
// x86_64 (code, jt, jf, k; little endian), 8 bytes per instruction.
func (p Program) MarshalBinary() ([]byte, error) {
	b := make([]byte, len(p)*insnSize)
	for i, in := range p {
		o := b[i*insnSize:]
		binary.LittleEndian.PutUint16(o[0:], in.Code)
		o[2], o[3] = in.Jt, in.Jf
		binary.LittleEndian.PutUint32(o[4:], in.K)
	}
	return b, nil
}

// UnmarshalBinary decodes what MarshalBinary produced and checks its shape;
// the kernel verifies the rest when the program is installed.
func (p *Program) UnmarshalBinary(b []byte) error {
	if len(b)%insnSize != 0 {
		return fmt.Errorf("seccomp: program is %d bytes, not a multiple of %d", len(b), insnSize)
	}
	n := len(b) / insnSize
	out := make(Program, n)
	for i := range out {
		o := b[i*insnSize:]
		out[i] = unix.SockFilter{
			Code: binary.LittleEndian.Uint16(o[0:]),
			Jt:   o[2], Jf: o[3],
			K: binary.LittleEndian.Uint32(o[4:]),
		}
	}
	if err := out.validate(); err != nil {
		return err
	}
	*p = out
	return nil
}

func (p Program) validate() error {
	if len(p) == 0 {
		return errors.New("seccomp: empty program")
	}
	if len(p) > MaxInstructions {
		return fmt.Errorf("seccomp: program has %d instructions, over the kernel's limit of %d", len(p), MaxInstructions)
	}
	if last := p[len(p)-1].Code; last&0x07 != unix.BPF_RET {
		return fmt.Errorf("seccomp: program does not end in a return (last opcode %#x)", last)
	}
	return nil
}

// MaxInstructions is the kernel's limit on a classic BPF program.
const MaxInstructions = 4096

// ErrThreadSync means the kernel could not put the filter on every thread:
// some thread had a filter or no_new_privs state that diverged from the
// caller's (something installed a filter on one thread only).
var ErrThreadSync = errors.New("seccomp: a thread could not be synchronised to the filter (TSYNC)")

// Install puts p on every thread of the calling process; children forked
// afterwards inherit it and it can never be removed. The caller must have
// no_new_privs set (caps.Restrict sets it) or hold CAP_SYS_ADMIN.
func Install(p Program) error {
	if err := p.validate(); err != nil {
		return err
	}
	fprog := unix.SockFprog{Len: uint16(len(p)), Filter: &p[0]}
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(p)
	switch {
	case errno == unix.EACCES:
		return fmt.Errorf("seccomp: install filter: needs no_new_privs or CAP_SYS_ADMIN: %w", errno)
	case errno == unix.EINVAL:
		return fmt.Errorf("seccomp: install filter: kernel rejected the %d-instruction program: %w", len(p), errno)
	case errno != 0:
		return fmt.Errorf("seccomp: install filter: %w", errno)
	case r != 0:
		return fmt.Errorf("%w: thread %d", ErrThreadSync, r)
	}
	return nil
}
