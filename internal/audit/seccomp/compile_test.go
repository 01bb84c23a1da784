package seccomp

import (
	"fmt"
	"slices"
	"testing"

	mobyseccomp "github.com/moby/profiles/seccomp"
	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/audit/caps"
)

// input is struct seccomp_data as the filter sees it.
type input struct {
	nr   uint32
	arch uint32
	args [6]uint64
}

func (in input) word(off uint32) (uint32, error) {
	switch {
	case off%4 != 0 || off >= 64:
		return 0, fmt.Errorf("load from bad offset %d", off)
	case off == offNr:
		return in.nr, nil
	case off == offArch:
		return in.arch, nil
	case off < offArgs:
		return 0, nil // instruction pointer
	}
	a := in.args[(off-offArgs)/8]
	if (off-offArgs)%8 == 0 {
		return uint32(a), nil
	}
	return uint32(a >> 32), nil
}

// run interprets the subset of classic BPF the compiler emits, as the
// kernel would, so every syscall and argument can be checked without
// installing anything.
func run(p Program, in input) (Action, error) {
	var a uint32
	for pc := 0; pc < len(p); pc++ {
		f := p[pc]
		switch f.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS:
			w, err := in.word(f.K)
			if err != nil {
				return 0, fmt.Errorf("pc %d: %w", pc, err)
			}
			a = w
		case unix.BPF_ALU | unix.BPF_AND | unix.BPF_K:
			a &= f.K
		case unix.BPF_RET | unix.BPF_K:
			return Action(f.K), nil
		case unix.BPF_JMP | unix.BPF_JA:
			pc += int(f.K)
		case unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K,
			unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K:
			var ok bool
			switch f.Code &^ (unix.BPF_JMP | unix.BPF_K) {
			case unix.BPF_JEQ:
				ok = a == f.K
			case unix.BPF_JGT:
				ok = a > f.K
			case unix.BPF_JGE:
				ok = a >= f.K
			case unix.BPF_JSET:
				ok = a&f.K != 0
			}
			if ok {
				pc += int(f.Jt)
			} else {
				pc += int(f.Jf)
			}
		default:
			return 0, fmt.Errorf("pc %d: unexpected opcode %#x", pc, f.Code)
		}
	}
	return 0, fmt.Errorf("fell off the end of the program")
}

// expect evaluates a policy directly: the meaning Compile must preserve.
func expect(pol Policy, in input) Action {
	if in.arch != unix.AUDIT_ARCH_X86_64 {
		return KillProcess
	}
	if in.nr >= x32Bit {
		return Errno(unix.ENOSYS)
	}
	var maxNr uint32
	for _, r := range pol.Rules {
		if nr, ok := syscallNumbers[r.Syscall]; ok {
			maxNr = max(maxNr, nr)
		}
	}
	if in.nr > maxNr {
		if pol.DefaultAction == Allow {
			return Allow
		}
		return Errno(unix.ENOSYS)
	}
	for _, r := range pol.Rules {
		if nr, ok := syscallNumbers[r.Syscall]; !ok || nr != in.nr {
			continue
		}
		if slices.IndexFunc(r.Conds, func(c Cond) bool { return !holds(c, in.args[c.Arg]) }) < 0 {
			return r.Action
		}
	}
	return pol.DefaultAction
}

func holds(c Cond, arg uint64) bool {
	v, v2 := c.Value, c.ValueTwo
	if c.Low32 {
		arg, v, v2 = arg&0xffffffff, v&0xffffffff, v2&0xffffffff
	}
	switch c.Op {
	case OpEqual:
		return arg == v
	case OpNotEqual:
		return arg != v
	case OpLess:
		return arg < v
	case OpLessEqual:
		return arg <= v
	case OpGreater:
		return arg > v
	case OpGreaterEqual:
		return arg >= v
	case OpMaskedEqual:
		return arg&v == v2
	}
	return false
}

// inputs lists syscall inputs that exercise every rule of pol: each
// syscall with zero arguments, and for each condition its value, the
// neighbours, and the value with the high word changed.
func inputs(pol Policy) []input {
	var ins []input
	for nr := uint32(0); nr < 520; nr++ {
		ins = append(ins, input{nr: nr, arch: unix.AUDIT_ARCH_X86_64})
	}
	for _, nr := range []uint32{x32Bit - 1, x32Bit, x32Bit | unix.SYS_MOUNT, x32Bit | unix.SYS_GETPID, ^uint32(0)} {
		ins = append(ins, input{nr: nr, arch: unix.AUDIT_ARCH_X86_64})
	}
	ins = append(ins, input{nr: unix.SYS_GETPID, arch: unix.AUDIT_ARCH_I386}, input{nr: unix.SYS_GETPID, arch: 0})
	for _, r := range pol.Rules {
		nr, ok := syscallNumbers[r.Syscall]
		if !ok {
			continue
		}
		for _, c := range r.Conds {
			for _, v := range []uint64{c.Value, c.Value - 1, c.Value + 1, c.Value | 1<<32, c.Value ^ 1<<63, c.ValueTwo, c.ValueTwo | c.Value, 0, ^uint64(0)} {
				in := input{nr: nr, arch: unix.AUDIT_ARCH_X86_64}
				in.args[c.Arg] = v
				ins = append(ins, in)
			}
		}
	}
	return ins
}

func checkProgram(t *testing.T, pol Policy, p Program) {
	t.Helper()
	bad := 0
	for _, in := range inputs(pol) {
		got, err := run(p, in)
		if err != nil {
			t.Fatalf("nr %d args %x: %v", in.nr, in.args, err)
		}
		if want := expect(pol, in); got != want {
			bad++
			if bad <= 20 {
				t.Errorf("nr %d arch %#x args %x: program says %v, policy says %v", in.nr, in.arch, in.args, got, want)
			}
		}
	}
}

func TestDefaultProgram(t *testing.T) {
	pol, err := DefaultPolicy()
	if err != nil {
		t.Fatal(err)
	}
	p, skipped, err := compile(pol)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("default filter: %d instructions, %d rules; skipped names unknown on x86_64: %v", len(p), len(pol.Rules), skipped)
	if len(p) > MaxInstructions || len(p) < 100 {
		t.Errorf("default filter has %d instructions, want 100..%d", len(p), MaxInstructions)
	}
	for _, name := range []string{"read", "ioctl", "clone", "socket", "personality"} {
		if slices.Contains(skipped, name) {
			t.Errorf("syscall %s was skipped as unknown", name)
		}
	}
	checkProgram(t, pol, p)

	cached, err := Default()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cached, p) {
		t.Error("Default() differs from compiling DefaultPolicy()")
	}
}

// TestDefaultDecisions pins the decisions that matter for sandboxes, so a
// change to the profile or the compiler that flips one is caught by name.
func TestDefaultDecisions(t *testing.T) {
	p, err := Default()
	if err != nil {
		t.Fatal(err)
	}
	eperm, enosys := Errno(unix.EPERM), Errno(unix.ENOSYS)
	nsFlags := uint64(unix.CLONE_NEWNS)
	threadFlags := uint64(unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD | unix.CLONE_SYSVSEM)
	cases := []struct {
		name string
		nr   uint32
		args [6]uint64
		want Action
	}{
		{"read", unix.SYS_READ, [6]uint64{}, Allow},
		{"ioctl TCGETS", unix.SYS_IOCTL, [6]uint64{1, unix.TCGETS}, Allow},
		{"ioctl FICLONE", unix.SYS_IOCTL, [6]uint64{1, unix.FICLONE}, eperm},
		{"ioctl FICLONE high bits", unix.SYS_IOCTL, [6]uint64{1, 1<<32 | unix.FICLONE}, eperm},
		{"ioctl FICLONERANGE", unix.SYS_IOCTL, [6]uint64{1, unix.FICLONERANGE}, eperm},
		{"ioctl FIDEDUPERANGE", unix.SYS_IOCTL, [6]uint64{1, unix.FIDEDUPERANGE}, eperm},
		{"ioctl EXT4_IOC_MOVE_EXT", unix.SYS_IOCTL, [6]uint64{1, 0xc028660f}, eperm},
		{"ioctl XFS_IOC_SWAPEXT", unix.SYS_IOCTL, [6]uint64{1, 0xc0c0586d}, eperm},
		{"ioctl F2FS_IOC_MOVE_RANGE", unix.SYS_IOCTL, [6]uint64{1, 0xc020f509}, eperm},
		{"clone thread", unix.SYS_CLONE, [6]uint64{threadFlags}, Allow},
		{"clone newns", unix.SYS_CLONE, [6]uint64{nsFlags | uint64(unix.SIGCHLD)}, eperm},
		{"clone newuser", unix.SYS_CLONE, [6]uint64{unix.CLONE_NEWUSER}, eperm},
		{"clone3", unix.SYS_CLONE3, [6]uint64{}, enosys},
		{"unshare", unix.SYS_UNSHARE, [6]uint64{nsFlags}, eperm},
		{"setns", unix.SYS_SETNS, [6]uint64{}, eperm},
		{"mount", unix.SYS_MOUNT, [6]uint64{}, eperm},
		{"umount2", unix.SYS_UMOUNT2, [6]uint64{}, eperm},
		{"keyctl", unix.SYS_KEYCTL, [6]uint64{}, eperm},
		{"bpf", unix.SYS_BPF, [6]uint64{}, eperm},
		{"open_by_handle_at", unix.SYS_OPEN_BY_HANDLE_AT, [6]uint64{}, eperm},
		{"reboot", unix.SYS_REBOOT, [6]uint64{}, eperm},
		{"chroot (CAP_SYS_CHROOT kept)", unix.SYS_CHROOT, [6]uint64{}, Allow},
		{"ptrace (kernel >= 4.8)", unix.SYS_PTRACE, [6]uint64{}, Allow},
		{"personality query", unix.SYS_PERSONALITY, [6]uint64{0xffffffff}, Allow},
		{"personality linux", unix.SYS_PERSONALITY, [6]uint64{0}, Allow},
		{"personality no-randomize", unix.SYS_PERSONALITY, [6]uint64{0x0040000}, eperm},
		{"socket inet", unix.SYS_SOCKET, [6]uint64{unix.AF_INET}, Allow},
		{"socket unix", unix.SYS_SOCKET, [6]uint64{unix.AF_UNIX}, Allow},
		{"socket inet6", unix.SYS_SOCKET, [6]uint64{unix.AF_INET6}, Allow},
		{"socket alg", unix.SYS_SOCKET, [6]uint64{unix.AF_ALG}, eperm},
		{"socket vsock", unix.SYS_SOCKET, [6]uint64{unix.AF_VSOCK}, eperm},
		{"copy_file_range", unix.SYS_COPY_FILE_RANGE, [6]uint64{}, Allow},
		{"rseq_slice_yield (newer than profile)", unix.SYS_RSEQ_SLICE_YIELD, [6]uint64{}, enosys},
		{"x32 getpid", x32Bit | unix.SYS_GETPID, [6]uint64{}, enosys},
	}
	for _, tc := range cases {
		got, err := run(p, input{nr: tc.nr, arch: unix.AUDIT_ARCH_X86_64, args: tc.args})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got != tc.want {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
	if got, _ := run(p, input{nr: unix.SYS_GETPID, arch: unix.AUDIT_ARCH_I386}); got != KillProcess {
		t.Errorf("i386 ABI: got %v, want kill_process", got)
	}
}

// TestDockerConditions checks that the profile's capability and kernel
// conditions follow the capabilities granted, as Docker resolves them.
func TestDockerConditions(t *testing.T) {
	cases := []struct {
		name   string
		grant  caps.Set
		kernel mobyseccomp.KernelVersion
		nr     uint32
		args   [6]uint64
		want   Action
	}{
		{"mount with CAP_SYS_ADMIN", caps.DockerDefault().Add(unix.CAP_SYS_ADMIN), mobyseccomp.KernelVersion{Kernel: 6, Major: 1}, unix.SYS_MOUNT, [6]uint64{}, Allow},
		{"clone newns with CAP_SYS_ADMIN", caps.DockerDefault().Add(unix.CAP_SYS_ADMIN), mobyseccomp.KernelVersion{Kernel: 6, Major: 1}, unix.SYS_CLONE, [6]uint64{unix.CLONE_NEWNS}, Allow},
		{"clone3 with CAP_SYS_ADMIN", caps.DockerDefault().Add(unix.CAP_SYS_ADMIN), mobyseccomp.KernelVersion{Kernel: 6, Major: 1}, unix.SYS_CLONE3, [6]uint64{}, Allow},
		{"chroot without CAP_SYS_CHROOT", caps.DockerDefault().Without(unix.CAP_SYS_CHROOT), mobyseccomp.KernelVersion{Kernel: 6, Major: 1}, unix.SYS_CHROOT, [6]uint64{}, Errno(unix.EPERM)},
		{"ptrace before 4.8", caps.DockerDefault(), mobyseccomp.KernelVersion{Kernel: 4, Major: 7}, unix.SYS_PTRACE, [6]uint64{}, Errno(unix.EPERM)},
		{"ptrace on 4.8", caps.DockerDefault(), mobyseccomp.KernelVersion{Kernel: 4, Major: 8}, unix.SYS_PTRACE, [6]uint64{}, Allow},
		{"ptrace before 4.8 with CAP_SYS_PTRACE", caps.DockerDefault().Add(unix.CAP_SYS_PTRACE), mobyseccomp.KernelVersion{Kernel: 4, Major: 7}, unix.SYS_PTRACE, [6]uint64{}, Allow},
		{"open_by_handle_at with CAP_DAC_READ_SEARCH", caps.DockerDefault().Add(unix.CAP_DAC_READ_SEARCH), mobyseccomp.KernelVersion{Kernel: 6, Major: 1}, unix.SYS_OPEN_BY_HANDLE_AT, [6]uint64{}, Allow},
		{"arch_prctl (amd64 only)", caps.DockerDefault(), mobyseccomp.KernelVersion{Kernel: 6, Major: 1}, unix.SYS_ARCH_PRCTL, [6]uint64{}, Allow},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pol, err := FromDocker(mobyseccomp.DefaultProfile(), tc.grant, tc.kernel)
			if err != nil {
				t.Fatal(err)
			}
			p, err := Compile(pol)
			if err != nil {
				t.Fatal(err)
			}
			got, err := run(p, input{nr: tc.nr, arch: unix.AUDIT_ARCH_X86_64, args: tc.args})
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("got %v, want %v", got, tc.want)
			}
			checkProgram(t, pol, p)
		})
	}
}

// TestEveryComparison compiles each comparison on a large policy, so the
// tree needs long jumps, and checks it against the direct evaluation.
func TestEveryComparison(t *testing.T) {
	ops := []Op{OpEqual, OpNotEqual, OpLess, OpLessEqual, OpGreater, OpGreaterEqual, OpMaskedEqual}
	values := []uint64{0, 5, 1 << 32, 0xffffffff, 3<<32 | 7, ^uint64(0)}
	pol := Policy{DefaultAction: Errno(unix.EPERM)}
	i := 0
	for nr := uint32(0); nr < 200; nr++ {
		name := ""
		for n, v := range syscallNumbers {
			if v == nr {
				name = n
				break
			}
		}
		if name == "" {
			continue
		}
		for k := range 2 {
			c := Cond{Arg: (i + k) % 6, Op: ops[(i+k)%len(ops)], Value: values[(i+k)%len(values)], ValueTwo: values[(i+k+1)%len(values)] & values[(i+k)%len(values)], Low32: (i+k)%5 == 0}
			pol.Rules = append(pol.Rules, Rule{Syscall: name, Conds: []Cond{c}, Action: Errno(unix.Errno(1 + k))})
		}
		if i%4 == 0 {
			pol.Rules = append(pol.Rules, Rule{Syscall: name, Action: Allow})
		}
		i++
	}
	p, err := Compile(pol)
	if err != nil {
		t.Fatal(err)
	}
	long := slices.ContainsFunc(p, func(f unix.SockFilter) bool { return f.Code == unix.BPF_JMP|unix.BPF_JA })
	if !long {
		t.Error("expected the tree to need long jumps")
	}
	checkProgram(t, pol, p)
}

func TestMarshalRoundTrip(t *testing.T) {
	p, err := Default()
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 8*len(p) {
		t.Fatalf("marshalled %d instructions into %d bytes", len(p), len(b))
	}
	var q Program
	if err := q.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(p, q) {
		t.Error("round trip changed the program")
	}
	for name, bad := range map[string][]byte{
		"empty":        nil,
		"ragged":       b[:len(b)-3],
		"no return":    b[:8],
		"over the max": make([]byte, 8*(MaxInstructions+1)),
	} {
		if err := q.UnmarshalBinary(bad); err == nil {
			t.Errorf("%s: UnmarshalBinary accepted it", name)
		}
	}
}

func TestCompileRejects(t *testing.T) {
	for name, pol := range map[string]Policy{
		"no known syscall": {DefaultAction: Allow, Rules: []Rule{{Syscall: "no_such_call", Action: Allow}}},
		"bad argument":     {DefaultAction: Allow, Rules: []Rule{{Syscall: "read", Conds: []Cond{{Arg: 6}}, Action: Allow}}},
		"bad comparison":   {DefaultAction: Allow, Rules: []Rule{{Syscall: "read", Conds: []Cond{{Op: Op(42)}}, Action: Allow}}},
	} {
		if _, err := Compile(pol); err == nil {
			t.Errorf("%s: Compile accepted it", name)
		}
	}
}

func TestParseKernel(t *testing.T) {
	for release, want := range map[string]mobyseccomp.KernelVersion{
		"6.18.0-1-cloud-amd64": {Kernel: 6, Major: 18},
		"4.8":                  {Kernel: 4, Major: 8},
		"5.10.0-rc1":           {Kernel: 5, Major: 10},
	} {
		got, err := parseKernel(release)
		if err != nil || got != want {
			t.Errorf("parseKernel(%q) = %v, %v; want %v", release, got, err, want)
		}
	}
	if _, err := parseKernel("banana"); err == nil {
		t.Error("parseKernel accepted banana")
	}
}

func BenchmarkCompileDefault(b *testing.B) {
	pol, err := DefaultPolicy()
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := Compile(pol); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkUnmarshal(b *testing.B) {
	p, err := Default()
	if err != nil {
		b.Fatal(err)
	}
	raw, _ := p.MarshalBinary()
	for b.Loop() {
		var q Program
		if err := q.UnmarshalBinary(raw); err != nil {
			b.Fatal(err)
		}
	}
}
