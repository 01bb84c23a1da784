"""The operators' view of the nodes against the live `dsec up` of
conftest.py (issue 14): list_nodes describes the node to the admin only,
as `dsec node ls` prints it."""

import asyncio
import json
import os
import time
import uuid

import pytest

from libdsec import BackendKind, DSecClient, NodeInfo, PermissionDeniedError, SandboxSpec

if os.geteuid() != 0:
    pytest.skip("needs root: the tests start dsec up, which creates namespaces, mounts and cgroups", allow_module_level=True)

IMAGE = "busybox:latest"
# Bounds a broken test only: a heartbeat a second counts a new sandbox.
WAIT_S = 60.0


def spec() -> SandboxSpec:
    return SandboxSpec(backend=BackendKind.CONTAINER, base_image=IMAGE, resources={"cpu": 0.5, "mem_mb": 256})


async def connect(server, token=None) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=token or server.token)


async def test_list_nodes(server):
    async with await connect(server) as admin:
        async with await admin.create(spec()) as sb:
            deadline = time.monotonic() + WAIT_S
            while True:
                nodes = await admin.list_nodes()
                assert len(nodes) == 1 and isinstance(nodes[0], NodeInfo), nodes
                node = nodes[0]
                # The heartbeat after the create counts it.
                if node.by_state.get("running", 0) >= 1:
                    break
                assert time.monotonic() < deadline, f"no running sandbox on {node}"
                await asyncio.sleep(0.2)
            assert node.id == sb.node and node.alive and node.full == ""
            c = node.backends["container"]
            assert c["sandboxes"] > 0 and c["cpu"] > 0 and c["mem_mb"] > 0
            assert c["charged_sandboxes"] >= 1 and c["requested_cpu"] >= 0.5 and c["requested_mem_mb"] >= 256
            assert node.by_backend["container"] >= 1
            m = node.measured
            assert m["mem_total_mb"] > 0 and 0 < m["mem_used_mb"] <= m["mem_total_mb"]
            assert 0 < m["open_files"] <= m["max_open_files"] and 0 < m["threads"] <= m["max_threads"]

            listed = json.loads(server.cli("node", "ls", "--json").stdout)
            assert [n["id"] for n in listed] == [node.id] and listed[0]["alive"]
            table = server.cli("node", "ls").stdout.splitlines()
            assert table[0].split()[:4] == ["NODE", "ALIVE", "SEEN", "SANDBOXES"] and table[1].split()[:2] == [node.id, "yes"]

        name = "t" + uuid.uuid4().hex[:10]
        token = await admin.create_tenant(name)
        async with await connect(server, token) as tenant:
            with pytest.raises(PermissionDeniedError):
                await tenant.list_nodes()
        p = server.cli("--token", token, "node", "ls", check=False)
        assert p.returncode == 1 and "admin token" in p.stderr
