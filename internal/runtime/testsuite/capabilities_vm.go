package testsuite

// Capabilities that the container and microvm backends have and the
// fullvm backend, a whole machine booted from its own disk image, does not.
const (
	// LayerRootfs: the sandbox's root file system is Spec.Layers (EROFS,
	// BusyboxRootfs's in the suite) under a writable layer. A fullvm boots
	// a disk image instead: the suite's base-layer checks do not apply.
	LayerRootfs Capability = "layer-rootfs"
	// HostKernel: the workload runs on the host's kernel, so what that
	// kernel shows it (block maps of the host's disk, mounts made of host
	// paths, the host's identity in /proc and /sys) must be hidden. A
	// fullvm guest runs its own kernel on virtual hardware: its block maps
	// and mounts are of its virtual disks.
	HostKernel Capability = "host-kernel"
	// ProtectedAgent: dsec-agent is the sandbox's PID 1 and the workload,
	// root included, cannot change, signal or starve it. In a fullvm guest
	// the agent is a service of the guest's own init, which its root
	// owns like the rest of the machine; the boundary is the hypervisor.
	ProtectedAgent Capability = "protected-agent"
)
