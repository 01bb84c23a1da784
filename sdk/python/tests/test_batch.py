"""The batch API: acquire, batch_exec, batch_rollback, release, and the
retry-after hint of a saturated service.

The first tests check what the SDK sends, how it numbers and re-sends, and
how it reads errors, against a scripted fake server (FakeServer from
test_trajectory); the rest run against the live `dsec up` of conftest.py.
"""

import asyncio
import base64
import uuid

import httpx
import pytest

from libdsec import (
    BackendKind,
    DSecClient,
    DSecError,
    ExecResult,
    FailedPreconditionError,
    NotFoundError,
    OpResult,
    Sandbox,
    SandboxSpec,
    UnavailableError,
    parse_retry_after,
)

from test_trajectory import SID, FakeServer, fake_client

IMAGE = "busybox:latest"
SID2 = "n1-fedcba9876543210"
FROZEN = f'sandbox "{SID2}" is frozen: thaw it first'


def item_ok(seq, stdout=b"", replayed=False, sid=SID):
    return {
        "sandboxId": sid,
        "result": {"outcome": "ok", "stdout": base64.b64encode(stdout).decode(), "seq": str(seq), "replayed": replayed},
    }


def item_err(code, message, sid=SID):
    return {"sandboxId": sid, "error": {"code": code, "message": message}}


# ------------------------------------------------------------ fake server


async def test_batch_exec_numbers_each_handle_in_step_with_run():
    fake = FakeServer(
        (200, {"results": [item_ok(1, b"a\n"), item_ok(3, b"b\n", sid=SID2)]}),
        (200, {"result": {"outcome": "ok", "seq": "2"}}),  # a later single run
        (200, {"results": [item_ok(2, b"a\n", replayed=True)]}),
    )
    async with await fake_client(fake) as client:
        a, b = client.sandbox(SID), client.sandbox(SID2, next_seq=3)
        call = client.batch_exec([a, b], ["echo a", ["echo", "b"]], timeout=5)
        # Numbers are taken when the call is made, as with run.
        assert (a.next_seq, b.next_seq) == (2, 4)
        outs = await call
        assert [(o.stdout, o.seq) for o in outs] == [("a\n", 1), ("b\n", 3)]
        assert (await a.run("true")).seq == 2
        # An explicit seq in a command mapping (a restarted trainer
        # re-sending step 2) is used as is.
        again = await client.batch_exec([client.sandbox(SID)], [{"cmd": "echo a", "seq": 2, "request_id": "r2"}])
        assert again[0].replayed
    first, second = fake.bodies("BatchExec")
    assert first == {
        "requests": [
            {"sandboxId": SID, "shell": "echo a", "timeout": "5s", "seq": "1"},
            {"sandboxId": SID2, "argv": ["echo", "b"], "timeout": "5s", "seq": "3"},
        ]
    }
    assert second["requests"] == [{"sandboxId": SID, "shell": "echo a", "seq": "2", "requestId": "r2"}]


async def test_one_command_for_all_and_per_item_failures():
    fake = FakeServer(
        (
            200,
            {
                "results": [
                    item_ok(1, b"x\n"),
                    item_err("failed_precondition", FROZEN, sid=SID2),
                    item_err("not_found", 'sandbox "n1-0000000000000000" not found', sid="n1-0000000000000000"),
                    item_err("unavailable", "node n1 is restarting; retry after 2s", sid="n1-1111111111111111"),
                ]
            },
        ),
        (200, {"sandbox": {"id": SID2, "nextSeq": "1"}}),  # Get: the frozen refusal was not recorded
    )
    async with await fake_client(fake) as client:
        a, frozen = client.sandbox(SID), client.sandbox(SID2)
        ghost = "n1-0000000000000000"
        flaky = "n1-1111111111111111"  # a bare id: unnumbered, so sent once
        outs = await client.batch_exec([a, frozen, ghost, flaky], "echo x", return_exceptions=True)
        assert outs[0].stdout == "x\n"
        assert isinstance(outs[1], FailedPreconditionError) and SID2 in str(outs[1])
        assert isinstance(outs[2], NotFoundError) and ghost in str(outs[2])
        # As with run, an infrastructure failure is a result, not an error.
        assert isinstance(outs[3], ExecResult) and outs[3].outcome == "infra_error"
        # The frozen sandbox's number went back to its handle.
        assert (a.next_seq, frozen.next_seq) == (2, 1)
    assert [r.get("seq") for r in fake.bodies("BatchExec")[0]["requests"]] == ["1", "1", None, None]


async def test_batch_exec_raises_the_first_error_after_the_whole_batch_ran():
    fake = FakeServer(
        (200, {"results": [item_err("not_found", "no such sandbox", sid="n1-0000000000000000"), item_ok(1, sid=SID)]}),
    )
    async with await fake_client(fake) as client:
        a = client.sandbox(SID)
        with pytest.raises(NotFoundError, match="no such sandbox"):
            await client.batch_exec(["n1-0000000000000000", a], "true")
        assert a.next_seq == 2  # its command ran: the number stays used


async def test_numbered_items_are_resent_alone_and_unnumbered_ones_are_not():
    fake = FakeServer(
        httpx.ReadError("reset"),  # the whole call fails in transit
        (
            200,
            {
                "results": [
                    item_ok(1, b"a\n"),
                    item_err("failed_precondition", "seq 2 is beyond the next expected 1", sid=SID2),
                    item_err("unavailable", "admission queue full; retry after 0.01s", sid=SID2),
                ]
            },
        ),
        (200, {"results": [item_ok(2, sid=SID2), item_ok(1, sid=SID2)]}),
    )
    async with await fake_client(fake) as client:
        a, b = client.sandbox(SID), client.sandbox(SID2)
        # b appears twice (numbers 1 and 2); the node ran 2 before 1 arrived.
        outs = await client.batch_exec([a, b, b], ["echo a", "two", "one"])
        assert [o.seq for o in outs] == [1, 2, 1]
    reqs = [[(r["sandboxId"], r["seq"]) for r in body["requests"]] for body in fake.bodies("BatchExec")]
    assert reqs == [
        [(SID, "1"), (SID2, "1"), (SID2, "2")],
        [(SID, "1"), (SID2, "1"), (SID2, "2")],
        [(SID2, "1"), (SID2, "2")],
    ]

    fake = FakeServer(httpx.ReadError("reset"))
    async with await fake_client(fake) as client:
        outs = await client.batch_exec([SID], "echo")
        assert outs[0].outcome == "infra_error"
    assert len(fake.requests) == 1


async def test_bad_batches_are_refused_before_taking_numbers():
    async with await fake_client(FakeServer()) as client:
        a, b = client.sandbox(SID), client.sandbox(SID2)
        bad = [
            lambda: client.batch_exec([a, b], ["x", "y", "z"]),
            lambda: client.batch_exec([a, b], []),
            lambda: client.batch_exec([a, b], ["echo", ""]),
            lambda: client.batch_exec([a, b], [{"cmd": "x", "tiemout": 3}]),
            lambda: client.batch_exec([a, b], [{"timeout": 3}]),
            lambda: client.batch_exec([a, ""], "x"),
            lambda: client.batch_rollback([a, b], ["ck-1"]),
            lambda: client.batch_rollback([a, b], ["ck-1", ""]),
        ]
        for call in bad:
            with pytest.raises(ValueError):
                call()
        with pytest.raises(ValueError, match=r"commands\[1\]"):
            client.batch_exec([a, b], ["echo", ""])
        assert (a.next_seq, b.next_seq) == (1, 1)
        assert await client.batch_exec([], "x") == []
        with pytest.raises(ValueError):
            await client.acquire(-1, SandboxSpec(base_image=IMAGE))


async def test_batch_rollback_and_release_results():
    fake = FakeServer(
        (200, {"results": [{"sandboxId": SID, "result": {"seq": "4"}}, item_err("not_found", "checkpoint ck-x not found", sid=SID2)]}),
        # (no Get: a NotFound refusal is not one that gives a number back)
        (200, {"results": [{"id": SID}, {"id": SID2, "error": {"code": "not_found", "message": "gone"}}]}),
    )
    async with await fake_client(fake) as client:
        a, b = client.sandbox(SID, next_seq=4), client.sandbox(SID2)
        outs = await client.batch_rollback([a, b], ["ck-1", "ck-x"], return_exceptions=True)
        assert outs[0] == OpResult(seq=4, replayed=False)
        assert isinstance(outs[1], NotFoundError)
        assert (a.next_seq, b.next_seq) == (5, 2)
        errs = await client.release([a, SID2], return_exceptions=True)
        assert errs[0] is None and isinstance(errs[1], NotFoundError)
    assert fake.bodies("BatchRollback")[0] == {
        "requests": [{"sandboxId": SID, "checkpointId": "ck-1", "seq": "4"}, {"sandboxId": SID2, "checkpointId": "ck-x", "seq": "1"}]
    }
    assert fake.bodies("Release")[0] == {"ids": [SID, SID2]}


async def test_acquire_items_and_all_or_nothing_default():
    spec = SandboxSpec(base_image=IMAGE)
    results = {
        "results": [
            {"sandbox": {"id": SID, "state": "running", "nextSeq": "1"}},
            {"error": {"code": "unavailable", "message": "admission queue full (64 waiting), retry after 3s"}},
        ]
    }
    fake = FakeServer((200, results), (200, results), (200, {"results": [{"id": SID}]}))
    async with await fake_client(fake) as client:
        got = await client.acquire(2, spec, return_exceptions=True)
        assert isinstance(got[0], Sandbox) and got[0].next_seq == 1
        assert isinstance(got[1], UnavailableError) and got[1].retry_after == 3.0
        # By default the acquired ones go back and the first error is raised.
        with pytest.raises(UnavailableError) as e:
            await client.acquire(2, spec)
        assert e.value.retry_after == 3.0
    assert [m for m, _ in fake.requests] == ["Acquire", "Acquire", "Release"]
    assert fake.bodies("Acquire")[0] == {"spec": spec.to_json(), "count": 2}
    assert fake.bodies("Release")[0] == {"ids": [SID]}


async def test_retry_after_from_header_and_deadline_sent():
    seen = {}

    def refuse(request):
        seen["timeout"] = request.headers.get("connect-timeout-ms")
        return httpx.Response(
            503, json={"code": "unavailable", "message": "no capacity and the queue is full"}, headers={"Retry-After": "2"}
        )

    fake = FakeServer(refuse)
    async with await DSecClient.create(
        endpoint="http://fake.invalid", token="t", timeout=45, transport=httpx.MockTransport(fake)
    ) as client:
        with pytest.raises(UnavailableError) as e:
            await client.create(SandboxSpec(base_image=IMAGE))
    # A create is sent once: the caller decides whether to come back.
    assert len(fake.requests) == 1
    assert e.value.retry_after == 2.0
    # The server learns when the client gives up (a second before, so that
    # its own answer comes first), so it queues no longer.
    assert seen["timeout"] == "44000"


def test_parse_retry_after():
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert parse_retry_after("-1") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("queue full; retry after 1.5s", in_text=True) == 1.5
    assert parse_retry_after("Retry-After: 250ms", in_text=True) == 0.25
    assert parse_retry_after("retry later", in_text=True) is None
    assert DSecError("queue full, retry_after=4").retry_after == 4.0
    assert DSecError("node down").retry_after is None


# ------------------------------------------------------------ live server


def spec(**kw) -> SandboxSpec:
    kw.setdefault("resources", {"cpu": 0.5, "mem_mb": 128})
    return SandboxSpec(backend=BackendKind.CONTAINER, base_image=IMAGE, **kw)


async def connect(server) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=server.token)


async def test_acquire_batch_exec_rollback_release(server):
    label = uuid.uuid4().hex
    async with await connect(server) as client:
        sbs = await client.acquire(8, spec(labels={"batch": label}))
        assert len(sbs) == 8 and len({sb.id for sb in sbs}) == 8
        assert all(sb.next_seq == 1 for sb in sbs)
        try:
            ghost = f"{sbs[0].node}-0000000000000000"
            # Eight different commands and one bad item, which fails alone.
            cmds = [f"echo v{i} > /root/f && cat /root/f" for i in range(8)] + ["true"]
            outs = await client.batch_exec([*sbs, ghost], cmds, timeout=30, return_exceptions=True)
            for i, o in enumerate(outs[:8]):
                assert isinstance(o, ExecResult), o
                assert (o.outcome, o.stdout, o.seq, o.replayed) == ("ok", f"v{i}\n", 1, False)
            assert isinstance(outs[8], NotFoundError) and ghost in str(outs[8])

            # A failing command is a result, not an error.
            outs = await client.batch_exec(sbs, "exit 3")
            assert [(o.outcome, o.exit_code, o.seq) for o in outs] == [("failed", 3, 2)] * 8

            cks = await asyncio.gather(*(sb.checkpoint() for sb in sbs))  # seq 3
            outs = await client.batch_exec(sbs, "echo changed > /root/f; touch /root/new")  # seq 4
            assert all(o.ok and o.seq == 4 for o in outs)
            rolled = await client.batch_rollback(sbs, cks)  # seq 5
            assert rolled == [OpResult(seq=5, replayed=False)] * 8
            outs = await client.batch_exec(sbs, "cat /root/f; test -e /root/new && echo new || echo gone")  # seq 6
            assert [o.stdout for o in outs] == [f"v{i}\ngone\n" for i in range(8)]
            assert all(o.seq == 6 for o in outs)

            # Single operations continue the same numbering.
            one = await sbs[3].run("echo single")
            assert (one.stdout, one.seq) == ("single\n", 7)
            assert (await client.get(sbs[3].id)).next_seq == 8
            assert (await client.get(sbs[4].id)).next_seq == 7

            # A bad checkpoint fails its own item; the others roll back.
            rolled = await client.batch_rollback(sbs[:2], [cks[0], "ck-nonexistent"], return_exceptions=True)
            assert rolled[0] == OpResult(seq=7, replayed=False)
            assert isinstance(rolled[1], NotFoundError) and "ck-nonexistent" in str(rolled[1])
            # Whether or not the node recorded the refusal, the handle stays
            # in step with the sandbox.
            out = await sbs[1].run("echo after")
            info = await client.get(sbs[1].id)
            assert out.ok and not out.replayed and out.seq == info.next_seq - 1

            # A restarted trainer re-sending step 1 as a batch gets it back.
            again = await client.batch_exec([client.sandbox(sbs[0].id)], cmds[0], timeout=30)
            assert (again[0].stdout, again[0].seq, again[0].replayed) == ("v0\n", 1, True)
            kinds = [r["kind"] for r in await sbs[0].trajectory()]
            assert kinds[:7] == ["create", "exec", "exec", "checkpoint", "exec", "rollback", "exec"]
        finally:
            errs = await client.release([*sbs, ghost], return_exceptions=True)
        assert errs[:8] == [None] * 8
        assert isinstance(errs[8], NotFoundError)
        assert await client.list({"batch": label}) == []
        with pytest.raises(NotFoundError):
            await client.acquire(2, SandboxSpec(base_image="no-such-image:1"))
