"""The SDK against a live `dsec up` (see conftest.py): real sandboxes, real
commands, real errors from the server."""

import asyncio
import os
import uuid

import pytest

from libdsec import (
    BackendKind,
    DSecClient,
    DSecError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxSpec,
)
from libdsec._http1 import Http1Transport

if os.geteuid() != 0:
    pytest.skip("needs root: the tests start dsec up, which creates namespaces, mounts and cgroups", allow_module_level=True)

IMAGE = "busybox:latest"


def spec(**kw) -> SandboxSpec:
    kw.setdefault("resources", {"cpu": 1, "mem_mb": 256})
    return SandboxSpec(backend=BackendKind.CONTAINER, base_image=IMAGE, **kw)


async def connect(server, token=None) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=token or server.token)


async def test_create_run_write_read_destroy(server):
    async with await connect(server) as client:
        sb = await client.create(spec())
        try:
            assert sb.id and sb.node and sb.id.startswith(sb.node + "-")
            assert await sb.is_alive()

            out = await sb.run("echo hello", timeout=60)
            assert (out.exit_code, out.stdout, out.stderr, out.outcome) == (0, "hello\n", "", "ok")
            assert out.timed_out is False and out.infra_error is None
            assert out.stdout_bytes == b"hello\n"

            await sb.write_file("/tmp/greeting.txt", "héllo\n")
            assert await sb.read_file("/tmp/greeting.txt") == "héllo\n".encode()
            blob = bytes(range(256)) * 64
            await sb.write_file("/tmp/blob.bin", blob)
            assert await sb.read_file("/tmp/blob.bin") == blob
            out = await sb.run(["wc", "-c", "/tmp/blob.bin"])
            assert out.stdout.split()[0] == str(len(blob))

            # Files written by commands are visible to read_file.
            await sb.run("echo made-inside > /tmp/inside.txt")
            assert await sb.read_file("/tmp/inside.txt") == b"made-inside\n"
        finally:
            await client.destroy(sb.id)
        assert await sb.is_alive() is False
        # The server remembers a destroyed sandbox for a while so Get can
        # say what became of it.
        assert (await sb.refresh()).state == "destroyed"
        # A destroyed sandbox is not running: operations on it are refused.
        with pytest.raises(FailedPreconditionError):
            await sb.run("echo")
        # Destroy is idempotent.
        await client.destroy(sb.id)


async def test_exit_codes_stderr_and_argv(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            out = await sb.run("echo oops >&2; exit 3")
            assert out.exit_code == 3
            assert out.outcome == "failed" and not out.ok
            assert out.stderr == "oops\n"
            assert out.infra_error is None

            out = await sb.run(["sh", "-c", 'printf "%s|" "$@"', "sh", "a b", "c"])
            assert out.stdout == "a b|c|"

            out = await sb.run(["/bin/false"])
            assert out.exit_code == 1

            out = await sb.run("kill -9 $$")
            assert out.outcome == "failed"
            assert out.signal == 9 or out.exit_code != 0


async def test_timeout_kills_command(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            out = await sb.run("echo started; sleep 600; echo never", timeout=1)
            assert out.timed_out is True
            assert out.outcome == "timeout"
            assert "never" not in out.stdout
            assert out.infra_error is None
            # The sandbox survives its command's timeout.
            assert (await sb.run("echo still-here")).stdout == "still-here\n"


async def test_env_cwd_stdin_and_binary_output(server):
    async with await connect(server) as client:
        async with await client.create(spec(env={"FROM_SPEC": "spec-value"})) as sb:
            out = await sb.run('echo "$FROM_SPEC $FROM_RUN"', env={"FROM_RUN": "run-value"})
            assert out.stdout == "spec-value run-value\n"

            out = await sb.run("pwd", cwd="/tmp")
            assert out.stdout == "/tmp\n"

            out = await sb.run("cat", stdin=b"from stdin\x00\x01")
            assert out.stdout_bytes == b"from stdin\x00\x01"

            out = await sb.run(r"printf 'ok\377\n'")
            assert out.stdout_bytes == b"ok\xff\n"
            assert out.stdout == "ok\ufffd\n"


async def test_streaming_output(server):
    async with await connect(server) as client:
        async with await client.create(spec()) as sb:
            chunks = {"stdout": b"", "stderr": b""}

            def collect(stream, data):
                chunks[stream] += data

            out = await sb.run("echo one; echo two >&2; exit 4", on_output=collect)
            assert out.exit_code == 4
            assert chunks["stdout"] == b"one\n"
            assert chunks["stderr"] == b"two\n"


async def test_create_many_and_destroy_many(server):
    async with await connect(server) as client:
        label = uuid.uuid4().hex
        sbs = await client.create_many(spec(labels={"batch": label}), 5)
        assert len(sbs) == 5
        ids = [sb.id for sb in sbs]
        assert len(set(ids)) == 5
        try:
            listed = await client.list({"batch": label})
            assert sorted(i.id for i in listed) == sorted(ids)
            assert all(i.labels == {"batch": label} for i in listed)

            outs = await asyncio.gather(*(sb.run(f"echo {i}") for i, sb in enumerate(sbs)))
            assert [o.stdout for o in outs] == [f"{i}\n" for i in range(5)]
            # Sandboxes are isolated from one another.
            await sbs[0].write_file("/tmp/mine", "0")
            assert (await sbs[1].run("test -e /tmp/mine")).exit_code == 1
        finally:
            await client.destroy_many(ids)
        assert not any(await asyncio.gather(*(sb.is_alive() for sb in sbs)))
        assert await client.list({"batch": label}) == []

        # Destroy is idempotent; ids that never existed fail item by item.
        ghost = f"{sbs[0].node}-0000000000000000"
        errs = await client.destroy_many(ids + [ghost], return_exceptions=True)
        assert errs[:5] == [None] * 5
        assert isinstance(errs[5], NotFoundError) and ghost in str(errs[5])
        with pytest.raises(NotFoundError):
            await client.destroy_many([ids[0], ghost])
        with pytest.raises(NotFoundError):
            await client.destroy(ghost)


async def test_error_mapping(server):
    async with await connect(server) as client:
        with pytest.raises(NotFoundError) as ei:
            await client.create(SandboxSpec(base_image="no-such-image:v0"))
        assert "no-such-image" in str(ei.value)

        with pytest.raises(InvalidArgumentError):
            await client.create(SandboxSpec(backend="no-such-backend", base_image=IMAGE))

        async with await client.create(spec()) as sb:
            with pytest.raises(NotFoundError):
                await sb.read_file("/no/such/file")
            # A well-formed id on a live node that names no sandbox.
            ghost = client.sandbox(f"{sb.node}-0000000000000000")
            with pytest.raises(NotFoundError):
                await ghost.read_file("/etc/passwd")
            with pytest.raises(NotFoundError):
                await ghost.run("echo")
            assert await ghost.is_alive() is False


async def test_bad_token_is_refused(server):
    async with await connect(server, token="not-a-token") as client:
        with pytest.raises(DSecError) as ei:
            await client.list()
        assert ei.value.code in ("unauthenticated", "permission_denied")


async def test_context_managers_destroy(server):
    async with await connect(server) as client:
        with pytest.raises(RuntimeError, match="boom"):
            async with await client.create(spec()) as sb:
                assert await sb.is_alive()
                raise RuntimeError("boom")
        assert await sb.is_alive() is False

        # Destroying inside the block is fine: exit ignores NotFound.
        async with await client.create(spec()) as sb2:
            await sb2.destroy()
        assert await sb2.is_alive() is False

    # The client is closed after its block; is_alive still never raises.
    assert await sb.is_alive() is False


async def test_tenants_are_isolated_and_quota_limited(server):
    async with await connect(server) as admin:
        name = "t" + uuid.uuid4().hex[:12]
        token = await admin.create_tenant(name, max_sandboxes=1)
        assert token
        async with await admin.create(spec()) as admins:
            async with await connect(server, token=token) as tenant:
                with pytest.raises(NotFoundError):
                    await tenant.get(admins.id)
                with pytest.raises(NotFoundError):
                    await tenant.destroy(admins.id)
                with pytest.raises(NotFoundError):
                    await tenant.sandbox(admins.id).run("echo")
                assert admins.id not in [i.id for i in await tenant.list()]
                with pytest.raises(PermissionDeniedError):
                    await tenant.create_tenant(name + "x")

                async with await tenant.create(spec()) as mine:
                    assert (await mine.run("echo mine")).stdout == "mine\n"
                    with pytest.raises(ResourceExhaustedError):
                        await tenant.create(spec())
            assert await admins.is_alive()


async def test_run_creates_runs_and_destroys_in_one_call(server):
    async with await connect(server) as client:
        res = await client.run(spec(env={"X": "spec"}), "echo out $X; echo err >&2; exit 4")
        assert (res.outcome, res.exit_code, res.stdout, res.stderr) == ("failed", 4, "out spec\n", "err\n")
        got = []
        res = await client.run(spec(), ["sh", "-c", "echo a; echo b >&2"], on_output=lambda s, d: got.append((s, d)))
        assert res.ok and res.stdout == ""
        assert b"".join(d for s, d in got if s == "stdout") == b"a\n"
        assert b"".join(d for s, d in got if s == "stderr") == b"b\n"
        with pytest.raises(NotFoundError):
            await client.run(SandboxSpec(base_image="nope:1"), "true")
        assert await client.list() == []


async def test_calls_reuse_their_connection(server):
    """Streamed calls (Run, ExecStream) read their response to its end, so
    their connection goes back to the pool: calls one after another share
    one connection. Leaving the body after the end-of-stream message made
    every such call connect anew."""
    t = Http1Transport(8)
    async with await DSecClient.create(endpoint=server.endpoint, token=server.token, transport=t) as client:
        for _ in range(3):
            assert (await client.run(spec(), ["echo", "hi"])).stdout == "hi\n"
        sb = await client.create(spec())
        try:
            got = []
            for _ in range(3):
                assert (await sb.run(["echo", "hi"], on_output=lambda s, d: got.append(d))).ok
            assert b"".join(got) == b"hi\n" * 3
        finally:
            await client.destroy(sb.id)
        with pytest.raises(NotFoundError):
            await client.run(SandboxSpec(base_image="nope:1"), "true")
        assert (await client.run(spec(), "exit 3")).exit_code == 3
    assert t.connections_opened == 1


async def test_network_rules(server):
    async with await connect(server) as client:
        sb = await client.create(spec(network_rules={"pypi": True, "npm": False}))
        try:
            assert sb.info.spec.network_rules == {"pypi": True, "npm": False}
            res = await sb.run("echo $https_proxy")
            assert res.stdout.strip() == "http://127.0.0.1:3128"
            assert await sb.set_network({"npm": True, "github": False}) == {"pypi": True, "npm": True, "github": False}
            assert await sb.set_network() == {"pypi": True, "npm": True, "github": False}
            assert await sb.set_network({"example.org:443": True}, replace=True) == {"example.org:443": True}
            with pytest.raises(InvalidArgumentError, match=r"allow\[0\]"):
                await sb.set_network({"pipy": True})
            with pytest.raises(InvalidArgumentError, match=r"spec.network.allow\[0\]"):
                await client.create(spec(network_rules={"ex ample.org": True}))
        finally:
            await sb.destroy()


async def test_verify_grades_only_the_artifacts(server):
    async with await connect(server) as client:
        sb = await client.create(spec())
        try:
            await sb.write_file("/work/answer", "42\n")
            await sb.write_file("/work/check.sh", "exit 0\n")  # the agent's "always pass" hook
            grade = "[ -f /work/check.sh ] && . /work/check.sh; [ \"$(cat /work/answer)\" = 42 ]"
            assert (await sb.run(["sh", "-c", grade])).exit_code == 0
            await sb.write_file("/work/answer", "41\n")
            assert (await sb.run(["sh", "-c", grade])).exit_code == 0  # the hook passes it in place
            res = await sb.verify(["sh", "-c", grade], artifacts=["/work/answer"])
            assert res.exit_code == 1 and res.outcome == "failed"
            with pytest.raises(InvalidArgumentError, match=r"artifacts\[0\]"):
                await sb.verify("true", artifacts=["work/answer"])
        finally:
            await sb.destroy()
