"""Tenants against the live `dsec up` of conftest.py: defaults fill what a
spec leaves out and are charged to the quota (issue 13: three sandboxes
without resources under max_cpu=1, max_mem_mb=1024 were all created,
unlimited, with nothing in use), updates change only what is given, and
disk_mb is a resource like the others."""

import uuid

import pytest

from libdsec import (
    BackendKind,
    DSecClient,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxSpec,
    TenantInfo,
)

IMAGE = "busybox:latest"


async def connect(server, token=None) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=token or server.token)


def bare() -> SandboxSpec:
    return SandboxSpec(backend=BackendKind.CONTAINER, base_image=IMAGE)


async def test_defaults_are_charged_to_the_quota(server):
    name = "t" + uuid.uuid4().hex[:10]
    async with await connect(server) as admin:
        token = await admin.create_tenant(name, max_cpu=1, max_mem_mb=1024)
        async with await connect(server, token) as tenant:
            first = await tenant.create(bare())
            try:
                info = await first.refresh()
                # The node's built-in defaults: 1 core, 1 GiB, 1024 pids, 10 GiB.
                assert info.spec.resources == {"cpu": 1.0, "mem_mb": 1024.0, "pids": 1024, "disk_mb": 10240.0}
                for _ in range(2):
                    with pytest.raises(ResourceExhaustedError, match="max_milli_cpu"):
                        await tenant.create(bare())
                me = await tenant.get_tenant()
                assert isinstance(me, TenantInfo) and me.name == name
                assert me.usage == {"sandboxes": 1, "cpu": 1.0, "mem_mb": 1024.0}
                assert (me.max_cpu, me.max_mem_mb) == (1.0, 1024.0)
            finally:
                await first.destroy()

            # Tenant defaults, then explicit values over them.
            updated = await admin.update_tenant(name, defaults={"cpu": 0.25, "mem_mb": 256, "disk_mb": 512})
            assert updated.defaults == {"cpu": 0.25, "mem_mb": 256.0, "disk_mb": 512.0}
            assert updated.max_cpu == 1.0, "an update keeps what it does not set"
            sbs = [await tenant.create(bare()) for _ in range(4)]
            try:
                with pytest.raises(ResourceExhaustedError):
                    await tenant.create(bare())
                info = await sbs[0].refresh()
                assert info.spec.resources == {"cpu": 0.25, "mem_mb": 256.0, "pids": 1024, "disk_mb": 512.0}
                await sbs.pop().destroy()
                spec = bare()
                spec.resources = {"mem_mb": 128, "disk_mb": 2048}
                sbs.append(await tenant.create(spec))
                info = await sbs[-1].refresh()
                assert info.spec.resources == {"cpu": 0.25, "mem_mb": 128.0, "pids": 1024, "disk_mb": 2048.0}
                assert (await tenant.get_tenant()).usage == {"sandboxes": 4, "cpu": 1.0, "mem_mb": 896.0}
            finally:
                for sb in sbs:
                    await sb.destroy()

            # Only the admin updates and lists; a tenant sees only itself.
            with pytest.raises(PermissionDeniedError):
                await tenant.update_tenant(name, max_cpu=100)
            with pytest.raises(PermissionDeniedError):
                await tenant.list_tenants()
            with pytest.raises(NotFoundError):
                await tenant.get_tenant("someone-else")
        names = [t.name for t in await admin.list_tenants()]
        assert name in names
        back = await admin.update_tenant(name, max_cpu=0, defaults={"cpu": 0})
        assert back.max_cpu == 0 and "cpu" not in back.defaults and back.defaults["mem_mb"] == 256.0


def test_resources_keys():
    spec = SandboxSpec(base_image="a:b", resources={"cpu": 0.5, "mem_mb": 64, "pids": 10, "disk_mb": 1.5})
    j = spec.to_json()
    assert j["resources"] == {"milliCpu": "500", "memoryBytes": str(64 << 20), "pids": "10", "diskBytes": str(3 << 19)}
    assert SandboxSpec.from_json(j).resources == {"cpu": 0.5, "mem_mb": 64.0, "pids": 10, "disk_mb": 1.5}
    with pytest.raises(ValueError, match="disk_mb"):
        SandboxSpec(base_image="a:b", resources={"disk": 1}).to_json()
