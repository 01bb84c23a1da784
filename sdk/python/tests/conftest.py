"""Test fixtures: a real `dsec up` server with a busybox image, started once
per session, and a tiny hook that runs ``async def`` tests with asyncio (so
no pytest plugin beyond Debian's python3-pytest is needed).

Environment:
  DSEC_BIN        a built dsec binary, with dsecd and dsec-cli next to it (else the fixture builds them with go)
  DSEC_AGENT_BIN  a built static dsec-agent (else next to DSEC_BIN, else built)
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SDK_ROOT = HERE.parent
REPO_ROOT = SDK_ROOT.parent.parent
sys.path.insert(0, str(SDK_ROOT))

IMAGE = "busybox:latest"
START_DEADLINE_S = 120.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Runs coroutine test functions in a fresh event loop."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None


@dataclass
class Server:
    endpoint: str
    token: str
    dsec: str
    data_dir: Path
    log: Path

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ, DSEC_ENDPOINT=self.endpoint, DSEC_TOKEN=self.token)
        p = subprocess.run([self.dsec, *args], env=env, capture_output=True, text=True, timeout=300)
        if check and p.returncode != 0:
            raise AssertionError(f"dsec {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p


def _go() -> str:
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(go):
        pytest.fail("go not found (set DSEC_BIN to a built dsec binary instead)")
    return go


def _build(out_dir: Path) -> tuple[str, str]:
    dsec = out_dir / "dsec"
    agent = out_dir / "dsec-agent"
    env = dict(os.environ, CGO_ENABLED="0")
    # dsec hands `dsec up` over to the dsecd next to it, and the client
    # commands (but the common form of run) to the dsec-cli next to it.
    for pkg, out in (
        ("./cmd/dsec", dsec),
        ("./cmd/dsecd", out_dir / "dsecd"),
        ("./cmd/dsec-cli", out_dir / "dsec-cli"),
        ("./cmd/dsec-agent", agent),
    ):
        p = subprocess.run([_go(), "build", "-o", str(out), pkg], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            pytest.fail(f"go build {pkg} failed:\n{p.stderr}")
    return str(dsec), str(agent)


def _busybox_rootfs(root: Path) -> None:
    """A minimal rootfs: static busybox at /bin/busybox and a symlink per applet.

    Links point at /bin/busybox inside the rootfs (``busybox --install -s``
    run on the host would link to the host path instead).
    """
    busybox = shutil.which("busybox") or "/bin/busybox"
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "tmp", "etc", "root", "proc", "dev", "sys"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    shutil.copy2(busybox, root / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list-full"], capture_output=True, text=True, check=True).stdout.split()
    for rel in applets:
        link = root / rel
        if rel == "bin/busybox" or link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/bin/busybox", link)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(endpoint: str, token: str) -> bool:
    req = urllib.request.Request(
        f"{endpoint}/dsec.v1.SandboxService/List",
        data=b"{}",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _unmount_under(path: Path) -> None:
    """Unmounts anything left mounted below path, deepest first, so the
    temp dir can be removed even if the server died without cleaning up."""
    prefix = str(path) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].encode().decode("unicode_escape") for line in f]
    for mp in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@pytest.fixture(scope="session")
def server():
    if os.geteuid() != 0:
        pytest.skip("needs root: dsec up creates namespaces, mounts and cgroups")
    tmp = Path(tempfile.mkdtemp(prefix="libdsec-test-"))
    proc = None
    log = tmp / "server.log"
    try:
        dsec = os.environ.get("DSEC_BIN")
        if dsec:
            agent = os.environ.get("DSEC_AGENT_BIN") or str(Path(dsec).with_name("dsec-agent"))
        else:
            dsec, agent = _build(tmp)
        data = tmp / "data"
        data.mkdir()
        endpoint = f"http://127.0.0.1:{_free_port()}"
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                [dsec, "up", "--data-dir", str(data), "--listen", endpoint[len("http://") :], "--agent", agent],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        token_file = data / "admin.token"
        token = ""
        deadline = time.monotonic() + START_DEADLINE_S
        # Poll for readiness: the server writes its token file, then answers.
        while True:
            if proc.poll() is not None:
                pytest.fail(f"dsec up exited with {proc.returncode}:\n{_tail(log)}")
            if not token and token_file.exists():
                token = token_file.read_text().strip()
            if token and _ready(endpoint, token):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"dsec up did not become ready in {START_DEADLINE_S}s:\n{_tail(log)}")
            time.sleep(0.05)
        srv = Server(endpoint=endpoint, token=token, dsec=dsec, data_dir=data, log=log)
        rootfs = tmp / "busybox-rootfs"
        _busybox_rootfs(rootfs)
        srv.cli("image", "import", "--public", "-q", IMAGE, str(rootfs))
        yield srv
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _unmount_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
