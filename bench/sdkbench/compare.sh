#!/usr/bin/env bash
# Interleaved A/B of the SDK loop (issue 3) between two commits: builds each
# in its own git worktree, then runs cycle.py against a fresh `dsecd up` of
# each tree in turn, ROUNDS times, and prints every run and the medians.
#
#   sudo bench/sdkbench/compare.sh [--rounds N] [--pause S] [--settle LOAD] REV_A REV_B [cycle.py options]
#   sudo bench/sdkbench/compare.sh a4b234f HEAD --n 1000 --concurrency 200 --pool 200
#
# Why interleaved, and why CPU as well as rate: on these 2-core VMs the
# machine's state moves the loop's rate by ±25 % from one minute to the next
# (on ext4 without a journal every new inode scans the inodes its block group
# freed in the last minutes, so a run after a big cleanup pays more), more
# than most changes do. Runs of A and B next to each other see the same
# state; the CPU columns (dsecd with everything it started, agents and
# commands included, reaped at its shutdown; and the Python client, each from
# /usr/bin/time) count work rather than wall time, so they also move less.
# Each run includes dsecd's start and the pool's fill: compare like with like.
# --settle LOAD waits (up to 5 minutes) before each pair until the 1-minute
# load average is below LOAD, so that other work on the machine (tests, a
# previous run's teardown) is over; the load at each pair's start is printed.
#
# Needs root, make, go, /usr/bin/python3 with httpx, busybox-static, GNU time
# (/usr/bin/time: Debian package `time`). Removes its worktrees and data
# directories on exit.
set -euo pipefail

die() { echo "compare.sh: $*" >&2; exit 1; }

rounds=3
pause=20
settle=""
while [ $# -gt 0 ]; do
	case "$1" in
	--rounds) rounds=${2:?--rounds needs a number}; shift 2 ;;
	--pause) pause=${2:?--pause needs seconds}; shift 2 ;;
	--settle) settle=${2:?--settle needs a load average, e.g. 1.0}; shift 2 ;;
	*) break ;;
	esac
done
[ $# -ge 2 ] || die "usage: compare.sh [--rounds N] [--pause S] [--settle LOAD] REV_A REV_B [cycle.py options]"
[ -z "$settle" ] || awk -v l="$settle" 'BEGIN { exit !(l + 0 > 0) }' || die "--settle $settle: want a load average above 0, e.g. 1.0"
rev_a=$1 rev_b=$2
shift 2

[ "$(id -u)" = 0 ] || die "must run as root (dsecd creates namespaces, mounts and cgroups)"
[ -x /usr/bin/time ] || die "/usr/bin/time missing (apt-get install -y time)"
/usr/bin/python3 -c 'import httpx' 2>/dev/null || die "python3-httpx missing (apt-get install -y python3-httpx)"
command -v curl >/dev/null || die "curl not found"

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d /tmp/dsec-compare.XXXXXX)
pid=""
cleanup() {
	if [ -n "$pid" ]; then
		# /usr/bin/time's child is dsecd: Ctrl-C lets it destroy its
		# sandboxes and unmount its layers before its files go.
		kill -INT $(pgrep -P "$pid") 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	for t in a b; do
		[ -d "$work/$t" ] && git -C "$repo" worktree remove --force "$work/$t" >/dev/null 2>&1 || true
	done
	rm -rf "$work"
}
trap cleanup EXIT

for t in a b; do
	rev=$rev_a
	[ $t = b ] && rev=$rev_b
	git -C "$repo" worktree add -q --detach "$work/$t" "$rev" || die "no such revision: $rev"
	echo "building $t = $rev ($(git -C "$work/$t" log --oneline -1 | cut -c1-60))" >&2
	make -s -C "$work/$t" build >/dev/null || die "build of $rev failed"
done
rootfs=$work/busybox-rootfs
bash "$repo/scripts/busybox-rootfs.sh" "$rootfs" >/dev/null

port=7390
# run LABEL TREE [cycle.py options]: one run; appends "LABEL rate
# dsecd-cpu-s python-cpu-s" to $results. Not in a subshell, so that a
# failure's cleanup sees $pid and stops dsecd before removing its files.
run() {
	local label=$1 tree=$2 d
	shift 2
	d=$(mktemp -d "$work/run.XXXXXX")
	/usr/bin/time -f "%U %S" -o "$d/dsecd.time" "$tree/bin/dsecd" up --data-dir "$d/data" \
		--listen 127.0.0.1:$port --agent "$tree/bin/dsec-agent" --log-level warn \
		--import busybox:latest="$rootfs" >"$d/log" 2>&1 &
	pid=$!
	for _ in $(seq 150); do
		curl -sf http://127.0.0.1:$port/healthz >/dev/null && break
		sleep 0.2
	done
	curl -sf http://127.0.0.1:$port/healthz >/dev/null || die "dsecd up did not start (see $d/log)"
	DSEC_ENDPOINT=http://127.0.0.1:$port DSEC_TOKEN=$(cat "$d/data/admin.token") \
		/usr/bin/time -f "%U %S" -o "$d/py.time" /usr/bin/python3 "$tree/bench/sdkbench/cycle.py" \
		--image busybox:latest "$@" >"$d/out" 2>&1 || die "cycle.py failed: $(tail -3 "$d/out")"
	# /usr/bin/time's child is dsecd: Ctrl-C it so it destroys every
	# sandbox and reaps their agents (their CPU then counts as its).
	kill -INT "$(pgrep -P "$pid")" 2>/dev/null || true
	wait "$pid" || true
	pid=""
	local rate
	rate=$(grep -o '= [0-9.]* cycles/s' "$d/out" | head -1 | awk '{print $2}')
	echo "$label $rate $(awk '{print $1 + $2}' "$d/dsecd.time") $(awk '{print $1 + $2}' "$d/py.time")" >>"$results"
	rm -rf "$d"
}

# settle_down waits until the 1-minute load average is below $settle (at
# most 5 minutes) and prints it.
settle_down() {
	local i
	for i in $(seq 300); do
		awk -v l="$settle" '{ exit !($1 < l) }' /proc/loadavg && break
		sleep 1
	done
	echo "round $1: load average $(cut -d' ' -f1 /proc/loadavg) at its start, after waiting $((i - 1)) s" >&2
}

printf '%-6s %-3s %12s %14s %14s\n' round rev cycles/s dsecd-cpu-s python-cpu-s
results=$work/results
: >"$results"
for r in $(seq "$rounds"); do
	[ -z "$settle" ] || settle_down "$r"
	for t in a b; do
		run "$t" "$work/$t" "$@"
		# shellcheck disable=SC2046 # the fields of the line just added
		printf '%-6s %-3s %12s %14s %14s\n' "$r" $(tail -1 "$results")
	done
	[ "$r" = "$rounds" ] || sleep "$pause"
done
for t in a b; do
	rev=$rev_a
	[ $t = b ] && rev=$rev_b
	awk -v t=$t -v rev="$rev" '$1 == t { r[++n] = $2; c[n] = $3; p[n] = $4 }
		function med(a, n,   i, j, x) { for (i = 2; i <= n; i++) { x = a[i]; for (j = i - 1; j > 0 && a[j] > x; j--) a[j + 1] = a[j]; a[j + 1] = x } return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
		END { printf "median %s (%s): %.1f cycles/s, dsecd %.2f s, python %.2f s CPU per run\n", t, rev, med(r, n), med(c, n), med(p, n) }' "$results"
done
