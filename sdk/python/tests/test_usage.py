"""Each sandbox's own use against the live `dsec up` of conftest.py (issue
14): list and get show its CPU and memory as its node measured them, and
`dsec sandbox ls` prints them."""

import asyncio
import json
import os
import time

import pytest

from libdsec import BackendKind, DSecClient, SandboxSpec

if os.geteuid() != 0:
    pytest.skip("needs root: the tests start dsec up, which creates namespaces, mounts and cgroups", allow_module_level=True)

IMAGE = "busybox:latest"
# Bounds a broken test only: dsec up reads sandboxes' use every 5 s, and
# CPU needs two reads.
WAIT_S = 60.0


def spec() -> SandboxSpec:
    return SandboxSpec(backend=BackendKind.CONTAINER, base_image=IMAGE, resources={"cpu": 0.5, "mem_mb": 256})


async def connect(server, token=None) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=token or server.token)


async def test_sandbox_usage(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            held = await sb.run("head -c 32m /dev/zero > /dev/shm/hold", timeout=60)
            assert held.exit_code == 0, held
            # Spins until cancelled (the sandbox's destroy ends it at the latest).
            spin = asyncio.create_task(sb.run("while :; do :; done", timeout=WAIT_S + 30))
            try:
                deadline = time.monotonic() + WAIT_S
                while True:
                    info = next(i for i in await client.list() if i.id == sb.id)
                    if info.usage_window_s and info.usage["cpu"] > 0 and info.usage["mem_mb"] >= 32:
                        break
                    assert time.monotonic() < deadline, f"no usage seen: {info.usage} over {info.usage_window_s}"
                    await asyncio.sleep(0.5)
                assert info.usage_at is not None and info.usage["cpu"] <= 2 * os.cpu_count()
                got = await client.get(sb.id)
                assert got.usage["mem_mb"] >= 32

                table = server.cli("sandbox", "ls").stdout.splitlines()
                assert table[0].split()[4:6] == ["CPU", "MEM"], table[0]
                row = next(r.split() for r in table[1:] if r.startswith(sb.id))
                assert float(row[4]) > 0 and row[5].endswith("MiB"), row
                listed = {s["id"]: s for s in json.loads(server.cli("sandbox", "ls", "--json").stdout)}
                assert listed[sb.id]["usage"]["memory_bytes"] >= 32 << 20
            finally:
                spin.cancel()
                try:
                    await spin
                except (asyncio.CancelledError, Exception):  # cancelled, or ended with the sandbox
                    pass
