package seccomp

import (
	"fmt"
	"log/slog"
	"slices"
	"sort"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/sys/unix"
)

// x32Bit marks x32-ABI syscall numbers (__X32_SYSCALL_BIT); they share
// AUDIT_ARCH_X86_64, so the arch check alone does not catch them.
const x32Bit = 0x40000000

// Offsets in struct seccomp_data (nr, arch, instruction_pointer, args[6]).
const (
	offNr   = 0
	offArch = 4
	offArgs = 16
)

// syscallNumbers maps x86_64 syscall names to numbers: go-seccomp-bpf's
// generated table, plus the syscalls newer than it.
var syscallNumbers = func() map[string]uint32 {
	m := make(map[string]uint32, len(arch.X86_64.SyscallNames)+8)
	for name, nr := range arch.X86_64.SyscallNames {
		m[name] = uint32(nr)
	}
	for name, nr := range map[string]uint32{
		"file_getattr":     unix.SYS_FILE_GETATTR,
		"file_setattr":     unix.SYS_FILE_SETATTR,
		"listns":           unix.SYS_LISTNS,
		"rseq_slice_yield": unix.SYS_RSEQ_SLICE_YIELD,
	} {
		if _, ok := m[name]; !ok {
			m[name] = nr
		}
	}
	return m
}()

// Compile turns a policy into a classic BPF program for x86_64 seccomp.
//
// Rules naming syscalls that x86_64 does not have (the Docker profile lists
// other architectures' calls, and calls newer than our table) are skipped,
// as libseccomp and runc do. The program:
//
//   - kills the process on any ABI but x86_64 (i386 via int 0x80), since the
//     syscall numbers would mean different calls;
//   - fails x32-ABI calls, and calls numbered above every syscall the policy
//     names, with ENOSYS, as a kernel without them would: C libraries probe
//     new syscalls and fall back on ENOSYS but not on EPERM (runc does the
//     same). If the default action is Allow, newer calls are allowed instead;
//   - finds the syscall by binary search over runs of numbers that share an
//     action, so a call costs about log2(runs) comparisons instead of a
//     linear scan of ~350 names;
//   - checks argument conditions, first matching rule wins, and falls back to
//     the default action.
func Compile(pol Policy) (Program, error) {
	p, skipped, err := compile(pol)
	if len(skipped) > 0 {
		slog.Debug("seccomp: skipped syscalls unknown on x86_64", "names", skipped)
	}
	return p, err
}

// handler is what the program does for one syscall number (or a run of
// numbers that share one plain action).
type handler struct {
	first, last uint32
	action      Action            // when code is nil
	code        []unix.SockFilter // argument checks, ending in a return
}

func compile(pol Policy) (Program, []string, error) {
	perNr := map[uint32][]Rule{}
	var skipped []string
	var maxNr uint32
	for _, r := range pol.Rules {
		nr, ok := syscallNumbers[r.Syscall]
		if !ok {
			if !slices.Contains(skipped, r.Syscall) {
				skipped = append(skipped, r.Syscall)
			}
			continue
		}
		for _, c := range r.Conds {
			if c.Arg < 0 || c.Arg > 5 {
				return nil, skipped, fmt.Errorf("seccomp: rule for %s: argument index %d out of range 0..5", r.Syscall, c.Arg)
			}
			if c.Op < OpEqual || c.Op > OpMaskedEqual {
				return nil, skipped, fmt.Errorf("seccomp: rule for %s: unknown comparison %d", r.Syscall, c.Op)
			}
		}
		perNr[nr] = append(perNr[nr], r)
		maxNr = max(maxNr, nr)
	}
	sort.Strings(skipped)
	if len(perNr) == 0 {
		return nil, skipped, fmt.Errorf("seccomp: policy names no x86_64 syscall")
	}

	var hs []handler
	add := func(h handler) {
		if n := len(hs); n > 0 && h.code == nil && hs[n-1].code == nil && hs[n-1].action == h.action && hs[n-1].last+1 == h.first {
			hs[n-1].last = h.last
			return
		}
		hs = append(hs, h)
	}
	for nr := uint32(0); nr <= maxNr; nr++ {
		h, err := syscallHandler(nr, perNr[nr], pol.DefaultAction)
		if err != nil {
			return nil, skipped, err
		}
		add(h)
	}
	newer := Errno(unix.ENOSYS)
	if pol.DefaultAction == Allow {
		newer = Allow
	}
	add(handler{first: maxNr + 1, last: x32Bit - 1, action: newer})
	add(handler{first: x32Bit, last: ^uint32(0), action: Errno(unix.ENOSYS)})

	prog := []unix.SockFilter{
		load(offArch),
		jump(unix.BPF_JEQ, unix.AUDIT_ARCH_X86_64, 1, 0),
		ret(KillProcess),
		load(offNr),
	}
	prog = append(prog, tree(hs)...)
	if len(prog) > MaxInstructions {
		return nil, skipped, fmt.Errorf("seccomp: program has %d instructions, over the kernel's limit of %d", len(prog), MaxInstructions)
	}
	return Program(prog), skipped, nil
}

// syscallHandler compiles the rules of one syscall. A rule without
// conditions ends the chain: later rules for the same call cannot match.
func syscallHandler(nr uint32, rules []Rule, def Action) (handler, error) {
	h := handler{first: nr, last: nr, action: def}
	if len(rules) == 0 {
		return h, nil
	}
	if len(rules[0].Conds) == 0 {
		h.action = rules[0].Action
		return h, nil
	}
	var code []unix.SockFilter
	for _, r := range rules {
		if len(r.Conds) == 0 {
			code = append(code, ret(r.Action))
			h.code = code
			return h, nil
		}
		block, err := ruleBlock(r)
		if err != nil {
			return h, err
		}
		code = append(code, block...)
	}
	h.code = append(code, ret(def))
	return h, nil
}

// tree emits a binary search over handlers that together cover every
// 32-bit syscall number, in order. The accumulator holds the number. Each
// subtree is self-contained (its leaves return), so it can be placed
// anywhere and only the jump over the left half needs a long form when the
// left half is longer than a conditional jump reaches (255 instructions).
func tree(hs []handler) []unix.SockFilter {
	if len(hs) == 1 {
		if hs[0].code != nil {
			return hs[0].code
		}
		return []unix.SockFilter{ret(hs[0].action)}
	}
	mid := len(hs) / 2
	left, right := tree(hs[:mid]), tree(hs[mid:])
	pivot := hs[mid].first
	out := make([]unix.SockFilter, 0, len(left)+len(right)+2)
	if len(left) <= 255 {
		out = append(out, jump(unix.BPF_JGE, pivot, uint8(len(left)), 0))
	} else {
		out = append(out,
			jump(unix.BPF_JGE, pivot, 0, 1),
			unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JA, K: uint32(len(left))})
	}
	out = append(out, left...)
	return append(out, right...)
}

// insn is an instruction whose jump targets may be "fail": the end of the
// rule block, where the next rule starts.
type insn struct {
	f              unix.SockFilter
	jtFail, jfFail bool
}

// ruleBlock emits: the conditions, each falling through when it holds and
// jumping past the block when it does not, then the rule's return.
func ruleBlock(r Rule) ([]unix.SockFilter, error) {
	var b []insn
	for _, c := range r.Conds {
		b = append(b, condCode(c)...)
	}
	b = append(b, insn{f: ret(r.Action)})
	out := make([]unix.SockFilter, len(b))
	for i, in := range b {
		f := in.f
		dist := len(b) - (i + 1)
		if (in.jtFail || in.jfFail) && dist > 255 {
			return nil, fmt.Errorf("seccomp: rule for %s has too many conditions", r.Syscall)
		}
		if in.jtFail {
			f.Jt = uint8(dist)
		}
		if in.jfFail {
			f.Jf = uint8(dist)
		}
		out[i] = f
	}
	return out, nil
}

// condCode tests one 64-bit argument with 32-bit BPF: the high word decides
// unless it equals the value's high word, then the low word decides.
// Jumps given as numbers are relative and stay inside the condition; a
// jump to "fail" leaves the rule; falling off the end means the condition
// holds.
func condCode(c Cond) []insn {
	lo := load(uint32(offArgs + 8*c.Arg))
	hi := load(uint32(offArgs + 8*c.Arg + 4))
	vlo, vhi := uint32(c.Value), uint32(c.Value>>32)
	j := func(op uint16, k uint32, jt, jf uint8) unix.SockFilter { return jump(op, k, jt, jf) }
	failF := func(f unix.SockFilter) insn { return insn{f: f, jfFail: true} }
	failT := func(f unix.SockFilter) insn { return insn{f: f, jtFail: true} }

	if c.Low32 {
		switch c.Op {
		case OpEqual:
			return []insn{{f: lo}, failF(j(unix.BPF_JEQ, vlo, 0, 0))}
		case OpNotEqual:
			return []insn{{f: lo}, failT(j(unix.BPF_JEQ, vlo, 0, 0))}
		case OpLess:
			return []insn{{f: lo}, failT(j(unix.BPF_JGE, vlo, 0, 0))}
		case OpLessEqual:
			return []insn{{f: lo}, failT(j(unix.BPF_JGT, vlo, 0, 0))}
		case OpGreater:
			return []insn{{f: lo}, failF(j(unix.BPF_JGT, vlo, 0, 0))}
		case OpGreaterEqual:
			return []insn{{f: lo}, failF(j(unix.BPF_JGE, vlo, 0, 0))}
		case OpMaskedEqual:
			return []insn{{f: lo}, {f: alu(unix.BPF_AND, vlo)}, failF(j(unix.BPF_JEQ, uint32(c.ValueTwo), 0, 0))}
		}
	}

	switch c.Op {
	case OpEqual:
		return []insn{{f: hi}, failF(j(unix.BPF_JEQ, vhi, 0, 0)), {f: lo}, failF(j(unix.BPF_JEQ, vlo, 0, 0))}
	case OpNotEqual:
		// Holds if either word differs.
		return []insn{{f: hi}, {f: j(unix.BPF_JEQ, vhi, 0, 2)}, {f: lo}, failT(j(unix.BPF_JEQ, vlo, 0, 0))}
	case OpGreater, OpGreaterEqual:
		last := uint16(unix.BPF_JGT)
		if c.Op == OpGreaterEqual {
			last = unix.BPF_JGE
		}
		return []insn{
			{f: hi},
			{f: j(unix.BPF_JGT, vhi, 3, 0)}, // high word above: holds
			failF(j(unix.BPF_JEQ, vhi, 0, 0)),
			{f: lo},
			failF(j(last, vlo, 0, 0)),
		}
	case OpLess, OpLessEqual:
		last := uint16(unix.BPF_JGE)
		if c.Op == OpLessEqual {
			last = unix.BPF_JGT
		}
		return []insn{
			{f: hi},
			{f: j(unix.BPF_JGE, vhi, 0, 3)}, // high word below: holds
			failF(j(unix.BPF_JEQ, vhi, 0, 0)),
			{f: lo},
			failT(j(last, vlo, 0, 0)),
		}
	case OpMaskedEqual:
		mlo, mhi := uint32(c.Value), uint32(c.Value>>32)
		wlo, whi := uint32(c.ValueTwo), uint32(c.ValueTwo>>32)
		return []insn{
			{f: hi}, {f: alu(unix.BPF_AND, mhi)}, failF(j(unix.BPF_JEQ, whi, 0, 0)),
			{f: lo}, {f: alu(unix.BPF_AND, mlo)}, failF(j(unix.BPF_JEQ, wlo, 0, 0)),
		}
	}
	panic(fmt.Sprintf("seccomp: comparison %d not validated", c.Op))
}

func load(off uint32) unix.SockFilter {
	return unix.SockFilter{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: off}
}

func jump(op uint16, k uint32, jt, jf uint8) unix.SockFilter {
	return unix.SockFilter{Code: unix.BPF_JMP | op | unix.BPF_K, Jt: jt, Jf: jf, K: k}
}

func alu(op uint16, k uint32) unix.SockFilter {
	return unix.SockFilter{Code: unix.BPF_ALU | op | unix.BPF_K, K: k}
}

func ret(a Action) unix.SockFilter {
	return unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: uint32(a)}
}
