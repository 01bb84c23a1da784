"""Stateless calls (run_code and `dsec fn run`) against the live `dsec up` of
conftest.py.

The language table runs bash code as `bash main.sh`, and the language image
(`make lang-image`) is not built for these tests. So the calls name an image
of their own with `image=`: the busybox rootfs plus a /bin/bash that hands
the script to busybox's sh, which runs what these tests send.
"""

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from libdsec import DSecClient, InvalidArgumentError, NotFoundError, RunCodeResult

from conftest import _busybox_rootfs

BASH_IMAGE = "busybox-bash:latest"


@pytest.fixture(scope="module")
def bash_image(server, tmp_path_factory):
    root = tmp_path_factory.mktemp("busybox-bash") / "rootfs"
    _busybox_rootfs(root)
    bash = root / "bin" / "bash"
    bash.write_text('#!/bin/sh\nexec /bin/sh "$@"\n')
    bash.chmod(0o755)
    server.cli("image", "import", "-q", BASH_IMAGE, str(root))
    return BASH_IMAGE


async def connect(server) -> DSecClient:
    return await DSecClient.create(endpoint=server.endpoint, token=server.token)


async def test_run_code_output_exit_code_stdin_args(server, bash_image):
    async with await connect(server) as client:
        ok = await client.run_code('read x; echo "got $x and $@"; echo note >&2', "bash", stdin="42\n", args=["a", "b c"], image=bash_image)
        assert isinstance(ok, RunCodeResult) and ok.ok and ok.status == "Success", ok
        assert ok.compile_result is None  # bash is not compiled
        r = ok.run_result
        assert (r.status, r.return_code, r.stdout, r.stderr) == ("Finished", 0, "got 42 and a b c\n", "note\n")
        assert r.execution_time > 0

        failed = await client.run_code("echo partial; echo boom >&2; exit 3", "bash", image=bash_image)
        assert failed.status == "Failed" and not failed.ok
        r = failed.run_result
        assert (r.status, r.return_code, r.stdout, r.stderr) == ("Finished", 3, "partial\n", "boom\n")


async def test_run_code_time_limit_files_and_statelessness(server, bash_image):
    async with await connect(server) as client:
        slow = await client.run_code("echo started; sleep 30", "bash", run_timeout=1, image=bash_image)
        assert slow.status == "Failed" and slow.run_result.status == "TimeLimitExceeded", slow
        assert slow.run_result.stdout == "started\n"

        files = await client.run_code(
            "tr a-z A-Z < in.txt > out.txt; mkdir -p sub && cp in.txt sub/copy",
            "bash",
            files={"in.txt": b"data\n"},
            fetch_files=["out.txt", "sub/copy", "missing.txt"],
            image=bash_image,
        )
        assert files.ok, files
        assert files.files == {"out.txt": b"DATA\n", "sub/copy": b"data\n"}

        # Every call gets a clean sandbox: nothing one call leaves behind
        # (files anywhere, background processes) is seen by the next.
        mark = uuid.uuid4().hex
        probe = f"ls /root; ps -o args | grep -c '[s]leep 7{mark[:4]}'; touch /root/{mark}; sleep 7{mark[:4]} >/dev/null 2>&1 &"
        for _ in range(4):
            out = await client.run_code(probe, "bash", image=bash_image)
            assert out.ok and out.run_result.stdout == "0\n", out


async def test_run_code_refusals(server, bash_image):
    async with await connect(server) as client:
        with pytest.raises(InvalidArgumentError, match="cobol"):
            await client.run_code("x", "cobol", image=bash_image)
        # Without image=, the language's own image is needed, and this
        # server has none: the error says how to get it.
        with pytest.raises(NotFoundError, match="lang-image"):
            await client.run_code("echo hi", "bash")
        with pytest.raises(NotFoundError):
            await client.run_code("echo hi", "bash", image="no-such-image:1")
        with pytest.raises(ValueError):
            await client.run_code("echo hi", "")


def _fn(server, *args, stdin=None):
    env = dict(os.environ, DSEC_ENDPOINT=server.endpoint, DSEC_TOKEN=server.token)
    return subprocess.run([server.dsec, "fn", "run", *args], env=env, input=stdin, capture_output=True, text=True, timeout=120)


def test_fn_run_cli(server, bash_image, tmp_path: Path):
    code = tmp_path / "main.sh"
    code.write_text('read x; echo "in=$x args=$*"; echo to-stderr >&2; exit 5\n')
    data = tmp_path / "stdin.txt"
    data.write_text("hello\n")
    p = _fn(server, "--language", "bash", "--image", bash_image, "--stdin", str(data), str(code), "--", "a", "b")
    assert (p.returncode, p.stdout, p.stderr) == (5, "in=hello args=a b\n", "to-stderr\n")

    p = _fn(server, "-l", "bash", "--image", bash_image, "-", stdin="echo from stdin\n")
    assert (p.returncode, p.stdout, p.stderr) == (0, "from stdin\n", "")

    p = _fn(server, "-l", "bash", "--image", bash_image, "--timeout", "1s", "-", stdin="sleep 30\n")
    assert p.returncode == 124 and "timed out" in p.stderr

    p = _fn(server, "-l", "cobol", "--image", bash_image, str(code))
    assert p.returncode == 125 and "cobol" in p.stderr

    p = _fn(server, str(code))
    assert p.returncode == 2 and "--language is required" in p.stderr
