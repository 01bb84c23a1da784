#!/usr/bin/python3
"""A rollout wave (issue 14), driven by bench/densitybench: R rollouts
started at once, each in a sandbox of its own with its own workspace,
3-10 steps with think time before each, through the Python SDK (libdsec)
against a running DSec, or through the Docker Engine API against a dockerd.
Prints one JSON object on stdout; progress goes to stderr.

    /usr/bin/python3 bench/densitybench/wave.py --backend dsec \\
        --endpoint URL --token TOKEN --workspace-prefix ws/r [--r 200] ...
    /usr/bin/python3 bench/densitybench/wave.py --backend docker \\
        --socket SOCK --image IMG --workspace-dir DIR [--r 200] ...

First --empty rollouts run alone, one after another, with --empty-steps
steps back to back: the empty node's create, step and destroy times. Then
the wave: every rollout is started at once; each creates its sandbox
(DSec: base busybox:latest, workspace <prefix><i>:latest, resources cpu
and mem_mb; Docker: the image with <dir>/<i> bind-mounted at /work,
NanoCpus and Memory set, network none), then for each step thinks (sleeps
a time drawn uniformly from --think-min..--think-max) and runs the step,
then destroys the sandbox. The plan (steps per rollout, think times) comes
from --seed, so both systems run the same plan. A create the service
refuses for lack of room (DSec: resource_exhausted or unavailable) is
retried after its retry-after hint (at least 1 s) and counted; it is not
an error, but the wait counts in the wall time.

One step, in /work of the rollout's workspace (files app.sh, test.sh):
edit app.sh with sed, append to log.txt, run test.sh, which must print
"ok <rollout> <step>". Outcomes: ok; failure (the command ran and failed
or printed something else); infra error (DSec: outcome infra_error or an
API error; Docker: an API error).

Uses Debian's python3 with python3-httpx only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import struct
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdk" / "python"))


def log(*a):
    print("wave:", *a, file=sys.stderr, flush=True)


def plan(args):
    """Per rollout: the think time before each of its steps (seconds)."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.r):
        n = rng.randint(args.steps_min, args.steps_max)
        out.append([rng.uniform(args.think_min, args.think_max) for _ in range(n)])
    return out


def step_cmd(k: int) -> str:
    return f"cd /work && sed -i 's/^STEP=.*/STEP={k}/' app.sh && echo {k} >>log.txt && sh test.sh {k}"


def step_want(name: str, k: int) -> str:
    return f"ok {name} {k}\n"


class InfraError(Exception):
    """The platform failed (not the command)."""


class Refused(Exception):
    """No room now; retry after .retry_after seconds."""

    def __init__(self, msg: str, retry_after: float):
        super().__init__(msg)
        self.retry_after = retry_after


# ----------------------------------------------------------------- DSec


class DSecBackend:
    def __init__(self, args):
        self.args = args
        self.client = None

    async def open(self):
        from libdsec import DSecClient  # noqa: E402

        self.client = await DSecClient.create(
            endpoint=self.args.endpoint, token=self.args.token, max_connections=self.args.r + 64, timeout=600
        )

    async def close(self):
        await self.client.close()

    def workspace(self, i):
        return f"{self.args.workspace_prefix}{i}:latest"

    async def create(self, i, name):
        from libdsec import DSecError, ResourceExhaustedError, SandboxSpec, UnavailableError

        spec = SandboxSpec(
            base_image=self.args.base,
            workspace=self.workspace(i),
            resources={"cpu": self.args.cpu, "mem_mb": self.args.mem_mb},
            labels={"bench": "densitybench-wave"},
        )
        try:
            return await self.client.create(spec)
        except (ResourceExhaustedError, UnavailableError) as e:
            raise Refused(str(e), e.retry_after or 0.0) from e
        except DSecError as e:
            raise InfraError(f"create: {e}") from e

    async def step(self, sb, name, k):
        from libdsec import DSecError

        try:
            r = await sb.run(["sh", "-c", step_cmd(k)], timeout=120)
        except DSecError as e:
            raise InfraError(f"exec: {e}") from e
        if r.outcome == "infra_error":
            raise InfraError(f"exec: infra_error: {r.infra_error}")
        if r.outcome != "ok" or r.stdout != step_want(name, k):
            return f"outcome {r.outcome} exit {r.exit_code} stdout {r.stdout!r} stderr {r.stderr[-200:]!r}"
        return None

    async def destroy(self, sb):
        from libdsec import DSecError

        try:
            await self.client.destroy(sb.id)
        except DSecError as e:
            raise InfraError(f"destroy: {e}") from e


# --------------------------------------------------------------- Docker


class DockerBackend:
    """The Engine API calls `docker run -d --cpus C --memory M -v DIR:/work
    --network none IMAGE sleep`, `docker exec` and `docker rm -f` make."""

    def __init__(self, args):
        self.args = args
        self.http = None
        self.prefix = ""

    async def open(self):
        tr = httpx.AsyncHTTPTransport(uds=self.args.socket)
        limits = httpx.Limits(max_connections=self.args.r + 64, max_keepalive_connections=self.args.r + 64)
        self.http = httpx.AsyncClient(transport=tr, base_url="http://docker", timeout=600, limits=limits)
        r = await self.http.get("/_ping")
        ver = r.headers.get("Api-Version")
        if r.status_code != 200 or not ver:
            sys.exit(f"wave: dockerd at {self.args.socket} does not answer /_ping ({r.status_code})")
        self.prefix = f"/v{ver}"

    async def close(self):
        await self.http.aclose()

    async def call(self, what, method, path, ok, body=None):
        try:
            r = await self.http.request(method, self.prefix + path, json=body)
        except httpx.HTTPError as e:
            raise InfraError(f"{what}: {type(e).__name__}: {e}") from e
        if r.status_code not in ok:
            raise InfraError(f"{what}: HTTP {r.status_code}: {r.text.strip()[:300]}")
        return r

    async def create(self, i, name):
        body = {
            "Image": self.args.image,
            "Cmd": ["/bin/sleep", "1000000"],
            "Labels": {"bench": "densitybench-wave"},
            "HostConfig": {
                "NetworkMode": "none",
                "NanoCpus": int(self.args.cpu * 1e9),
                "Memory": int(self.args.mem_mb) << 20,
                "Binds": [f"{self.args.workspace_dir}/{i}/work:/work"],
            },
        }
        r = await self.call("create", "POST", "/containers/create", (201,), body)
        cid = r.json()["Id"]
        try:
            await self.call("start", "POST", f"/containers/{cid}/start", (204,))
        except InfraError:
            await self.destroy(cid)
            raise
        return cid

    async def step(self, cid, name, k):
        r = await self.call(
            "exec", "POST", f"/containers/{cid}/exec", (201,),
            {"Cmd": ["sh", "-c", step_cmd(k)], "AttachStdout": True, "AttachStderr": True},
        )
        eid = r.json()["Id"]
        r = await self.call("exec start", "POST", f"/exec/{eid}/start", (200,), {"Detach": False, "Tty": False})
        out, err = demux(r.content)
        r = await self.call("exec inspect", "GET", f"/exec/{eid}/json", (200,))
        code = r.json().get("ExitCode")
        if code != 0 or out != step_want(name, k):
            return f"exit {code} stdout {out!r} stderr {err[-200:]!r}"
        return None

    async def destroy(self, cid):
        await self.call("destroy", "DELETE", f"/containers/{cid}?force=1", (204,))


def demux(raw: bytes):
    """stdout and stderr of Docker's multiplexed exec stream."""
    out, err, i = [], [], 0
    while i + 8 <= len(raw):
        kind, size = raw[i], struct.unpack(">I", raw[i + 4 : i + 8])[0]
        (err if kind == 2 else out).append(raw[i + 8 : i + 8 + size])
        i += 8 + size
    if i != len(raw):
        raise InfraError(f"exec: truncated stream ({len(raw)} bytes)")
    return b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace")


# ----------------------------------------------------------------- wave


def pct(xs, p):
    """Nearest-rank percentile (as bench/internal/dsecup)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    rank = max(1, min(len(xs), -(-p * len(xs) // 100)))
    return xs[int(rank) - 1]


class Wave:
    def __init__(self, backend, args):
        self.b = backend
        self.args = args
        self.alive = 0
        self.peak = 0
        self.refusals = 0
        self.create_lat = []
        self.step_lat = []
        self.step_at = []  # each step's start, perf_counter
        self.last_create = 0.0
        self.destroy_lat = []
        self.infra = collections.Counter()
        self.failures = collections.Counter()
        self.completed = 0
        self.failed_rollouts = 0
        self.created = 0
        self.deadline = 0.0

    async def create(self, i, name):
        """Creates rollout i's sandbox, retrying refusals; returns (handle,
        seconds including waits for room)."""
        t0 = time.perf_counter()
        while True:
            try:
                h = await self.b.create(i, name)
                return h, time.perf_counter() - t0
            except Refused as e:
                self.refusals += 1
                if time.monotonic() > self.deadline:
                    raise InfraError(f"create: still refused at the wave's deadline: {e}") from e
                await asyncio.sleep(max(1.0, e.retry_after) * random.uniform(1.0, 1.2))

    async def rollout(self, i, thinks, start: asyncio.Event, ends: list):
        name = f"r{i}"
        await start.wait()
        h = None
        ok = True
        try:
            h, dt = await self.create(i, name)
            self.last_create = max(self.last_create, time.perf_counter())
            self.create_lat.append(dt)
            self.created += 1
            self.alive += 1
            self.peak = max(self.peak, self.alive)
            for k, think in enumerate(thinks, 1):
                await asyncio.sleep(think)
                t = time.perf_counter()
                bad = await self.b.step(h, name, k)
                self.step_lat.append(time.perf_counter() - t)
                self.step_at.append(t)
                if bad:
                    ok = False
                    self.failures[bad[:160]] += 1
                    break
        except InfraError as e:
            ok = False
            self.infra[str(e)[:200]] += 1
        except Exception as e:  # a bug or an unexpected answer: an infra error of the harness
            ok = False
            self.infra[f"{type(e).__name__}: {e}"[:200]] += 1
        finally:
            if h is not None:
                self.alive -= 1
                t = time.perf_counter()
                try:
                    await self.b.destroy(h)
                    self.destroy_lat.append(time.perf_counter() - t)
                except InfraError as e:
                    ok = False
                    self.infra[str(e)[:200]] += 1
        ends.append(time.perf_counter())
        if ok:
            self.completed += 1
        else:
            self.failed_rollouts += 1


async def empty_node(b, args):
    """--empty rollouts alone, steps back to back: the empty node."""
    creates, steps, destroys = [], [], []
    for e in range(args.empty):
        i, name = "empty", "rempty"
        t = time.perf_counter()
        h = await b.create(i, name)
        creates.append(time.perf_counter() - t)
        try:
            for k in range(1, args.empty_steps + 1):
                t = time.perf_counter()
                bad = await b.step(h, name, k + e * args.empty_steps)
                steps.append(time.perf_counter() - t)
                if bad:
                    raise InfraError(f"empty-node step failed: {bad}")
        finally:
            t = time.perf_counter()
            await b.destroy(h)
            destroys.append(time.perf_counter() - t)
    return {
        "rollouts": args.empty,
        "steps": len(steps),
        "create_p50_ms": pct(creates, 50) * 1e3,
        "step_p50_ms": pct(steps, 50) * 1e3,
        "step_p99_ms": pct(steps, 99) * 1e3,
        "destroy_p50_ms": pct(destroys, 50) * 1e3,
    }


async def main_async(args):
    b = DSecBackend(args) if args.backend == "dsec" else DockerBackend(args)
    await b.open()
    try:
        try:
            empty = await empty_node(b, args)
        except (InfraError, Refused) as e:
            sys.exit(f"wave: the empty node's rollouts failed: {e}")
        log(f"empty node: step p50 {empty['step_p50_ms']:.1f} ms p99 {empty['step_p99_ms']:.1f} ms")

        thinks = plan(args)
        w = Wave(b, args)
        start = asyncio.Event()
        ends = []
        tasks = [asyncio.create_task(w.rollout(i, thinks[i], start, ends)) for i in range(args.r)]
        await asyncio.sleep(0)  # every task waits on start
        t0 = time.perf_counter()
        w.deadline = time.monotonic() + args.timeout

        async def progress():
            while True:
                await asyncio.sleep(10)
                log(f"{time.perf_counter() - t0:.0f}s: alive {w.alive} (peak {w.peak}), created {w.created}, "
                    f"done {w.completed + w.failed_rollouts}/{args.r}, refusals {w.refusals}")

        prog = asyncio.create_task(progress())
        start.set()
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.timeout + 600)
        finally:
            prog.cancel()
        wall = (max(ends) if ends else time.perf_counter()) - t0

        # The ideal: each rollout alone on an empty node (create, its think
        # times, its steps at the empty node's median, destroy); the wave
        # can end no sooner than its longest one.
        e_create, e_step, e_destroy = (empty[k] / 1e3 for k in ("create_p50_ms", "step_p50_ms", "destroy_p50_ms"))
        ideals = [e_create + sum(t) + len(t) * e_step + e_destroy for t in thinks]
        ideal = max(ideals)
        steps_planned = sum(len(t) for t in thinks)
        step_p50, step_p99 = pct(w.step_lat, 50) * 1e3, pct(w.step_lat, 99) * 1e3
        # Steps that started once every create had returned: the steady
        # state, apart from the interference of the creation burst.
        steady = [d for d, at in zip(w.step_lat, w.step_at) if at >= w.last_create]
        return {
            "backend": args.backend,
            "r": args.r,
            "seed": args.seed,
            "empty": empty,
            "peak_alive": w.peak,
            "created": w.created,
            "completed": w.completed,
            "failed_rollouts": w.failed_rollouts,
            "wall_s": wall,
            "ideal_s": ideal,
            "wall_over_ideal": wall / ideal if ideal > 0 else 0,
            "rollouts_per_s": w.completed / wall if wall > 0 else 0,
            "steps_planned": steps_planned,
            "steps_run": len(w.step_lat),
            "think_total_s": sum(sum(t) for t in thinks),
            "step_p50_ms": step_p50,
            "step_p99_ms": step_p99,
            "step_max_ms": max(w.step_lat, default=0) * 1e3,
"steady_steps": len(steady),
            "steady_step_p50_ms": pct(steady, 50) * 1e3,
            "steady_step_p99_ms": pct(steady, 99) * 1e3,
            "last_create_s": w.last_create - t0 if w.last_create else 0,
            "step_p50_over_empty": step_p50 / empty["step_p50_ms"] if empty["step_p50_ms"] else 0,
            "step_p99_over_empty": step_p99 / empty["step_p99_ms"] if empty["step_p99_ms"] else 0,
            "create_p50_ms": pct(w.create_lat, 50) * 1e3,
            "create_p99_ms": pct(w.create_lat, 99) * 1e3,
            "create_max_ms": max(w.create_lat, default=0) * 1e3,
            "destroy_p50_ms": pct(w.destroy_lat, 50) * 1e3,
            "create_refusals": w.refusals,
            "infra_errors": sum(w.infra.values()),
            "infra_error_kinds": dict(w.infra.most_common(10)),
            "failures": sum(w.failures.values()),
            "failure_kinds": dict(w.failures.most_common(10)),
        }
    finally:
        await b.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("dsec", "docker"), required=True)
    p.add_argument("--r", type=int, default=200)
    p.add_argument("--steps-min", type=int, default=3)
    p.add_argument("--steps-max", type=int, default=10)
    p.add_argument("--think-min", type=float, default=1.0)
    p.add_argument("--think-max", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cpu", type=float, default=2)
    p.add_argument("--mem-mb", type=int, default=4096)
    p.add_argument("--empty", type=int, default=3)
    p.add_argument("--empty-steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=7200, help="seconds: refused creates stop retrying after this")
    p.add_argument("--endpoint")
    p.add_argument("--token")
    p.add_argument("--base", default="busybox:latest")
    p.add_argument("--workspace-prefix", default="ws/r")
    p.add_argument("--socket")
    p.add_argument("--image")
    p.add_argument("--workspace-dir")
    args = p.parse_args()
    if args.backend == "dsec" and not args.endpoint:
        p.error("--backend dsec needs --endpoint")
    if args.backend == "docker" and not (args.socket and args.image and args.workspace_dir):
        p.error("--backend docker needs --socket, --image and --workspace-dir")
    # One connection per rollout in flight: a soft limit of 1024
    # descriptors would cap the wave below the target of 1,000.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    res = asyncio.run(main_async(args))
    json.dump(res, sys.stdout)
    print()


if __name__ == "__main__":
    main()
