#!/usr/bin/env bash
# Installs the system packages DSec needs that this machine lacks (Debian).
# Idempotent: does nothing when everything is present.
set -euo pipefail
need=()
have() { command -v "$1" >/dev/null 2>&1; }
have mkfs.erofs || need+=(erofs-utils)
# The sandboxes' writable layers live on btrfs with quotas (internal/runtime/container/scratchfs).
have mkfs.btrfs || need+=(btrfs-progs)
[ -x /bin/busybox ] || need+=(busybox-static)
# The VM backends (microvm, fullvm) run QEMU; a microVM's writable disk is
# ext4 made on the host (mkfs.ext4, never mounted there); the guest kernel is
# a Debian package fetched with apt-get download and unpacked with dpkg-deb
# (internal/runtime/microvm/vmimage, on first use).
have qemu-system-x86_64 || need+=(qemu-system-x86)
have mkfs.ext4 || need+=(e2fsprogs)
# fullvm: qemu-img (overlays, snapshots as disk images), and what
# scripts/vm-disk-image.sh builds the Debian disk image with: debootstrap,
# extlinux with syslinux's MBR, sfdisk to partition the raw disk.
have qemu-img || need+=(qemu-utils)
have debootstrap || need+=(debootstrap)
have extlinux || need+=(extlinux)
[ -r /usr/lib/syslinux/mbr/mbr.bin ] || need+=(syslinux-common)
have sfdisk || need+=(fdisk)
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import httpx' 2>/dev/null || need+=(python3-httpx)
/usr/bin/python3 -c 'import pytest' 2>/dev/null || need+=(python3-pytest)
# pip install ./sdk/python (README): venv with Debian's packages, built offline.
/usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
/usr/bin/python3 -c 'import setuptools, wheel' 2>/dev/null || need+=(python3-setuptools python3-wheel)
if [ "${DSEC_BENCH_DEPS:-}" = 1 ]; then
  have crun || need+=(crun)
  have runc || need+=(runc)
  have bwrap || need+=(bubblewrap)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  if [ "$(id -u)" != 0 ]; then echo "deps.sh: run as root to install ${need[*]}" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# The microVM kernel is fetched on first use with apt-get download, which
# needs the package lists (a fresh CI image may have none).
if ! apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq; else echo "deps.sh: run apt-get update (the microvm kernel is fetched with apt)" >&2; fi
fi
if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
  echo "note: add /usr/local/go/bin to PATH" >&2
fi
# The s3 blob store's tests run against SeaweedFS's S3 server, built from
# its Go module at a pinned version into /var/cache/dsec/bin: ~10-30 min
# of compiling the first time (a 230 MB binary), nothing afterwards while
# that directory is kept. Built when DSEC_SEAWEEDFS=1 (`make test` sets
# it) or CI is set, so that `make up` does not wait for it; without it
# those tests skip, or fail under CI=true.
if [ "${DSEC_SEAWEEDFS:-${CI:+1}}" = 1 ]; then
  PATH=$PATH:/usr/local/go/bin "$(dirname "$0")/seaweedfs.sh" >/dev/null
fi
