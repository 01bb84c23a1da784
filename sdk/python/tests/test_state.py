"""Environment state: snapshots, checkpoints and rollbacks, freeze and thaw,
job-wide freeze.

The first tests check what the SDK sends against a scripted fake server
(FakeServer from test_trajectory); the rest run against the live `dsec up`
of conftest.py. /tmp in a sandbox is a tmpfs and not part of snapshots or
checkpoints, so the live tests keep their files under /work and /root.
"""

import asyncio
import uuid

import pytest

from libdsec import (
    BackendKind,
    CheckpointResult,
    DSecClient,
    FailedPreconditionError,
    ImageInfo,
    InvalidArgumentError,
    JobResult,
    NotFoundError,
    OpResult,
    SandboxSpec,
)

from test_trajectory import SID, FakeServer, exec_ok, fake_client, precondition

IMAGE = "busybox:latest"

FROZEN = f'sandbox "{SID}" is frozen: thaw it first'


# ------------------------------------------------------------ fake server


async def test_state_operations_are_numbered_with_the_handle():
    fake = FakeServer(
        exec_ok(1),
        (200, {"checkpointId": "ck-1", "seq": "2"}),
        (200, {"image": {"ref": "snap:1", "digest": "sha256:d", "layers": ["sha256:a", "sha256:b"]}, "seq": "3"}),
        (200, {"seq": "4", "replayed": True}),
        (200, {"checkpointId": "ck-2", "seq": "5"}),
        (200, {}),  # DeleteCheckpoint
        (200, {"sandbox": {"id": SID, "state": "frozen"}}),
        (200, {"sandbox": {"id": SID, "state": "running"}}),
    )
    async with await fake_client(fake) as client:
        sb = client.sandbox(SID)
        # Numbers are taken when the calls are made, in call order.
        calls = [sb.run("echo"), sb.checkpoint(), sb.snapshot("snap:1"), sb.rollback("ck-1", request_id="r4")]
        assert sb.next_seq == 5
        _, ck, image, rolled = [await c for c in calls]
        assert ck == "ck-1"
        assert isinstance(image, ImageInfo) and (image.ref, image.digest, image.seq, image.replayed) == (
            "snap:1",
            "sha256:d",
            3,
            False,
        )
        assert image.layers == ["sha256:a", "sha256:b"]
        assert rolled == OpResult(seq=4, replayed=True)
        assert await sb.checkpoint_result() == CheckpointResult(id="ck-2", seq=5)
        # delete_checkpoint, freeze and thaw are not numbered.
        await sb.delete_checkpoint("ck-2")
        assert (await sb.freeze()).state == "frozen" and sb.info.state == "frozen"
        assert (await sb.thaw()).state == "running"
        assert sb.next_seq == 6
    bodies = fake.bodies()
    assert [b.get("seq") for b in bodies] == ["1", "2", "3", "4", "5", None, None, None]
    assert bodies[2] == {"sandboxId": SID, "ref": "snap:1", "seq": "3"}
    assert bodies[3] == {"sandboxId": SID, "checkpointId": "ck-1", "seq": "4", "requestId": "r4"}
    assert bodies[5] == {"sandboxId": SID, "checkpointId": "ck-2"}
    assert [m for m, _ in fake.requests][-3:] == ["DeleteCheckpoint", "Freeze", "Thaw"]


async def test_bad_state_arguments_use_no_number():
    fake = FakeServer()
    async with await fake_client(fake) as client:
        sb = client.sandbox(SID, next_seq=7)
        for ref in ("", "Snap:1", "snap:", "snap:.x", "a//b:1", "snap@sha256:00", "host:5000/x:1"):
            with pytest.raises(ValueError):
                sb.snapshot(ref)
        with pytest.raises(ValueError):
            sb.rollback("")
        with pytest.raises(ValueError):
            await sb.delete_checkpoint("")
        with pytest.raises(ValueError):
            await client.freeze_job({})
        assert sb.next_seq == 7
    assert fake.requests == []


async def test_a_refusal_that_was_not_recorded_gives_the_number_back():
    fake = FakeServer(
        precondition(FROZEN),
        (200, {"sandbox": {"id": SID, "state": "frozen", "nextSeq": "3"}}),  # Get: 3 is still free
        exec_ok(3),
        precondition(FROZEN),
        (200, {"sandbox": {"id": SID, "state": "frozen", "nextSeq": "5"}}),  # Get: 4 was recorded
    )
    async with await fake_client(fake) as client:
        sb = client.sandbox(SID, next_seq=3)
        with pytest.raises(FailedPreconditionError, match="frozen"):
            await sb.run("echo")
        assert sb.next_seq == 3  # the sandbox still expects 3
        assert (await sb.run("echo")).seq == 3
        with pytest.raises(FailedPreconditionError):
            await sb.checkpoint()
        assert sb.next_seq == 5  # 4 is used up on the server: keep counting
    assert [m for m, _ in fake.requests] == ["Exec", "Get", "Exec", "Checkpoint", "Get"]
    assert [b.get("seq") for b in fake.bodies()] == ["3", None, "3", "4", None]


async def test_job_results_and_errors():
    results = {
        "results": [
            {"id": "n1-a"},
            {"id": "n2-b", "error": {"code": "failed_precondition", "message": "sandbox is being destroyed"}},
            {"id": "node/n3", "error": {"code": "unavailable", "message": "node n3 is not responding"}},
        ]
    }
    fake = FakeServer((200, results), (200, results), (200, {}))
    async with await fake_client(fake) as client:
        got = await client.freeze_job({"job": "j1"}, return_exceptions=True)
        assert [r.id for r in got] == ["n1-a", "n2-b", "node/n3"]
        assert got[0] == JobResult(id="n1-a") and got[0].ok
        assert isinstance(got[1].error, FailedPreconditionError) and "n2-b" in str(got[1].error)
        assert got[2].error.code == "unavailable"
        with pytest.raises(FailedPreconditionError, match="n2-b"):
            await client.thaw_job({"job": "j1"})
        assert await client.thaw_job({"job": "none"}) == []
    assert [m for m, _ in fake.requests] == ["FreezeJob", "ThawJob", "ThawJob"]
    assert fake.bodies()[0] == {"labels": {"job": "j1"}}


def test_idle_action_is_part_of_the_spec():
    spec = SandboxSpec(base_image=IMAGE, idle_timeout_s=60, idle_action="freeze")
    assert spec.to_json()["idleAction"] == "freeze"
    assert SandboxSpec.from_json(spec.to_json()).idle_action == "freeze"
    assert "idleAction" not in SandboxSpec(base_image=IMAGE).to_json()


# ------------------------------------------------------------ live server

def spec(**kw) -> SandboxSpec:
    kw.setdefault("resources", {"cpu": 1, "mem_mb": 256})
    kw.setdefault("base_image", IMAGE)
    return SandboxSpec(backend=BackendKind.CONTAINER, **kw)


async def connect(server) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=server.token)


async def sh(sb, script: str) -> str:
    out = await sb.run(script, timeout=60)
    assert out.exit_code == 0, f"{script!r}: exit {out.exit_code}: {out.stdout}{out.stderr}"
    return out.stdout


async def test_snapshot_restores_on_a_fresh_sandbox(server):
    ref = f"snap-{uuid.uuid4().hex[:8]}:1"
    async with await connect(server) as client:
        async with await client.create(spec()) as src:
            await sh(src, "mkdir -p /work && echo from-the-source > /work/state.txt && rm /etc/group")
            image = await src.snapshot(ref)
            assert (image.ref, image.replayed) == (ref, False)
            assert image.digest.startswith("sha256:") and image.seq == 2
            assert len(image.layers) == 2  # busybox's layer and the sandbox's changes
            # The source keeps running, unchanged.
            assert await src.read_file("/work/state.txt") == b"from-the-source\n"
            assert (await client.get_image(ref)).digest == image.digest
            kinds = [r["kind"] for r in await src.trajectory()]
            assert kinds[:3] == ["create", "exec", "snapshot"]

        async with await client.create(spec(base_image=ref)) as restored:
            assert await sh(restored, "cat /work/state.txt") == "from-the-source\n"
            assert await sh(restored, "test -e /etc/group && echo present || echo absent") == "absent\n"


async def test_rollback_restores_files_and_kills_later_processes(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            await sh(sb, "mkdir -p /work && echo v1 > /work/f && echo keep > /root/keep")
            ck = await sb.checkpoint()
            assert ck
            await sh(sb, "echo v2 > /work/f; rm /root/keep; echo new > /work/new; sleep 7777 >/dev/null 2>&1 &")
            assert "sleep 7777" in await sh(sb, "ps -o args")

            rolled = await sb.rollback(ck)
            assert rolled == OpResult(seq=5, replayed=False)
            assert await sb.read_file("/work/f") == b"v1\n"
            assert await sb.read_file("/root/keep") == b"keep\n"
            assert await sh(sb, "test -e /work/new && echo yes || echo no") == "no\n"
            assert "sleep 7777" not in await sh(sb, "ps -o args")
            info = await sb.refresh()
            assert (info.id, info.state) == (sb.id, "running")

            # The checkpoint stays: roll back to it again.
            await sh(sb, "echo v3 > /work/f")
            await sb.rollback(ck)
            assert await sb.read_file("/work/f") == b"v1\n"
            await sb.delete_checkpoint(ck)
            with pytest.raises(NotFoundError):
                await sb.delete_checkpoint(ck)
            kinds = [r["kind"] for r in await sb.trajectory()]
            assert kinds.count("checkpoint") == 1 and kinds.count("rollback") == 2


async def test_frozen_sandbox_refuses_runs_until_thawed(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            await sh(sb, "echo before > /root/f")
            info = await sb.freeze()
            assert info.state == "frozen"
            assert (await client.get(sb.id)).state == "frozen"
            n = sb.next_seq
            with pytest.raises(FailedPreconditionError, match="frozen"):
                await sb.run("echo hello")
            # The refusal used no number: the handle stays in step.
            assert sb.next_seq == n
            # A frozen (preempted) sandbox can still be checkpointed.
            ck = await sb.checkpoint()
            assert ck.startswith("ck-") and sb.next_seq == n + 1
            await sb.freeze()  # freezing a frozen sandbox does nothing
            await sb.thaw()
            out = await sb.run("cat /root/f")
            assert (out.stdout, out.seq) == ("before\n", n + 1)
            assert (await client.get(sb.id)).state == "running"
            kinds = [r["kind"] for r in await sb.trajectory()]
            assert kinds[-4:] == ["freeze", "checkpoint", "thaw", "exec"]


async def test_freeze_job_and_thaw_job_by_label(server):
    job = f"job-{uuid.uuid4().hex[:8]}"
    async with await connect(server) as client:
        members = await client.create_many(spec(labels={"job": job}), 2)
        other = await client.create(spec(labels={"job": job + "-other"}))
        try:
            frozen = await client.freeze_job({"job": job})
            assert sorted(r.id for r in frozen) == sorted(m.id for m in members)
            assert all(r.ok for r in frozen)
            for m in members:
                assert (await client.get(m.id)).state == "frozen"
                with pytest.raises(FailedPreconditionError):
                    await m.run("true")
            assert (await client.get(other.id)).state == "running"
            assert (await other.run("true")).ok

            thawed = await client.thaw_job({"job": job})
            assert sorted(r.id for r in thawed) == sorted(m.id for m in members)
            outs = await asyncio.gather(*(m.run("echo back") for m in members))
            assert [o.stdout for o in outs] == ["back\n", "back\n"]
            with pytest.raises(InvalidArgumentError, match="label"):
                await client.freeze_job({"": job})
        finally:
            await client.destroy_many([*members, other], return_exceptions=True)
