package container

import (
	"path/filepath"
	"testing"
)

// TestV2Memory: on cgroup v2 a limit is split between memory.max and
// memory.swap.max so that their sum is the limit, when the host has swap.
func TestV2Memory(t *testing.T) {
	defer hostSwap.Store(hostSwap.Load())
	for _, c := range []struct {
		hasSwap            bool
		limit, ram, swapTo int64
		writes             []cgroupWrite
	}{
		{false, 256 << 20, 256 << 20, 0, []cgroupWrite{{"d/memory.swap.max", "0"}, {"d/memory.max", "268435456"}}},
		{true, 256 << 20, 192 << 20, 64 << 20, []cgroupWrite{{"d/memory.swap.max", "67108864"}, {"d/memory.max", "201326592"}}},
		{true, 0, 0, 0, []cgroupWrite{{"d/memory.swap.max", "max"}, {"d/memory.max", "max"}}},
	} {
		hostSwap.Store(c.hasSwap)
		if c.limit > 0 {
			if ram, swap := v2Memory(c.limit); ram != c.ram || swap != c.swapTo || ram+swap != c.limit {
				t.Errorf("swap %v: v2Memory(%d) = %d, %d; want %d, %d", c.hasSwap, c.limit, ram, swap, c.ram, c.swapTo)
			}
		}
		w := v2MemoryWrites("d", c.limit, 0)
		if len(w) != len(c.writes) {
			t.Fatalf("swap %v limit %d: %v", c.hasSwap, c.limit, w)
		}
		for i := range w {
			if w[i] != c.writes[i] {
				t.Errorf("swap %v limit %d: write %d is %v, want %v", c.hasSwap, c.limit, i, w[i], c.writes[i])
			}
		}
	}
}

// TestV1MemoryWritesOrder: RAM limit <= memsw limit in each cgroup after
// every write, and the user's limit never above the sandbox's once both
// are written, whichever way the limit moves (the kernel refuses the
// first with EINVAL; the second would take the agent's headroom).
func TestV1MemoryWritesOrder(t *testing.T) {
	if !memswAccounting() {
		t.Skip("no cgroup v1 swap accounting here: only RAM limits are written")
	}
	const none = int64(1) << 62
	val := func(v int64) int64 {
		if v == 0 {
			return none
		}
		return v
	}
	for _, c := range []struct {
		from  int64
		known bool
		to    int64
	}{{0, true, 256 << 20}, {256 << 20, true, 512 << 20}, {512 << 20, true, 64 << 20}, {64 << 20, true, 0}, {128 << 20, false, 64 << 20}, {64 << 20, false, 0}} {
		state := map[string]int64{}
		for _, dir := range []string{"sb", "sb/user"} {
			extra := int64(0)
			if dir == "sb" && c.from != 0 {
				extra = agentMemory
			}
			state[dir+"/memory.limit_in_bytes"] = val(c.from) + extra
			state[dir+"/memory.memsw.limit_in_bytes"] = val(c.from) + extra
		}
		for _, w := range v1MemoryWrites("/g", c.from, c.known, c.to) {
			rel, err := filepath.Rel(filepath.Join(cgroupRoot, "memory", "g"), w.file)
			if err != nil {
				t.Fatal(err)
			}
			n := none
			if w.value != "-1" {
				var v int64
				for _, d := range w.value {
					v = v*10 + int64(d-'0')
				}
				n = v
			}
			state[filepath.Join("sb", rel)] = n
			for _, dir := range []string{"sb", "sb/user"} {
				if state[dir+"/memory.limit_in_bytes"] > state[dir+"/memory.memsw.limit_in_bytes"] {
					t.Fatalf("%+v: after writing %s=%s, %s has its RAM limit above its memsw limit", c, rel, w.value, dir)
				}
			}
		}
		want := val(c.to)
		for _, f := range []string{"memory.limit_in_bytes", "memory.memsw.limit_in_bytes"} {
			extra := int64(0)
			if c.to != 0 {
				extra = agentMemory
			}
			if state["sb/user/"+f] != want || state["sb/"+f] != want+extra {
				t.Errorf("%+v: ended with user %s %d, sandbox %d", c, f, state["sb/user/"+f], state["sb/"+f])
			}
		}
	}
}
