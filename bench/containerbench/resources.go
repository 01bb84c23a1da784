package main

import (
	"fmt"
	"strings"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/dsec-dev/dsec/cmd/dsec/cli/flagval"
	rt "github.com/dsec-dev/dsec/internal/runtime"
)

// benchResources are the limits every measured sandbox gets (-resources):
// DSec's rows put them in the spec, the OCI runtimes' rows (crun, runc) in
// the bundle's linux.resources, so a comparison is of the same shape. Users
// set resources, and limits cost something (cgroup writes per create); a
// figure without them says little about the shapes users run.
var benchResources rt.Resources

// parseResources reads "cpu=1,mem=1g,pids=1024,disk=1g" (any subset).
func parseResources(s string) (rt.Resources, error) {
	var r rt.Resources
	if strings.TrimSpace(s) == "" {
		return r, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return r, fmt.Errorf("-resources %q: want KEY=VALUE pairs (cpu, mem, pids, disk)", kv)
		}
		var err error
		switch k {
		case "cpu":
			r.MilliCPU, err = flagval.ParseCPU("resources cpu", v)
		case "mem":
			r.MemoryBytes, err = flagval.ParseSize("resources mem", v)
		case "disk":
			r.DiskBytes, err = flagval.ParseSize("resources disk", v)
		case "pids":
			_, err = fmt.Sscan(v, &r.Pids)
			if err == nil && r.Pids < 1 {
				err = fmt.Errorf("-resources pids=%s: want at least 1", v)
			}
		default:
			err = fmt.Errorf("-resources: unknown key %q (want cpu, mem, pids, disk)", k)
		}
		if err != nil {
			return r, err
		}
	}
	return r, nil
}

// ociResources is r as OCI linux.resources (CFS period 100 ms, as DSec's).
func ociResources(r rt.Resources) *specs.LinuxResources {
	out := &specs.LinuxResources{Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}}}
	if r.MilliCPU > 0 {
		period := uint64(100000)
		quota := r.MilliCPU * 100
		out.CPU = &specs.LinuxCPU{Period: &period, Quota: &quota}
	}
	if r.MemoryBytes > 0 {
		m := r.MemoryBytes
		out.Memory = &specs.LinuxMemory{Limit: &m}
	}
	if r.Pids > 0 {
		p := r.Pids
		out.Pids = &specs.LinuxPids{Limit: &p}
	}
	return out
}
