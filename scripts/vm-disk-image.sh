#!/usr/bin/env bash
# Builds the bootable Debian bookworm disk image the fullvm backend boots
# (internal/runtime/fullvm) and prints its path.
#
#   scripts/vm-disk-image.sh [OUT]
#
# Everything comes from Debian's packages (the only network here): the root
# file system from debootstrap, the kernel (linux-image-cloud-amd64: virtio
# drivers, no hardware ones), systemd, and extlinux as the boot loader on a
# raw disk with an MBR (mbr.bin from syslinux-common); the raw disk is then
# converted to qcow2 (~240 MB).
#
# dsec-agent is NOT in the image: the backend hands it to the guest at boot
# as a small read-only virtio disk with serial "dsec-agent" (an EROFS file
# holding the static binary), and the dsec-agent.service unit below mounts
# it and runs the agent with the virtio-serial port dsec.agent as fd 3. The
# image then never goes stale when the agent changes, and any build of the
# agent runs on it.
#
# The result is cached in $DSEC_VM_CACHE (default /var/cache/dsec/vm, outside
# the clone) under a name that carries this script's hash, so CI rebuilds it
# only when the script changes (~1 minute cold). OUT, if given, is a copy.
# Needs root (debootstrap, a loop device) and scripts/deps.sh's packages.
set -euo pipefail

script="$(readlink -f "$0")"
cache="${DSEC_VM_CACHE:-/var/cache/dsec/vm}"
mirror="${DSEC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
hash="$(sha256sum "$script" | cut -c1-16)"
image="$cache/debian-bookworm-$hash.qcow2"
out="${1:-}"
# The image's path is the one line on stdout (callers read it); what the
# build says (debootstrap, apt) goes to stderr.
exec 3>&1 1>&2

finish() {
  if [ -n "$out" ] && [ "$out" != "$image" ]; then
    mkdir -p "$(dirname "$out")"
    cp --reflink=auto "$image" "$out.tmp.$$" && mv "$out.tmp.$$" "$out"
    echo "$out" >&3
  else
    echo "$image" >&3
  fi
}

if [ -s "$image" ]; then
  finish
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "vm-disk-image.sh: run as root (debootstrap and a loop device)" >&2
  exit 1
fi
for tool in debootstrap extlinux sfdisk losetup mkfs.ext4 qemu-img; do
  command -v "$tool" >/dev/null || { echo "vm-disk-image.sh: $tool missing: run scripts/deps.sh" >&2; exit 1; }
done
mbr=/usr/lib/syslinux/mbr/mbr.bin
[ -r "$mbr" ] || { echo "vm-disk-image.sh: $mbr missing: run scripts/deps.sh" >&2; exit 1; }

mkdir -p "$cache"
work="$(mktemp -d "$cache/build.XXXXXX")"
mnt="$work/mnt"
loop=""
cleanup() {
  set +e
  for m in dev/pts dev proc sys; do
    mountpoint -q "$mnt/$m" && umount -l "$mnt/$m"
  done
  mountpoint -q "$mnt" && umount "$mnt"
  [ -n "$loop" ] && losetup -d "$loop"
  rm -rf "$work"
}
trap cleanup EXIT

raw="$work/disk.raw"
truncate -s 2G "$raw"
# One bootable Linux partition from 1 MiB; the MBR's boot code is
# syslinux's, which loads extlinux from that partition's boot sector.
echo 'start=2048, type=83, bootable' | sfdisk -q "$raw"
# The partition through a loop device of its own (an offset into the
# file): partition device nodes need udev, which a build container lacks.
loop="$(losetup --find --show --offset $((2048 * 512)) "$raw")"
part="$loop"
# A fixed UUID keeps the image's bytes from varying with the build where
# nothing else does; the guest finds its root by label.
mkfs.ext4 -q -L dsec-root -U d5ec0000-0000-4000-8000-00000000f001 "$part"
mkdir -p "$mnt"
mount "$part" "$mnt"

debootstrap --variant=minbase --include=systemd,systemd-sysv,udev,kmod,e2fsprogs,procps \
  bookworm "$mnt" "$mirror"

mount -t proc proc "$mnt/proc"
mount -t sysfs sys "$mnt/sys"
mount --bind /dev "$mnt/dev"
mount --bind /dev/pts "$mnt/dev/pts"

# The initramfs needs only what boots a virtio disk: a smaller one loads
# faster through the BIOS under TCG. "dep" would look at the build host.
mkdir -p "$mnt/etc/initramfs-tools/conf.d"
echo 'MODULES=list' >"$mnt/etc/initramfs-tools/conf.d/dsec.conf"
printf '%s\n' virtio_pci virtio_blk virtio_scsi ext4 crc32c_generic >>"$mnt/etc/initramfs-tools/modules"
DEBIAN_FRONTEND=noninteractive chroot "$mnt" apt-get install -y -qq --no-install-recommends \
  linux-image-cloud-amd64 initramfs-tools >/dev/null

# busybox's applets where Debian has no command of that name (nc,
# usleep, ...): what the runtime conformance suite's scripts use, and
# handy in a sandbox. Debian's own commands keep their names.
DEBIAN_FRONTEND=noninteractive chroot "$mnt" apt-get install -y -qq --no-install-recommends busybox >/dev/null
chroot "$mnt" sh -c 'for a in $(busybox --list); do command -v "$a" >/dev/null || ln -s /bin/busybox "/usr/local/bin/$a"; done'

cat >"$mnt/etc/fstab" <<'EOF'
LABEL=dsec-root / ext4 rw,errors=remount-ro 0 1
EOF
echo dsec >"$mnt/etc/hostname"
# Each boot gets its own machine id (an empty file: systemd generates one).
: >"$mnt/etc/machine-id"
# The console is the display's (computer-use tasks log in there); a sandbox
# is its user's whole machine, so root has no password, as in a container.
chroot "$mnt" passwd -qd root

# dsec-agent: mounted from the read-only disk the backend attaches, run
# with the virtio-serial port as fd 3 (what cmd/dsec-agent expects). It
# starts with the other services and restarts if it dies, so a sandbox's
# channel outlives a crash of its agent.
cat >"$mnt/usr/local/sbin/dsec-agent-start" <<'EOF'
#!/bin/sh
set -e
dev=/dev/disk/by-id/virtio-dsec-agent
dir=/run/dsec-agent
mkdir -p "$dir"
mountpoint -q "$dir" || mount -t erofs -o ro "$dev" "$dir"
# The port opens once the boot is over (every unit started): the backend
# saves its boot template when the guest opens the port, and a guest
# saved mid-boot would finish booting again in every sandbox restored
# from it, each burning CPU the others need. (The unit itself started
# with sysinit.target, so it holds nothing up.)
systemctl is-system-running --wait >/dev/null 2>&1 || true
exec "$dir/dsec-agent" 3<>/dev/virtio-ports/dsec.agent
EOF
chmod 755 "$mnt/usr/local/sbin/dsec-agent-start"
cat >"$mnt/etc/systemd/system/dsec-agent.service" <<'EOF'
[Unit]
Description=DSec sandbox agent
# Early: after sysinit (udev has named the devices, local file systems
# are mounted, /tmp and /run set up), not after every service of
# multi-user.target, so a sandbox is usable seconds sooner under TCG.
DefaultDependencies=no
Requires=dev-virtio\x2dports-dsec.agent.device dev-disk-by\x2did-virtio\x2ddsec\x2dagent.device
After=dev-virtio\x2dports-dsec.agent.device dev-disk-by\x2did-virtio\x2ddsec\x2dagent.device sysinit.target
Conflicts=shutdown.target
Before=shutdown.target

[Service]
ExecStart=/usr/local/sbin/dsec-agent-start
Restart=always
RestartSec=100ms
# The agent kills its execs' process trees itself; stopping the unit must
# not leave the workload's daemons running.
KillMode=mixed

[Install]
WantedBy=sysinit.target
EOF
chroot "$mnt" systemctl enable -q dsec-agent.service
# Nothing a sandbox needs: they only lengthen the boot under TCG.
# (getty-static starts gettys on tty2-6 when dbus is missing: ~13 s here;
# the modprobe@ units load modules a sandbox never uses.)
chroot "$mnt" systemctl mask -q e2scrub_reap.service e2scrub_all.timer fstrim.timer \
  apt-daily.timer apt-daily-upgrade.timer systemd-timesyncd.service getty-static.service \
  modprobe@dm_mod.service modprobe@fuse.service modprobe@loop.service modprobe@efi_pstore.service \
  modprobe@drm.service sys-kernel-debug.mount sys-kernel-tracing.mount 2>/dev/null || true

kver="$(basename "$(ls "$mnt"/boot/vmlinuz-* | sort -V | tail -1)" | sed 's/^vmlinuz-//')"
mkdir -p "$mnt/boot/extlinux"
cat >"$mnt/boot/extlinux/extlinux.conf" <<EOF
DEFAULT linux
TIMEOUT 0
PROMPT 0
LABEL linux
  LINUX /boot/vmlinuz-$kver
  INITRD /boot/initrd.img-$kver
  APPEND root=LABEL=dsec-root rw console=tty0 console=ttyS0 quiet loglevel=3 systemd.show_status=false mitigations=off
EOF
extlinux --install "$mnt/boot/extlinux" 2>/dev/null
dd if="$mbr" of="$raw" bs=440 count=1 conv=notrunc status=none

chroot "$mnt" apt-get clean
rm -rf "$mnt"/var/lib/apt/lists/* "$mnt"/var/cache/debconf/*-old "$mnt"/var/log/*.log
for m in dev/pts dev proc sys; do umount -l "$mnt/$m"; done
# Blocks the build freed (downloaded packages, apt's lists) still hold
# their bytes; discarding them punches holes in the raw file, which
# qemu-img convert then leaves out (~680 MB -> ~240 MB).
fstrim "$mnt"
umount "$mnt"
losetup -d "$loop"
loop=""
qemu-img convert -q -O qcow2 "$raw" "$work/disk.qcow2"
mv "$work/disk.qcow2" "$image"
finish
