#!/usr/bin/env bash
# Builds a minimal root filesystem from the host's static busybox into DIR:
# the starter image `make up` imports as busybox:latest. Fast (no network)
# and idempotent: an existing, complete DIR is left as it is.
set -euo pipefail
dir=${1:?usage: busybox-rootfs.sh DIR}
bb=$(command -v busybox || true)
[ -n "$bb" ] || { echo "busybox-rootfs.sh: busybox not found (Debian: busybox-static)" >&2; exit 1; }
if [ -x "$dir/bin/busybox" ] && cmp -s "$bb" "$dir/bin/busybox"; then exit 0; fi
rm -rf "$dir"
mkdir -p "$dir"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,root,home,var/tmp,run}
chmod 1777 "$dir/tmp" "$dir/var/tmp"
chmod 0700 "$dir/root"
cp "$bb" "$dir/bin/busybox"
# One symlink per applet, where busybox itself would install it.
"$bb" --list-full | while read -r applet; do
  [ "$applet" = bin/busybox ] && continue
  ln -sf /bin/busybox "$dir/$applet"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$dir/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$dir/etc/group"
printf 'dsec\n' >"$dir/etc/hostname"
