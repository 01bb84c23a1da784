#!/usr/bin/python3
"""SDK cycle benchmark: N sandboxes each created, `echo` run in it, destroyed,
with C cycles in flight at once, through the Python SDK against a running
DSec server. Prints complete cycles per second end to end.

    /usr/bin/python3 bench/sdkbench/cycle.py [--n 1000] [--concurrency 200] \
        [--image busybox:latest] [--endpoint URL] [--token TOKEN]

Endpoint and token default as in the SDK ($DSEC_ENDPOINT / $DSEC_TOKEN /
the admin token of /var/lib/dsec). Uses Debian's python3 with python3-httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdk" / "python"))

from libdsec import BackendKind, DSecClient, DSecError, SandboxSpec  # noqa: E402


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


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


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
    args = ap.parse_args()

    # No resources by default: 200 in flight must fit the node's capacity
    # whatever its core count, and the benchmark measures the API path.
    resources = {k: v for k, v in (("cpu", args.cpu), ("mem_mb", args.mem_mb)) if v}
    spec = SandboxSpec(backend=BackendKind.CONTAINER, base_image=args.image, resources=resources)
    async with await DSecClient.create(endpoint=args.endpoint, token=args.token, max_connections=max(64, args.concurrency * 2)) as client:
        warm = {"errors": collections.Counter(), "create": [], "exec": [], "destroy": [], "cycle": []}
        await asyncio.gather(*(cycle(client, spec, warm) for _ in range(args.warmup)))

        stats = {"errors": collections.Counter(), "create": [], "exec": [], "destroy": [], "cycle": []}
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded():
            async with sem:
                await cycle(client, spec, stats)

        start = time.perf_counter()
        await asyncio.gather(*(bounded() for _ in range(args.n)))
        elapsed = time.perf_counter() - start

    done = len(stats["cycle"])
    print(f"endpoint {client.endpoint}  image {args.image}  n={args.n}  in flight={args.concurrency}")
    print(f"complete cycles: {done}/{args.n} in {elapsed:.2f}s = {done / elapsed:.1f} cycles/s")
    for k in ("create", "exec", "destroy", "cycle"):
        xs = stats[k]
        if xs:
            print(
                f"  {k:8s} median {statistics.median(xs) * 1e3:8.1f} ms   p90 {pct(xs, 90) * 1e3:8.1f} ms   p99 {pct(xs, 99) * 1e3:8.1f} ms"
            )
    if stats["errors"]:
        print("errors:", dict(stats["errors"]))
    return 0 if done == args.n else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
