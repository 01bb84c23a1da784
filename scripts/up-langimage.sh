#!/usr/bin/env bash
# make up's background step: prepares fncall's language image (what
# `dsec fn run` and POST /run_code use) while `dsec up` already serves.
# Builds the rootfs with langimage.sh (cached: a no-op once built), waits for
# the API, and imports it as the public image dsec/lang:bookworm unless that
# already exists. Progress goes to stderr, prefixed "make up:"; the build's
# own output to DATA_DIR/lang-image.log.
#
# usage: up-langimage.sh DSEC_BIN DATA_DIR ROOTFS_DIR
set -uo pipefail
dsec=${1:?usage: up-langimage.sh DSEC_BIN DATA_DIR ROOTFS_DIR}
data=${2:?}
rootfs=${3:?}
here=$(cd "$(dirname "$0")" && pwd)
ref=dsec/lang:bookworm
log=$data/lang-image.log
say() { echo "make up: $*" >&2; }

# The API is up once the admin token exists and a call answers.
api() {
  [ -r "$data/admin.token" ] || return 1
  DSEC_TOKEN=$(cat "$data/admin.token") "$dsec" image ls --json "$@"
}
wait_api() {
  for _ in $(seq 600); do
    out=$(api 2>/dev/null) && { printf '%s' "$out"; return 0; }
    sleep 0.5
  done
  return 1
}

mkdir -p "$data"
if [ -f "$rootfs/etc/dsec-lang-image" ] && wait_api | grep -q "\"$ref\""; then
  exit 0
fi
say "building fncall's language image $ref in the background (~2 min the first time; log: $log)"
if ! "$here/langimage.sh" "$rootfs" >"$log" 2>&1; then
  say "building $ref failed; see $log, then run: make lang-image && bin/dsec image import --public --server-path $ref $rootfs"
  exit 1
fi
if ! listing=$(wait_api); then
  say "the API did not answer; import the language image by hand: bin/dsec image import --public --server-path $ref $rootfs"
  exit 1
fi
if ! printf '%s' "$listing" | grep -q "\"$ref\""; then
  say "importing $ref from $rootfs"
  if ! DSEC_TOKEN=$(cat "$data/admin.token") "$dsec" image import --public --server-path -q "$ref" "$rootfs" >>"$log" 2>&1; then
    say "importing $ref failed; see $log"
    exit 1
  fi
fi
say "$ref is ready: fncall (dsec fn run, POST /run_code) can run python, bash, c, cpp, go and nodejs"
