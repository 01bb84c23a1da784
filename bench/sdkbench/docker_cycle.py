#!/usr/bin/python3
"""Docker's side of the SDK cycle benchmark (issue 3): the loop of cycle.py,
N containers each created, `echo hello` run in it, destroyed, with C cycles
in flight at once, through the Docker Engine HTTP API on a unix socket.
Prints complete cycles per second end to end, in cycle.py's format.

    /usr/bin/python3 bench/sdkbench/docker_cycle.py --socket SOCK \\
        [--n 60] [--concurrency 200] [--warmup 5] \\
        [--image dsecbench-busybox:latest] [--network none]

One cycle, as a Docker API client would do it:

    create   POST   /containers/create  {Image, Cmd: [/bin/sleep, 1000000],
                                         HostConfig.NetworkMode: none}
             POST   /containers/{id}/start
    exec     POST   /containers/{id}/exec  {Cmd: [echo, hello], AttachStdout}
             POST   /exec/{id}/start       (stdout demultiplexed, must be "hello\\n")
    destroy  DELETE /containers/{id}?force=1

"create" is create plus start, because DSec's create returns a running
sandbox; both parts are also reported on their own. The network defaults
to "none" (a network namespace with loopback only), which is what a DSec
sandbox has. The image must already exist in the daemon: docker_cycle.sh
starts a private dockerd, imports the busybox rootfs and runs this script.

Exits non-zero with a message when dockerd is not reachable, the image is
missing, or any cycle fails (an error, a timeout, wrong output); failed
cycles are not counted as complete. Uses Debian's python3 with
python3-httpx only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import struct
import sys
import time
import urllib.parse

import httpx


class CycleError(Exception):
    """A step of a cycle failed; str() names the step and the cause."""

    def __init__(self, step: str, why: str):
        super().__init__(f"{step}: {why}")
        self.step = step
        self.why = why


class Docker:
    """The few Engine API calls a cycle needs, on one pooled client."""

    def __init__(self, client: httpx.AsyncClient, prefix: str):
        self.client = client
        self.prefix = prefix  # "/v1.41": pin the version the daemon speaks

    async def call(self, step: str, method: str, path: str, ok: tuple, body=None) -> httpx.Response:
        try:
            r = await self.client.request(method, self.prefix + path, json=body)
        except httpx.TimeoutException as e:
            raise CycleError(step, f"timeout ({type(e).__name__})") from e
        except httpx.HTTPError as e:
            raise CycleError(step, f"{type(e).__name__}: {e}") from e
        if r.status_code not in ok:
            raise CycleError(step, f"HTTP {r.status_code}: {r.text.strip()[:400]}")
        return r

    async def create(self, image: str, network: str) -> str:
        body = {
            "Image": image,
            "Cmd": ["/bin/sleep", "1000000"],
            "HostConfig": {"NetworkMode": network},
        }
        r = await self.call("create", "POST", "/containers/create", (201,), body)
        return r.json()["Id"]

    async def start(self, cid: str) -> None:
        await self.call("start", "POST", f"/containers/{cid}/start", (204,))

    async def exec_output(self, cid: str, argv: list) -> str:
        r = await self.call(
            "exec",
            "POST",
            f"/containers/{cid}/exec",
            (201,),
            {"Cmd": argv, "AttachStdout": True, "AttachStderr": True},
        )
        eid = r.json()["Id"]
        # Without a TTY the answer is Docker's multiplexed raw stream, sent
        # on a hijacked connection that dockerd closes when the process
        # exits: the body ends at EOF (no length, not chunked).
        r = await self.call("exec", "POST", f"/exec/{eid}/start", (200,), {"Detach": False, "Tty": False})
        return demux(r.content)

    async def remove(self, cid: str) -> None:
        await self.call("destroy", "DELETE", f"/containers/{cid}?force=1", (204,))


def demux(raw: bytes) -> str:
    """stdout of a multiplexed stream: frames of an 8-byte header (stream
    type, 3 zero bytes, big-endian length) and a payload. stderr is
    returned too, tagged, so wrong output shows it."""
    out, err, i = [], [], 0
    while i + 8 <= len(raw):
        kind, size = raw[i], struct.unpack(">I", raw[i + 4 : i + 8])[0]
        payload = raw[i + 8 : i + 8 + size]
        (err if kind == 2 else out).append(payload)
        i += 8 + size
    if i != len(raw):
        raise CycleError("exec", f"truncated exec stream ({len(raw)} bytes): {raw[:80]!r}")
    s = b"".join(out).decode(errors="replace")
    if err:
        s += "[stderr] " + b"".join(err).decode(errors="replace")
    return s


def new_stats():
    return {
        "errors": collections.Counter(),
        "create": [],
        "  create call": [],
        "  start call": [],
        "exec": [],
        "destroy": [],
        "cycle": [],
    }


async def cycle(d: Docker, args, stats) -> None:
    t0 = time.perf_counter()
    cid = None
    step = "create"
    try:
        cid = await d.create(args.image, args.network)
        ta = time.perf_counter()
        await d.start(cid)
        t1 = time.perf_counter()
        step = "exec"
        out = await d.exec_output(cid, ["echo", "hello"])
        if out != "hello\n":
            raise CycleError("exec", f"output {out!r}, want 'hello\\n'")
        t2 = time.perf_counter()
        step = "destroy"
        await d.remove(cid)
        cid = None
        t3 = time.perf_counter()
    except CycleError as e:
        stats["errors"][f"{e.step}: {e.why}"] += 1
        return
    except Exception as e:  # a bug or an unexpected answer: still a failed cycle
        stats["errors"][f"{step}: {type(e).__name__}: {e}"] += 1
        return
    finally:
        if cid is not None:
            # Failed after create: the container must not outlive the cycle.
            try:
                await d.remove(cid)
            except CycleError as e:
                stats["errors"][f"cleanup {e.step}: {e.why}"] += 1
    stats["create"].append(t1 - t0)
    stats["  create call"].append(ta - t0)
    stats["  start call"].append(t1 - ta)
    stats["exec"].append(t2 - t1)
    stats["destroy"].append(t3 - t2)
    stats["cycle"].append(t3 - t0)


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def report(label: str, args, done: int, elapsed: float, stats) -> None:
    print(f"[{label}] complete cycles: {done}/{args.n} in {elapsed:.2f}s = {done / elapsed:.1f} cycles/s")
    for k in ("create", "  create call", "  start call", "exec", "destroy", "cycle"):
        xs = stats[k]
        if xs:
            print(
                f"  {k:14s} median {statistics.median(xs) * 1e3:8.1f} ms   p90 {pct(xs, 90) * 1e3:8.1f} ms   p99 {pct(xs, 99) * 1e3:8.1f} ms"
            )
    if stats["errors"]:
        print("  errors:")
        for why, count in stats["errors"].most_common():
            print(f"    {count:5d} x {why}")


async def connect(args) -> Docker:
    """A client on the socket, with the daemon's API version pinned; exits
    with a message if dockerd does not answer or lacks the image."""
    if not os.path.exists(args.socket):
        sys.exit(f"docker_cycle: no socket at {args.socket}: is dockerd running? (bench/sdkbench/docker_cycle.sh starts one)")
    # Every in-flight cycle holds at most one connection; exec start's
    # connection is closed by dockerd after each use.
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    transport = httpx.AsyncHTTPTransport(uds=args.socket, limits=limits)
    client = httpx.AsyncClient(transport=transport, base_url="http://docker", timeout=args.timeout)
    try:
        r = await client.get("/_ping", timeout=10)
        r.raise_for_status()
    except httpx.HTTPError as e:
        await client.aclose()
        sys.exit(f"docker_cycle: dockerd at {args.socket} not reachable: {type(e).__name__}: {e}")
    version = r.headers.get("Api-Version")
    if not version:
        await client.aclose()
        sys.exit(f"docker_cycle: {args.socket} answered /_ping without an Api-Version header: not dockerd?")
    d = Docker(client, f"/v{version}")
    info = (await client.get(f"/v{version}/version")).json()
    r = await client.get(f"/v{version}/images/{urllib.parse.quote(args.image, safe=':/')}/json")
    if r.status_code != 200:
        await client.aclose()
        sys.exit(f"docker_cycle: image {args.image} not in dockerd (HTTP {r.status_code}); import the busybox rootfs first")
    print(
        f"dockerd {info.get('Version')} (API {version}, {info.get('Os')}/{info.get('Arch')}) at {args.socket}  "
        f"image {args.image}  network {args.network}  n={args.n}  in flight={args.concurrency}"
        + (f" (so all {args.n} at once)" if args.n < args.concurrency else "")
        + f"  warm-up={args.warmup}"
    )
    return d


async def leftovers(d: Docker) -> list:
    """Ids of the containers dockerd holds; raises CycleError if it cannot say."""
    r = await d.call("list", "GET", "/containers/json?all=1", (200,))
    return [c["Id"][:12] for c in r.json()]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=os.environ.get("DOCKER_SOCK"), help="dockerd's unix socket (default $DOCKER_SOCK)")
    ap.add_argument("--n", type=int, default=60, help="cycles in total (Docker runs ~1 container/s here)")
    ap.add_argument("--concurrency", type=int, default=200, help="cycles in flight at once")
    ap.add_argument("--warmup", type=int, default=5, help="cycles run first, all at once, and not counted")
    ap.add_argument("--image", default="dsecbench-busybox:latest")
    ap.add_argument("--network", default="none", help='HostConfig.NetworkMode ("none": loopback only, as a DSec sandbox)')
    ap.add_argument("--timeout", type=float, default=600, help="seconds per API call before it counts as a failed cycle")
    args = ap.parse_args()
    if not args.socket:
        ap.error("--socket (or $DOCKER_SOCK) is required")
    if args.n < 1 or args.concurrency < 1 or args.warmup < 0 or args.timeout <= 0:
        ap.error("--n and --concurrency must be >= 1, --warmup >= 0, --timeout > 0")

    d = await connect(args)
    try:
        before = await leftovers(d)
        if before:
            print(f"note: dockerd already holds {len(before)} containers: {' '.join(before[:10])}")
        warm = new_stats()
        await asyncio.gather(*(cycle(d, args, warm) for _ in range(args.warmup)))
        if warm["errors"]:
            print(f"[warm-up] errors: {dict(warm['errors'])}")

        stats = new_stats()
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded():
            async with sem:
                await cycle(d, args, stats)

        start = time.perf_counter()
        await asyncio.gather(*(bounded() for _ in range(args.n)))
        elapsed = time.perf_counter() - start
        done = len(stats["cycle"])
        report("docker", args, done, elapsed, stats)
        try:
            left = [c for c in await leftovers(d) if c not in before]
        except CycleError as e:
            left = [f"(cannot list: {e})"]
    finally:
        await d.client.aclose()
    failed = []
    if warm["errors"]:
        failed.append(f"{sum(warm['errors'].values())} warm-up cycles failed")
    if done != args.n:
        failed.append(f"{args.n - done} of {args.n} cycles failed")
    if left:
        failed.append(f"containers left behind: {' '.join(left[:10])}")
    if failed:
        print("docker_cycle: FAIL: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
