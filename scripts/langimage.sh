#!/usr/bin/env bash
# Builds fncall's language image into OUTDIR: a Debian bookworm root file
# system (debootstrap --variant=minbase) with the Debian packages that the
# language table (internal/runtime/fncall/languages.json) lists, trimmed of
# what a sandbox never needs (apt lists and caches, docs, man pages, locales
# other than C).
#
# Cached: OUTDIR/etc/dsec-lang-image records a hash of the suite, mirror,
# recipe and package list; when it matches, nothing is done. A build goes
# into a temporary directory next to OUTDIR and is renamed into place at the
# end, so an interrupted build never leaves a half rootfs that looks
# complete. Concurrent runs for the same OUTDIR wait for each other (flock).
#
# Needs root (debootstrap) and network access to the mirror; installs
# debootstrap with apt-get when it is missing. A full build takes ~2-3
# minutes and ~1.3 GB before trimming.
set -euo pipefail

out=${1:?usage: langimage.sh OUTDIR}
out=${out%/}
here=$(cd "$(dirname "$0")" && pwd)
table=${DSEC_LANG_TABLE:-$here/../internal/runtime/fncall/languages.json}
suite=bookworm
mirror=${DSEC_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Bump when the recipe below changes, so cached images get rebuilt.
recipe=1
stampfile=etc/dsec-lang-image

# Debian's python3 when present (the one on PATH may be a pyenv build).
py=/usr/bin/python3
[ -x "$py" ] || py=python3
packages=$("$py" - "$table" <<'EOF'
import json, sys
table = json.load(open(sys.argv[1]))
pkgs = sorted({p for lang in table["languages"] for p in lang.get("packages", [])})
if not pkgs:
    sys.exit("langimage.sh: the language table lists no packages")
print(",".join(pkgs))
EOF
)
hash=$(printf 'suite=%s\nmirror=%s\nrecipe=%s\npackages=%s\n' "$suite" "$mirror" "$recipe" "$packages" |
  sha256sum | cut -d' ' -f1)

current() { [ "$(sed -n 's/^hash=//p' "$out/$stampfile" 2>/dev/null)" = "$hash" ]; }
if current; then exit 0; fi

if [ "$(id -u)" != 0 ]; then
  echo "langimage.sh: run as root (debootstrap) to build $out" >&2
  exit 1
fi

mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9
# Another run may have finished the build while this one waited.
if current; then exit 0; fi

# unmount_under DIR: detach whatever a failed debootstrap left mounted
# inside DIR (it mounts proc and sys in the target), deepest first, so that
# removing DIR never reaches into a host file system.
unmount_under() {
  findmnt -rn -o TARGET | awk -v d="$1/" 'index($0, d) == 1' | sort -r |
    while read -r m; do umount -l "$m" || true; done
}
remove() {
  unmount_under "$1"
  rm -rf --one-file-system "$1"
}

# Leftovers of interrupted builds (the lock says none is running).
for d in "$out".tmp.* "$out".old.*; do
  [ -e "$d" ] && remove "$d"
done

if ! command -v debootstrap >/dev/null 2>&1; then
  echo "langimage.sh: installing debootstrap" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends debootstrap
fi

tmp=$(mktemp -d "$out.tmp.XXXXXX")
trap 'remove "$tmp"' EXIT
# Signals end the script through exit, so the EXIT trap cleans up; a later
# run removes whatever a harder kill leaves.
trap 'exit 130' INT TERM HUP
chmod 0755 "$tmp"
log="$out.build.log"
echo "langimage.sh: debootstrap $suite ($packages) into $out (log: $log)" >&2
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$tmp" "$mirror" >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "langimage.sh: debootstrap failed (full log: $log)" >&2
  exit 1
fi
unmount_under "$tmp"

# Trim. Sandboxes never run apt (no network, no lists) nor read docs, and
# the only locale they need is C.UTF-8.
(
  cd "$tmp"
  rm -rf var/lib/apt/lists/* var/cache/apt/* var/cache/debconf/*-old var/lib/dpkg/*-old \
    usr/share/doc/* usr/share/man/* usr/share/info/* usr/share/locale/* usr/share/lintian \
    tmp/* var/tmp/*
  find usr/lib/locale -mindepth 1 -maxdepth 1 ! -name C.utf8 -exec rm -rf {} +
  find var/log -type f -delete
  # debootstrap copied the host's name and resolver: neither belongs here
  # (the sandbox sets its own hostname and has no network but loopback).
  echo dsec >etc/hostname
  : >etc/resolv.conf
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >etc/hosts
)

printf 'hash=%s\nsuite=%s\nmirror=%s\nrecipe=%s\npackages=%s\n' "$hash" "$suite" "$mirror" "$recipe" "$packages" \
  >"$tmp/$stampfile"

# Swap in: the old build (if any) moves aside first, then goes.
old=""
if [ -e "$out" ]; then
  old="$out.old.$$"
  mv "$out" "$old"
fi
mv "$tmp" "$out"
trap - EXIT
[ -n "$old" ] && remove "$old"
echo "langimage.sh: built $out ($(du -sh "$out" | cut -f1))" >&2
