// Package agent is the control protocol between the edge and dsec-agent, the
// small init process inside every sandbox: the server that runs inside the
// sandbox (Serve) and the client the edge uses (Client).
//
// The protocol runs over any byte stream — a socket for containers,
// virtio-serial for VM guests — so it needs no fd passing and no connection
// semantics: length-prefixed protobuf frames (agentpb) carrying a stream id,
// many streams in flight at once, bulk data chunked and flow controlled per
// stream (see Window) so a slow reader of one exec's output never holds up
// another.
//
// A sandbox's agent first sets its sandbox up: the backend's first request
// on a new channel is an Init (Client.Init, answered on the agent's side by
// AcceptInit before Serve), which carries the hostname, exec defaults,
// resources, the read-only layers and the writable layer as Sources (a
// directory for the container backend, a virtio-blk or virtio-pmem device
// for a VM guest), and the backend's own part (ContainerInit). No other
// channel carries configuration.
//
// The package depends on no backend (nothing of internal/runtime): it has
// its own request, result and error types, and the backends translate at
// their edge (internal/runtime/agentconv), so one client serves the
// container backend over a socket and the VM backends over virtio-serial.
//
// agentpb/agent.proto defines the frames, but both ends encode and decode
// them with the small hand-written codec in wire.go rather than the
// generated code: the protobuf-go runtime would add milliseconds of package
// init and over half a megabyte to every sandbox's agent. Tests keep the two
// in agreement.
//
// Inside the sandbox the agent is PID 1, so it also reaps orphans. One
// goroutine owns wait4 (see procTable): statuses of the processes the agent
// started are handed to the exec that started them, everything else is
// reaped and dropped. That is why the server never uses os/exec.
package agent
