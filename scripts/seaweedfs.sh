#!/usr/bin/env bash
# Builds SeaweedFS's `weed` at a pinned version: a real S3-compatible server
# (Apache-2.0) that the s3 blob store's tests and end-to-end tests run
# against. The binary goes into a cache outside the clone
# (DSEC_CACHE_BIN, default /var/cache/dsec/bin) as weed-<version>, with a
# `weed` link beside it, and is not rebuilt while that version is there.
# Prints the binary's path.
#
# `go install github.com/seaweedfs/seaweedfs/weed@VERSION` refuses the
# module (its go.mod has replace directives), so the module is downloaded
# into the module cache and built there as the main module, where its
# replace directives and go.sum apply as upstream meant them.
set -euo pipefail
VERSION=v0.0.0-20261109003541-7506e5f91cd6
MODULE=github.com/seaweedfs/seaweedfs
bin_dir=${DSEC_CACHE_BIN:-/var/cache/dsec/bin}
out=$bin_dir/weed-$VERSION
if [ -x "$out" ]; then
  ln -sfn "weed-$VERSION" "$bin_dir/weed"
  echo "$out"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "seaweedfs.sh: go not on PATH" >&2
  exit 1
fi
mkdir -p "$bin_dir"
# Outside any module, so that the download does not touch this clone's go.mod.
dir=$(cd / && go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')
if [ -z "$dir" ] || [ ! -d "$dir/weed" ]; then
  echo "seaweedfs.sh: go mod download $MODULE@$VERSION gave no module directory" >&2
  exit 1
fi
echo "seaweedfs.sh: building weed $VERSION (the first build takes minutes)" >&2
start=$SECONDS
(cd "$dir" && GOFLAGS=-buildvcs=false go build -trimpath -o "$out.tmp.$$" ./weed)
mv "$out.tmp.$$" "$out"
ln -sfn "weed-$VERSION" "$bin_dir/weed"
echo "seaweedfs.sh: built $out in $((SECONDS - start))s" >&2
echo "$out"
