#!/usr/bin/python3
"""SDK cycle benchmark: N sandboxes each created, `echo` run in it, destroyed,
with C cycles in flight at once, through the Python SDK against a running
DSec server. Prints complete cycles per second end to end.

    /usr/bin/python3 bench/sdkbench/cycle.py [--n 1000] [--concurrency 200] \\
        [--image busybox:latest] [--endpoint URL] [--token TOKEN] \\
        [--pool SIZE [--compare]] [--one-call] [--distinct]

With --pool SIZE a warm pool of the same spec is created first (the SDK's
create_pool) and filled before timing starts: each create then takes a
ready sandbox and each destroy hands it back to be reset in place. With
--compare as well, the loop runs once without the pool and then once with
it, against the same server in the same invocation, and the ratio is
printed. The pool is deleted at the end. With --one-call each cycle is
one request, the SDK's run: the node creates, runs and destroys back to
back.

With --distinct every cycle's spec (warm-up included) has its own env var
TASK=<n>, so no two creates share a spec key: no warm pool or automatic
pool (same-spec recycling) can serve them, as in an RL job whose every
task has its own workspace image. Only recycling across specs (the edge's
rebase pools) can spare such a create a new agent. The specs share the
image, so a rebase of a sandbox nobody wrote to keeps its root; the
containerbench dsec-rebase row measures rebases that change layers. When
the endpoint serves /metrics (dsecd up does), the node's creates by
source (fresh, rebased, recycled, pool) over the timed loop are printed
too.

Endpoint and token default as in the SDK ($DSEC_ENDPOINT / $DSEC_TOKEN /
the admin token of /var/lib/dsec). Uses Debian's python3 with python3-httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdk" / "python"))

import httpx  # noqa: E402
from libdsec import BackendKind, DSecClient, DSecError, SandboxSpec  # noqa: E402


def spec_source(spec: SandboxSpec, distinct: bool):
    """Returns the function that gives each cycle its spec: spec itself, or
    with --distinct spec with a TASK=<n> of its own."""
    if not distinct:
        return lambda: spec
    n = itertools.count()
    return lambda: dataclasses.replace(spec, env=[f"TASK={next(n)}"])


async def creates_by_source(endpoint: str):
    """The node's dsec_edge_sandbox_creates_total by source from the
    endpoint's /metrics (summed over backends), or None when it
    serves none (only a dsecd that runs the server and an edge in one
    process, as `dsecd up`, has both there)."""
    try:
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.get(endpoint.rstrip("/") + "/metrics")
        if r.status_code != 200:
            return None
    except httpx.HTTPError:
        return None
    out = collections.Counter()
    for line in r.text.splitlines():
        m = re.match(r'dsec_edge_sandbox_creates_total\{(.*)\} (\S+)$', line)
        if m:
            src = re.search(r'source="([^"]*)"', m.group(1))
            out[src.group(1) if src else "?"] += float(m.group(2))
    return out if out else None


async def cycle(client: DSecClient, spec: SandboxSpec, stats) -> None:
    t0 = time.perf_counter()
    try:
        sb = await client.create(spec)
    except DSecError as e:
        stats["errors"][f"create:{e.code}"] += 1
        return
    t1 = time.perf_counter()
    try:
        out = await sb.run(["echo", "hi"], timeout=60)
        t2 = time.perf_counter()
        if out.outcome != "ok" or out.stdout != "hi\n":
            stats["errors"][f"exec:{out.outcome}"] += 1
    finally:
        try:
            await client.destroy(sb.id)
        except DSecError as e:
            stats["errors"][f"destroy:{e.code}"] += 1
            return
    t3 = time.perf_counter()
    stats["create"].append(t1 - t0)
    stats["exec"].append(t2 - t1)
    stats["destroy"].append(t3 - t2)
    stats["cycle"].append(t3 - t0)


async def one_call_cycle(client: DSecClient, spec: SandboxSpec, stats) -> None:
    """The same cycle as one request: the SDK's run (create, exec and
    destroy back to back on the node). Only the whole cycle is timed."""
    t0 = time.perf_counter()
    try:
        out = await client.run(spec, ["echo", "hi"], timeout=60)
    except DSecError as e:
        stats["errors"][f"run:{e.code}"] += 1
        return
    if out.outcome != "ok" or out.stdout != "hi\n":
        stats["errors"][f"run:{out.outcome}"] += 1
        return
    stats["cycle"].append(time.perf_counter() - t0)


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def new_stats():
    return {"errors": collections.Counter(), "create": [], "exec": [], "destroy": [], "cycle": []}


async def timed_loop(client: DSecClient, specs, args):
    stats = new_stats()
    sem = asyncio.Semaphore(args.concurrency)

    async def bounded():
        async with sem:
            await cycle(client, specs(), stats)

    start = time.perf_counter()
    await asyncio.gather(*(bounded() for _ in range(args.n)))
    elapsed = time.perf_counter() - start
    return len(stats["cycle"]), elapsed, stats


def report(label: str, args, done: int, elapsed: float, stats) -> None:
    print(f"[{label}] complete cycles: {done}/{args.n} in {elapsed:.2f}s = {done / elapsed:.1f} cycles/s")
    for k in ("create", "exec", "destroy", "cycle"):
        xs = stats[k]
        if xs:
            print(
                f"  {k:8s} median {statistics.median(xs) * 1e3:8.1f} ms   p90 {pct(xs, 90) * 1e3:8.1f} ms   p99 {pct(xs, 99) * 1e3:8.1f} ms"
            )
    if stats["errors"]:
        print("  errors:", dict(stats["errors"]))


async def pool_info(client: DSecClient, pool_id: str):
    for p in await client.list_pools():
        if p.id == pool_id:
            return p
    raise RuntimeError(f"pool {pool_id} is gone")


async def wait_full(client: DSecClient, pool_id: str, size: int, timeout: float) -> float:
    """Waits until the pool holds size ready sandboxes and nothing is being
    reset; returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        p = await pool_info(client, pool_id)
        if p.ready >= size and p.resetting == 0:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(
                f"pool {pool_id} not full after {timeout:.0f}s: ready {p.ready}/{size}, resetting {p.resetting}, in use {p.in_use}"
            )
        await asyncio.sleep(0.05)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="cycles in total")
    ap.add_argument("--concurrency", type=int, default=200, help="cycles in flight at once")
    ap.add_argument("--image", default="busybox:latest")
    ap.add_argument("--endpoint")
    ap.add_argument("--token")
    ap.add_argument("--cpu", type=float, default=0, help="cores per sandbox (0: server default)")
    ap.add_argument("--mem-mb", type=float, default=0, help="MiB per sandbox (0: server default)")
    ap.add_argument("--warmup", type=int, default=20, help="cycles run first and not counted")
    ap.add_argument("--pool", type=int, default=0, metavar="SIZE", help="create a warm pool of SIZE sandboxes of the same spec first")
    ap.add_argument("--compare", action="store_true", help="with --pool: run the loop without the pool first, then with it")
    ap.add_argument("--pool-timeout", type=float, default=600, help="seconds to wait for the pool to fill")
    ap.add_argument("--one-call", action="store_true", help="each cycle is one request, the SDK's run (create, exec, destroy on the node), instead of three")
    ap.add_argument("--distinct", action="store_true", help="every cycle's spec has its own env var TASK=<n>: no two creates share a spec key")
    args = ap.parse_args()
    if args.one_call:
        global cycle
        cycle = one_call_cycle
    if args.n < 1 or args.concurrency < 1 or args.warmup < 0 or args.pool < 0:
        ap.error("--n and --concurrency must be >= 1, --warmup and --pool >= 0")
    if args.compare and not args.pool:
        ap.error("--compare needs --pool SIZE")
    if args.distinct and args.pool:
        ap.error("--distinct and --pool exclude each other: a pool serves one spec")

    # No resources by default: 200 in flight must fit the node's capacity
    # whatever its core count, and the benchmark measures the API path.
    resources = {k: v for k, v in (("cpu", args.cpu), ("mem_mb", args.mem_mb)) if v}
    spec = SandboxSpec(backend=BackendKind.CONTAINER, base_image=args.image, resources=resources)
    specs = spec_source(spec, args.distinct)
    ok = True
    async with await DSecClient.create(endpoint=args.endpoint, token=args.token, max_connections=max(64, args.concurrency * 2)) as client:
        print(
            f"endpoint {client.endpoint}  image {args.image}  n={args.n}  in flight={args.concurrency}  warm-up={args.warmup}"
            + ("  distinct specs" if args.distinct else "")
        )
        rates = {}
        if not args.pool or args.compare:
            label = "distinct specs" if args.distinct else "no pool"
            warm = new_stats()
            await asyncio.gather(*(cycle(client, specs(), warm) for _ in range(args.warmup)))
            if warm["errors"]:
                print(f"[{label}] warm-up errors: {dict(warm['errors'])}")
            before = await creates_by_source(client.endpoint)
            done, elapsed, stats = await timed_loop(client, specs, args)
            after = await creates_by_source(client.endpoint)
            report(label, args, done, elapsed, stats)
            if before is not None and after is not None:
                diff = {k: int(after[k] - before[k]) for k in sorted(after) if after[k] != before[k]}
                print(f"  node creates by source over the timed loop: {diff}")
            rates[label] = done / elapsed
            ok = ok and done == args.n
        if args.pool:
            label = f"pool {args.pool}"
            pool = await client.create_pool(spec, args.pool)
            try:
                filled = await wait_full(client, pool.id, args.pool, args.pool_timeout)
                print(f"[{label}] pool {pool.id} on node {pool.node}: {args.pool} ready in {filled:.2f}s")
                warm = new_stats()
                await asyncio.gather(*(cycle(client, specs(), warm) for _ in range(args.warmup)))
                if warm["errors"]:
                    print(f"[{label}] warm-up errors: {dict(warm['errors'])}")
                # Timing starts from a full pool, as a pool made ahead of a job.
                await wait_full(client, pool.id, args.pool, args.pool_timeout)
                before = await pool_info(client, pool.id)
                done, elapsed, stats = await timed_loop(client, specs, args)
                after = await pool_info(client, pool.id)
                report(label, args, done, elapsed, stats)
                rates[label] = done / elapsed
                ok = ok and done == args.n
                print(
                    f"  pool: hits {after.hits - before.hits}, misses {after.misses - before.misses} "
                    f"(creates that found no ready sandbox); at the end ready {after.ready}, resetting {after.resetting}"
                )
                settle = await wait_full(client, pool.id, args.pool, args.pool_timeout)
                print(
                    f"  the pool was full and idle again {settle:.2f}s after the last cycle: "
                    f"{done / (elapsed + settle):.1f} cycles/s with its deferred resets paid for"
                )
            finally:
                await client.delete_pool(pool.id)
        if len(rates) == 2:
            a, b = rates["no pool"], rates[f"pool {args.pool}"]
            print(f"pooled/unpooled throughput: {b / a:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
