#!/usr/bin/env bash
# Docker's figure for the SDK loop (issue 3): starts a private dockerd,
# imports the busybox rootfs as an image, runs docker_cycle.py against it
# and removes everything it created, also on failure and Ctrl-C.
#
#   sudo bench/sdkbench/docker_cycle.sh [docker_cycle.py options: --n 60 --concurrency 200 ...]
#
# dockerd is run as bench/containerbench/docker.go runs it: own data-root,
# exec-root and socket in a temp dir, its own cgroup parent, no bridge
# (--bridge none: containers use network "none"), iptables, ip-forward and
# masquerading off so the host firewall and sysctls are never touched. It
# runs in a private mount namespace, so container mounts never enter the
# host's mount table and vanish with it, and in its own session, so Ctrl-C
# reaches this script (which stops it in order) and not dockerd. Exits with
# docker_cycle.py's status, or non-zero if set-up or clean-up failed.
set -euo pipefail

die() { echo "docker_cycle.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (dockerd)"
command -v dockerd >/dev/null || die "dockerd not installed (apt-get install -y docker.io)"
# The CLI that ships with the daemon: a newer client earlier on PATH may
# speak an API this dockerd does not.
cli=/usr/bin/docker
[ -x "$cli" ] || die "$cli missing (it comes with docker.io)"
/usr/bin/python3 -c 'import httpx' 2>/dev/null || die "python3-httpx missing (apt-get install -y python3-httpx)"
for t in curl unshare setsid tar; do command -v $t >/dev/null || die "$t not found"; done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
image=dsecbench-busybox:latest
cg=dsecbench-dockercycle-$$
work=$(mktemp -d "${TMPDIR:-/tmp}/dsecbench-dockercycle.XXXXXX")
sock=$work/docker.sock
dockerd_pid=
py_pid=

# Host state before dockerd runs, so clean-up removes only what it created.
had_docker0=0
ip link show docker0 >/dev/null 2>&1 && had_docker0=1
new_paths=()
for p in /etc/docker/key.json /run/docker /run/containerd /var/lib/docker /var/lib/containerd; do
  [ -e "$p" ] || [ -L "$p" ] || new_paths+=("$p")
done
iptables_pre=$(iptables-save 2>/dev/null | grep -v '^#' || true)

# pids_of_run lists live processes whose command line names the work dir:
# dockerd, its containerd and the containerd shims, all started by this run.
pids_of_run() {
  local f pid
  for f in /proc/[0-9]*/cmdline; do
    pid=${f#/proc/}; pid=${pid%/cmdline}
    [ "$pid" = $$ ] && continue
    tr '\0' ' ' 2>/dev/null <"$f" | grep -qF -- "$work/" && echo "$pid"
  done
  return 0
}

cleanup() {
  local rc=$? errs=0 p i
  trap - EXIT INT TERM
  set +e
  if [ -n "$py_pid" ]; then kill -TERM "$py_pid" 2>/dev/null; wait "$py_pid" 2>/dev/null; fi
  if [ -n "$dockerd_pid" ] && kill -0 "$dockerd_pid" 2>/dev/null; then
    ids=$("$cli" -H "unix://$sock" ps --all --quiet 2>/dev/null)
    if [ -n "$ids" ]; then
      echo "clean-up: removing $(echo "$ids" | wc -w) containers" >&2
      # shellcheck disable=SC2086
      "$cli" -H "unix://$sock" rm --force $ids >/dev/null || errs=1
    fi
    kill -TERM "$dockerd_pid"
    for i in $(seq 600); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$dockerd_pid" 2>/dev/null; then
      echo "clean-up: dockerd did not stop in 60 s; killing it" >&2
      kill -KILL "$dockerd_pid"; errs=1
    fi
    wait "$dockerd_pid" 2>/dev/null
  fi
  # containerd and shims outlive a dockerd that died or was killed.
  for i in $(seq 50); do
    p=$(pids_of_run)
    [ -z "$p" ] && break
    [ "$i" = 1 ] && echo "clean-up: killing leftover processes of this run: $(echo $p)" >&2
    # shellcheck disable=SC2086
    kill -KILL $p 2>/dev/null; sleep 0.1
  done
  [ -z "$(pids_of_run)" ] || { echo "clean-up: processes of this run survive: $(pids_of_run | tr '\n' ' ')" >&2; errs=1; }
  # Cgroups under the parent dockerd was given: kill what is left in them
  # (only this run's containers can be there), then remove them deepest first.
  for d in /sys/fs/cgroup/*/"$cg"; do
    [ -d "$d" ] || continue
    for i in $(seq 100); do
      cat $(find "$d" -name cgroup.procs) 2>/dev/null | xargs -r kill -KILL 2>/dev/null
      find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
      [ -d "$d" ] || break
      sleep 0.1
    done
    [ -d "$d" ] && { echo "clean-up: cannot remove cgroup $d" >&2; errs=1; }
  done
  if [ "$had_docker0" = 0 ] && ip link show docker0 >/dev/null 2>&1; then
    ip link delete docker0 || errs=1
  fi
  # Shims killed above leave their sockets in /run/containerd/s (a fixed
  # path); containerd 1.6 names each sha256(<containerd address>/moby/<id>).
  if [ -d "$work/data/containers" ]; then
    for c in "$work"/data/containers/*/; do
      [ -d "$c" ] || continue
      c=$(basename "$c")
      h=$(printf '%s' "$work/exec/containerd/containerd.sock/moby/$c" | sha256sum | cut -d' ' -f1)
      rm -f "/run/containerd/s/$h"
    done
  fi
  for p in "${new_paths[@]}"; do
    [ -e "$p" ] || continue
    if [ -d "$p" ] && [ -n "$(find "$p" ! -type d -print -quit)" ]; then
      echo "clean-up: $p is not empty; left in place" >&2; errs=1
    else
      rm -rf "$p" || errs=1  # a file (key.json) or a tree of empty directories
    fi
  done
  if [ "$(iptables-save 2>/dev/null | grep -v '^#' || true)" != "$iptables_pre" ]; then
    echo "clean-up: iptables rules changed while dockerd ran; inspect with iptables-save" >&2; errs=1
  fi
  if grep -qF " $work/" /proc/self/mountinfo; then
    echo "clean-up: mounts under $work in the host's table; left in place" >&2; errs=1
  else
    rm -rf "$work" || errs=1
  fi
  if [ "$errs" != 0 ]; then
    echo "docker_cycle.sh: clean-up incomplete (see above)" >&2
    [ "$rc" = 0 ] && rc=1
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "docker_cycle.sh $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$("$cli" --version 2>/dev/null || echo docker CLI), work dir $work"

"$repo/scripts/busybox-rootfs.sh" "$work/rootfs"
tar -C "$work/rootfs" -cf "$work/rootfs.tar" .

setsid unshare --mount --propagation private dockerd \
  --data-root "$work/data" \
  --exec-root "$work/exec" \
  --pidfile "$work/dockerd.pid" \
  --host "unix://$sock" \
  --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
  --bridge none \
  --cgroup-parent "/$cg" \
  --exec-opt native.cgroupdriver=cgroupfs \
  >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!

start=$(date +%s.%N)
for i in $(seq 1200); do
  curl -sf --unix-socket "$sock" http://docker/_ping >/dev/null 2>&1 && break
  if ! kill -0 "$dockerd_pid" 2>/dev/null; then
    tail -n 20 "$work/dockerd.log" >&2
    die "dockerd exited during start-up (log above)"
  fi
  [ "$i" = 1200 ] && { tail -n 20 "$work/dockerd.log" >&2; die "dockerd not ready after 120 s (log above)"; }
  sleep 0.1
done
awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "dockerd ready after %.1f s\n", b - a }'

"$cli" -H "unix://$sock" import "$work/rootfs.tar" "$image" >/dev/null || die "docker import of the busybox rootfs failed"

# In the background and waited for, so SIGTERM to this script runs the
# clean-up at once (bash defers traps while a foreground child runs).
rc=0
/usr/bin/python3 "$repo/bench/sdkbench/docker_cycle.py" --socket "$sock" --image "$image" "$@" &
py_pid=$!
wait "$py_pid" || rc=$?
py_pid=
if [ "$rc" != 0 ]; then
  echo "docker_cycle.sh: docker_cycle.py failed (exit $rc); dockerd log: last lines" >&2
  tail -n 10 "$work/dockerd.log" >&2
fi
exit "$rc"
