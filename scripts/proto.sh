#!/usr/bin/env bash
# Regenerates the Go code for every .proto in the repository (committed next
# to the .proto files). Needs protoc (Debian: protobuf-compiler); the Go
# plugins are pinned here and installed into a private GOBIN.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v protoc >/dev/null || { echo "proto.sh: install protoc (apt-get install protobuf-compiler)" >&2; exit 1; }
[ -f /usr/include/google/protobuf/duration.proto ] || { echo "proto.sh: install the well-known types (apt-get install libprotobuf-dev)" >&2; exit 1; }
bin=$(pwd)/.cache/protobin
mkdir -p "$bin"
GOBIN=$bin go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
GOBIN=$bin go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.21.1
export PATH=$bin:$PATH
protoc -I api --go_out=api --go_opt=paths=source_relative \
  --connect-go_out=api --connect-go_opt=paths=source_relative \
  dsec/v1/dsec.proto dsec/v1/edge.proto
for p in $(git ls-files 'internal/*.proto'); do
  d=$(dirname "$p")
  protoc -I "$d" --go_out="$d" --go_opt=paths=source_relative "$(basename "$p")"
done
