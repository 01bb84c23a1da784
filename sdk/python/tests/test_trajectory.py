"""Trajectories: operation numbering, re-sending, fast-forward after a client
restart, rewards, and the hash-chained log.

The first tests check what the SDK sends and how it re-sends against a
scripted fake server (httpx.MockTransport); the rest run against the live
`dsec up` of conftest.py.
"""

import asyncio
import base64
import json
import struct

import httpx
import pytest

from libdsec import (
    BackendKind,
    DSecClient,
    ExecResult,
    FailedPreconditionError,
    InvalidArgumentError,
    OpResult,
    ReadFileResult,
    SandboxInfo,
    SandboxSpec,
)
from libdsec._http1 import Http1Transport

IMAGE = "busybox:latest"
SID = "n1-0123456789abcdef"


# ------------------------------------------------------------ fake server


class FakeServer:
    """Answers each request with the next scripted reply and records the
    requests. A reply is a (status, body dict) pair, an exception to raise
    in transit, or a callable taking the request."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.requests = []  # (method, body dict)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        raw = await request.aread()
        if request.headers.get("content-type") == "application/connect+json":
            raw = raw[5:]  # a streaming call: one enveloped message
        body = json.loads(raw)
        self.requests.append((request.url.path.rsplit("/", 1)[-1], body))
        reply = self.replies.pop(0)
        if callable(reply):
            reply = reply(request)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, httpx.Response):
            return reply
        status, payload = reply
        return httpx.Response(status, json=payload)

    def bodies(self, method=None):
        return [b for m, b in self.requests if method is None or m == method]


def exec_ok(seq, stdout=b"", replayed=False):
    return (200, {"result": {"outcome": "ok", "stdout": base64.b64encode(stdout).decode(), "seq": str(seq), "replayed": replayed}})


def precondition(message):
    return (400, {"code": "failed_precondition", "message": message})


async def fake_client(fake: FakeServer) -> DSecClient:
    return await DSecClient.create(endpoint="http://fake.invalid", token="t", transport=httpx.MockTransport(fake))


async def test_handle_numbers_operations_in_call_order():
    fake = FakeServer(exec_ok(1), (200, {"seq": "2"}), (200, {"data": "aGk=", "seq": "3"}), (200, {"seq": 4}), exec_ok(5))
    async with await fake_client(fake) as client:
        sb = client.sandbox(SID)
        assert sb.next_seq == 1
        # The numbers are taken when the calls are made, not when they run.
        calls = [
            sb.run("echo a"),
            sb.write_file("/tmp/x", "x"),
            sb.read_file_result("/tmp/x"),
            sb.submit_reward(0.5, {"k": "v"}),
            sb.run(["true"]),
        ]
        assert sb.next_seq == 6
        out, wrote, read, reward, last = [await c for c in calls]
    assert [b["seq"] for b in fake.bodies()] == ["1", "2", "3", "4", "5"]
    assert isinstance(out, ExecResult) and (out.seq, out.replayed) == (1, False)
    assert wrote == OpResult(seq=2, replayed=False)
    assert read == ReadFileResult(data=b"hi", seq=3, replayed=False)
    assert reward == OpResult(seq=4, replayed=False)
    assert fake.bodies("SubmitReward")[0] == {"sandboxId": SID, "value": 0.5, "metadata": {"k": "v"}, "seq": "4"}
    assert last.seq == 5


async def test_bare_ids_send_no_seq_unless_given_and_bad_calls_use_no_number():
    fake = FakeServer(exec_ok(7), exec_ok(3), (200, {"data": "", "seq": "8"}))
    async with await fake_client(fake) as client:
        assert (await client.exec(SID, "echo")).seq == 7
        await client.exec(SID, "echo", seq=3, request_id="r-3")
        assert await client.read_file(SID, "/x") == b""
        sb = client.sandbox(SID, next_seq=10)
        # Arguments the server would refuse without recording anything are
        # refused before the call takes a number.
        with pytest.raises(ValueError):
            sb.run([])
        with pytest.raises(ValueError):
            sb.run("")
        with pytest.raises(ValueError):
            sb.run("echo", env=["=x"])
        with pytest.raises(ValueError):
            sb.run("echo", max_output_bytes=-1)
        with pytest.raises(ValueError):
            sb.read_file("")
        with pytest.raises(ValueError):
            sb.write_file("/x", "d", mode=0o17777)
        with pytest.raises(ValueError):
            sb.submit_reward(float("nan"))
        with pytest.raises(ValueError):
            client.sandbox(SID, next_seq=0)
        assert sb.next_seq == 10  # the refused call took no number
    assert [b.get("seq") for b in fake.bodies()] == [None, "3", None]
    assert fake.bodies()[1]["requestId"] == "r-3"


async def test_numbered_operation_is_resent_after_a_failure_in_transit():
    fake = FakeServer(
        httpx.ConnectError("refused"),
        httpx.ReadError("reset"),
        (503, {"code": "unavailable", "message": "edge restarting"}),
        exec_ok(1, b"once\n", replayed=True),
    )
    async with await fake_client(fake) as client:
        out = await client.sandbox(SID).run("echo once")
    assert (out.stdout, out.seq, out.replayed) == ("once\n", 1, True)
    assert len(fake.requests) == 4
    assert all(b == fake.bodies()[0] for b in fake.bodies())  # the same request each time


async def test_unnumbered_operation_is_not_resent():
    fake = FakeServer(httpx.ReadError("reset"))
    async with await fake_client(fake) as client:
        out = await client.exec(SID, "echo")
    assert out.outcome == "infra_error"
    assert len(fake.requests) == 1


async def test_beyond_next_expected_is_retried_other_errors_are_not():
    fake = FakeServer(
        precondition("seq 2 is beyond the next expected 1"),
        precondition("seq 2 is beyond the next expected 1"),
        (200, {"seq": "2"}),
        precondition("seq 3 was recorded for a different request"),
        (400, {"code": "invalid_argument", "message": "bad path"}),
    )
    async with await fake_client(fake) as client:
        sb = client.sandbox(SID, next_seq=2)
        assert (await sb.write_file("/tmp/x", "x")).seq == 2
        with pytest.raises(FailedPreconditionError, match="different request"):
            await sb.run("echo")
        with pytest.raises(InvalidArgumentError):
            await sb.write_file("bad", "x")
    assert [b["seq"] for b in fake.bodies()] == ["2", "2", "2", "3", "4"]


async def test_retries_are_bounded(monkeypatch):
    monkeypatch.setattr("libdsec.client._AHEAD_BUDGET_S", 0.2)
    fake = FakeServer(*[precondition("seq 5 is beyond the next expected 1")] * 100)
    async with await fake_client(fake) as client:
        with pytest.raises(FailedPreconditionError, match="beyond the next expected"):
            await client.submit_reward(SID, 1.0, seq=5)
    assert 2 <= len(fake.requests) < 100


async def test_sandboxes_without_a_trajectory_are_not_numbered():
    no_traj = precondition('node "n1" keeps no trajectory (started with trajectory logging off): send operations without seq')
    fake = FakeServer(
        (200, {"sandbox": {"id": SID, "nextSeq": "1"}}),
        (200, {"sandbox": {"id": SID}}),  # no nextSeq: the node keeps no trajectory
        exec_ok(1),
        exec_ok(0),
        no_traj,
        exec_ok(0),
        exec_ok(0),
        no_traj,
    )
    async with await fake_client(fake) as client:
        with_traj = await client.create(SandboxSpec(base_image=IMAGE))
        without = await client.create(SandboxSpec(base_image=IMAGE))
        await with_traj.run("echo")
        await without.run("echo")
        # A handle by id learns it from the node's refusal and re-sends.
        by_id = client.sandbox(SID)
        assert (await by_id.run("echo")).seq == 0
        await by_id.run("echo")
        # An explicit seq on a bare id is not dropped silently.
        with pytest.raises(FailedPreconditionError, match="keeps no trajectory"):
            await client.exec(SID, "echo", seq=1)
    assert [b.get("seq") for b in fake.bodies("Exec")] == ["1", None, "1", None, None, "1"]


def _envelope(msg, flags=0):
    data = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(data)) + data


class _BrokenStream(httpx.AsyncByteStream):
    """A response body that delivers some chunks and then loses the connection."""

    def __init__(self, chunks):
        self.chunks = chunks

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        raise httpx.ReadError("connection reset")


async def test_resent_stream_delivers_each_output_byte_once():
    def b64(b):
        return base64.b64encode(b).decode()

    result = {"outcome": "ok", "stdout": b64(b"abcdef"), "seq": "1"}
    first = httpx.Response(200, stream=_BrokenStream([_envelope({"stdout": b64(b"abc")})]))
    # The re-send is answered with the recorded result alone (no chunks).
    second = httpx.Response(
        200, content=_envelope({"result": dict(result, replayed=True)}) + _envelope({}, flags=0x02)
    )
    fake = FakeServer(lambda r: first, lambda r: second)
    got = []
    async with await fake_client(fake) as client:
        out = await client.sandbox(SID).run("printf abcdef", on_output=lambda s, d: got.append((s, d)))
    assert out.replayed and out.stdout == "abcdef"
    assert b"".join(d for s, d in got if s == "stdout") == b"abcdef"


async def test_trajectory_pages_are_joined():
    recs = [json.dumps({"seq": i, "kind": "exec"}) for i in range(3)]
    fake = FakeServer(
        (200, {"records": recs[:2], "nextPageToken": "p2", "nextSeq": "3"}),
        (200, {"records": recs[2:], "nextSeq": "3"}),
    )
    async with await fake_client(fake) as client:
        got = await client.sandbox(SID).trajectory(include_data=True)
    assert [r["seq"] for r in got] == [0, 1, 2]
    assert fake.bodies()[0] == {"sandboxId": SID, "includeData": True}
    assert fake.bodies()[1]["pageToken"] == "p2"


def test_sandbox_info_has_next_seq():
    assert SandboxInfo.from_json({"id": SID, "nextSeq": "12"}).next_seq == 12
    assert SandboxInfo.from_json({"id": SID}).next_seq == 0


# ------------------------------------------------------------ live server


def spec() -> SandboxSpec:
    return SandboxSpec(backend=BackendKind.CONTAINER, base_image=IMAGE, resources={"cpu": 1, "mem_mb": 256})


async def connect(server, **kw) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=server.token, **kw)


async def destroy(server, sandbox_id):
    async with await connect(server) as client:
        await client.destroy(sandbox_id)


APPEND = "echo x >> /tmp/f; wc -l < /tmp/f"


async def test_fast_forward_after_client_restart(server):
    async with await connect(server) as client:
        sb = await client.create(spec())
        sid = sb.id
    try:
        # The first life of the trainer.
        async with await connect(server) as client:
            sb = client.sandbox(sid)
            outs = [await sb.run(APPEND) for _ in range(3)]
            assert [o.stdout.strip() for o in outs] == ["1", "2", "3"]
            assert [(o.seq, o.replayed) for o in outs] == [(1, False), (2, False), (3, False)]
            assert await sb.write_file("/tmp/g", "payload") == OpResult(seq=4, replayed=False)
            assert await sb.read_file_result("/tmp/g") == ReadFileResult(data=b"payload", seq=5, replayed=False)
            assert await sb.submit_reward(0.5, {"step": "first"}) == OpResult(seq=6, replayed=False)
            assert (await client.get(sid)).next_seq == 7

        # The trainer restarts: a new client, a handle by id, the same
        # operations in the same order get the recorded results back.
        async with await connect(server) as client:
            sb = client.sandbox(sid)
            assert sb.next_seq == 1
            outs = [await sb.run(APPEND) for _ in range(3)]
            assert [o.stdout.strip() for o in outs] == ["1", "2", "3"]
            assert [(o.seq, o.replayed) for o in outs] == [(1, True), (2, True), (3, True)]
            assert await sb.write_file("/tmp/g", "payload") == OpResult(seq=4, replayed=True)
            assert await sb.read_file_result("/tmp/g") == ReadFileResult(data=b"payload", seq=5, replayed=True)
            assert await sb.submit_reward(0.5, {"step": "first"}) == OpResult(seq=6, replayed=True)

            # Past the recorded steps, operations run for real; the appends
            # above ran once each.
            out = await sb.run("wc -l < /tmp/f")
            assert (out.stdout.strip(), out.seq, out.replayed) == ("3", 7, False)
            assert sb.next_seq == 8

            records = await sb.trajectory()
            assert [r["seq"] for r in records if r["kind"] != "create"] == list(range(1, 8))
    finally:
        await destroy(server, sid)


class LoseFirstExecResponse(httpx.AsyncBaseTransport):
    """Forwards requests to the server, but for the first Exec throws the
    response away once it has arrived and reports a broken connection, as
    if the network failed on the way back."""

    def __init__(self):
        self.inner = Http1Transport(16)
        self.exec_bodies = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/Exec"):
            self.exec_bodies.append(json.loads(await request.aread()))
            if len(self.exec_bodies) == 1:
                await resp.aread()
                await resp.aclose()
                raise httpx.ReadError("response lost (test)", request=request)
        return resp

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_lost_response_is_resent_and_not_run_twice(server):
    lossy = LoseFirstExecResponse()
    async with await connect(server, transport=lossy) as client:
        async with await client.create(spec()) as sb:
            out = await sb.run("echo x >> /tmp/count; wc -l < /tmp/count")
            assert (out.stdout.strip(), out.seq, out.replayed, out.outcome) == ("1", 1, True, "ok")
            assert len(lossy.exec_bodies) == 2
            assert lossy.exec_bodies[0] == lossy.exec_bodies[1]
            assert lossy.exec_bodies[0]["seq"] in ("1", 1)
            # The command ran once.
            out = await sb.run("wc -l < /tmp/count")
            assert (out.stdout.strip(), out.seq, out.replayed) == ("1", 2, False)


class DisconnectFirstExec(httpx.AsyncBaseTransport):
    """Gives up on the first Exec after a short wait (closing its
    connection while the command is still running) and reports a timeout."""

    def __init__(self, after_s):
        self.inner = Http1Transport(16)
        self.after_s = after_s
        self.execs = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/Exec"):
            self.execs += 1
            if self.execs == 1:
                try:
                    return await asyncio.wait_for(self.inner.handle_async_request(request), self.after_s)
                except asyncio.TimeoutError:
                    raise httpx.ReadTimeout("gave up waiting (test)", request=request) from None
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_disconnected_operation_completes_and_resend_waits_for_it(server):
    flaky = DisconnectFirstExec(after_s=0.5)
    async with await connect(server, transport=flaky) as client:
        async with await client.create(spec()) as sb:
            out = await sb.run("sleep 2; echo x >> /tmp/c; wc -l < /tmp/c", timeout=30)
            assert flaky.execs == 2
            # The first request's command kept running after the client
            # went away; the re-send waited for it and got its result.
            assert (out.stdout.strip(), out.seq, out.replayed, out.outcome) == ("1", 1, True, "ok")
            out = await sb.run("wc -l < /tmp/c")
            assert (out.stdout.strip(), out.replayed) == ("1", False)


async def test_concurrent_calls_are_numbered_in_call_order(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            outs = await asyncio.gather(*(sb.run(f"echo {i}") for i in range(8)))
            assert [(o.seq, o.stdout) for o in outs] == [(i + 1, f"{i}\n") for i in range(8)]
            assert not any(o.replayed for o in outs)
            records = await sb.trajectory()
            execs = {r["seq"]: r for r in records if r["kind"] == "exec"}
            assert sorted(execs) == list(range(1, 9))
            assert execs[3]["exec"]["shell"] == "echo 2"


async def test_reward_is_recorded_and_the_trajectory_is_hash_chained(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            assert (await sb.run("echo hi")).seq == 1
            assert await sb.submit_reward(0.75, {"judge": "unit", "task": "t1"}) == OpResult(seq=2, replayed=False)
            assert (await sb.refresh()).next_seq == 3
            assert sb.next_seq == 3

            records = await sb.trajectory()
            assert [(r["seq"], r["kind"]) for r in records] == [(0, "create"), (1, "exec"), (2, "reward")]
            assert all(r["sandbox"] == sb.id for r in records)
            reward = records[2]["reward"]
            assert reward["value"] == 0.75
            assert reward["metadata"] == {"judge": "unit", "task": "t1"}
            assert records[1]["exec"]["shell"] == "echo hi"
            assert records[1]["exec"]["exit_code"] == 0

            # Each record names the hash of the one before it.
            assert records[0]["prev"] == ""
            for before, after in zip(records, records[1:]):
                assert after["prev"] == before["hash"]
                assert after["hash"].startswith("sha256:") and after["hash"] != before["hash"]

            # Paging returns the same records; include_data inlines output.
            assert await client.trajectory(sb.id, page_size=1) == records
            full = await client.trajectory(sb.id, include_data=True)
            assert base64.b64decode(full[1]["exec"]["stdout"]["inline"]) == b"hi\n"

            # A server-numbered reward (bare id) is recorded too.
            r = await client.submit_reward(sb.id, -1.5)
            assert (r.seq, r.replayed) == (3, False)


async def test_resent_seq_with_a_different_request_is_refused(server, monkeypatch):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            assert (await sb.run("echo a")).seq == 1
            await sb.write_file("/tmp/w", "one")
            with pytest.raises(FailedPreconditionError, match="was recorded for a different request"):
                await client.exec(sb.id, "echo b", seq=1)
            with pytest.raises(FailedPreconditionError, match="was recorded for a different request"):
                await client.write_file(sb.id, "/tmp/w", "two", seq=2)
            # The same request again is a replay.
            again = await client.exec(sb.id, "echo a", seq=1)
            assert (again.stdout, again.replayed) == ("a\n", True)
            # A number past the next expected one is refused (after retrying
            # for a while, in case an earlier number was still on its way).
            monkeypatch.setattr("libdsec.client._AHEAD_BUDGET_S", 0.3)
            with pytest.raises(FailedPreconditionError, match="beyond the next expected"):
                await client.exec(sb.id, "echo c", seq=50)
            # Nothing of the refused requests ran or was recorded.
            assert (await sb.read_file("/tmp/w")) == b"one"
            assert [r["seq"] for r in await sb.trajectory()] == [0, 1, 2, 3]
