"""Warm pools against the live `dsec up` of conftest.py: a pool fills, an
acquire with its spec is served from it, a released sandbox comes back
reset, and the CLI's `dsec pool` commands show the same."""

import asyncio
import json
import time
import uuid

import pytest

from libdsec import BackendKind, DSecClient, NotFoundError, PoolInfo, SandboxSpec

IMAGE = "busybox:latest"
# A pool fills in the background; this bounds how long a test polls for it.
FILL_DEADLINE_S = 60.0


def spec(tag: str, **kw) -> SandboxSpec:
    # The env makes the spec this test's own: no other test's creates
    # match the pool (env is part of what a pool matches).
    return SandboxSpec(
        backend=BackendKind.CONTAINER, base_image=IMAGE, resources={"cpu": 0.25, "mem_mb": 64}, env=[f"POOL_TEST={tag}"], **kw
    )


async def connect(server) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=server.token)


async def wait_pool(client: DSecClient, pool_id: str, cond, what: str) -> PoolInfo:
    """Polls list_pools until the pool satisfies cond (bounded)."""
    deadline = time.monotonic() + FILL_DEADLINE_S
    while True:
        pools = {p.id: p for p in await client.list_pools()}
        assert pool_id in pools, f"pool {pool_id} is not listed: {sorted(pools)}"
        p = pools[pool_id]
        if cond(p):
            return p
        if time.monotonic() > deadline:
            raise AssertionError(f"pool {pool_id}: {what} not reached in {FILL_DEADLINE_S}s: {p}")
        await asyncio.sleep(0.05)


async def test_pool_serves_acquire_and_takes_back_reset_sandboxes(server):
    tag = uuid.uuid4().hex[:12]
    async with await connect(server) as client:
        pool = await client.create_pool(spec(tag), 2)
        sbs, again = [], []
        try:
            assert pool.id and pool.size == 2
            assert pool.spec is not None and pool.spec.base_image == IMAGE
            # What the spec gave, and the node's defaults for the rest.
            assert pool.spec.resources == {"cpu": 0.25, "mem_mb": 64, "pids": 1024, "disk_mb": 10240}
            p = await wait_pool(client, pool.id, lambda p: p.ready == 2, "ready == 2")
            hits, misses = p.hits, p.misses

            # Labels are the new sandbox's own: they do not stop a match.
            sbs = await client.acquire(2, spec(tag, labels={"user": tag}))
            p = await wait_pool(client, pool.id, lambda p: p.hits >= hits + 2, "two more hits")
            assert (p.hits, p.misses, p.in_use) == (hits + 2, misses, 2)
            for sb in sbs:
                info = await client.get(sb.id)
                assert info.labels == {"user": tag} and info.state == "running"
                assert sb.next_seq == 1

            # Dirty them: a file and a process each.
            outs = await client.batch_exec(sbs, f"echo {tag} > /root/dirty; sleep 9999 >/dev/null 2>&1 & echo $POOL_TEST")
            assert [(o.stdout, o.seq) for o in outs] == [(f"{tag}\n", 1)] * 2
            assert await client.release(sbs, return_exceptions=True) == [None, None]
            # Released sandboxes are reset and go back: the pool is full again.
            p = await wait_pool(client, pool.id, lambda p: p.ready == 2 and p.in_use == 0, "ready == 2 after release")

            # Three from a pool of two: two warm, one created on the spot.
            again = await client.acquire(3, spec(tag))
            p = await wait_pool(client, pool.id, lambda p: p.hits >= hits + 4, "two more hits")
            assert (p.hits, p.misses) == (hits + 4, misses + 1)
            outs = await client.batch_exec(again, "test -e /root/dirty && echo dirty || echo clean; ps -o pid,args")
            # Nobody sees a previous user's files or processes; each handle
            # starts its own numbering.
            for o in outs:
                assert o.ok and o.seq == 1 and o.stdout.startswith("clean\n"), o.stdout
                assert "sleep 9999" not in o.stdout, f"a previous user's process survived the reset:\n{o.stdout}"
        finally:
            await client.release([*sbs, *again], return_exceptions=True)
            await client.delete_pool(pool.id)
        assert pool.id not in {p.id for p in await client.list_pools()}
        with pytest.raises(NotFoundError):
            await client.delete_pool(pool.id)


async def test_pool_arguments(server):
    async with await connect(server) as client:
        with pytest.raises(ValueError):
            await client.create_pool(spec("x"), 0)
        with pytest.raises(ValueError):
            await client.create_pool(spec("x"), 2, min_size=3)
        with pytest.raises(NotFoundError):
            await client.create_pool(SandboxSpec(base_image="no-such-image:1"), 1)


def test_pool_cli(server):
    tag = uuid.uuid4().hex[:12]
    pool_id = server.cli(
        "pool", "create", "--image", IMAGE, "--size", "1", "--cpu", "0.25", "--memory", "64m", "--sandbox-env", f"POOL_TEST={tag}"
    ).stdout.strip()
    try:
        assert pool_id
        deadline = time.monotonic() + FILL_DEADLINE_S
        while True:
            listed = {p["id"]: p for p in json.loads(server.cli("pool", "ls", "--json").stdout)}
            assert pool_id in listed
            if listed[pool_id]["ready"] == 1:
                break
            assert time.monotonic() < deadline, f"pool {pool_id} did not fill: {listed[pool_id]}"
            time.sleep(0.05)
        p = listed[pool_id]
        assert (p["image"], p["size"], p["milli_cpu"], p["memory_bytes"]) == (IMAGE, 1, 250, 64 << 20)
        assert p["env"] == [f"POOL_TEST={tag}"]
        table = server.cli("pool", "ls").stdout.splitlines()
        assert table[0].split() == ["ID", "IMAGE", "SIZE", "READY", "IN", "USE", "HITS", "MISSES", "NODE"]
        row = next(r.split() for r in table[1:] if r.startswith(pool_id))
        assert row[1:4] == [IMAGE, "1", "1"] and row[-1] == p["node"]
    finally:
        server.cli("pool", "rm", pool_id)
    assert pool_id not in server.cli("pool", "ls").stdout
    gone = server.cli("pool", "rm", pool_id, check=False)
    assert gone.returncode == 1 and "not found" in gone.stderr
    bad = server.cli("pool", "create", "--image", IMAGE, check=False)
    assert bad.returncode == 2 and "--size is required" in bad.stderr
