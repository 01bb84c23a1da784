// Package agentpb holds the generated protobuf messages of the agent control
// protocol; the framing and stream rules are described in agent.proto.
package agentpb

// Regenerate with protoc 3.21+ and protoc-gen-go v1.36.12 on PATH
// (go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12).
//go:generate protoc --go_out=. --go_opt=paths=source_relative agent.proto
