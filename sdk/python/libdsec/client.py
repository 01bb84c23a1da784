"""DSecClient and Sandbox: the asyncio interface trainers write against."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from ._connect import Transport
from .errors import INFRA_CODES, DSecError, NotFoundError, error_for
from .models import (
    ExecResult,
    ImageInfo,
    SandboxInfo,
    SandboxSpec,
    b64decode,
    b64encode,
    env_list,
    format_duration,
)

__all__ = ["DSecClient", "Sandbox", "DEFAULT_ENDPOINT", "DEFAULT_TOKEN_FILE"]

DEFAULT_ENDPOINT = "http://127.0.0.1:7110"
DEFAULT_TOKEN_FILE = "/var/lib/dsec/admin.token"

_SANDBOX = "dsec.v1.SandboxService"
_IMAGE = "dsec.v1.ImageService"
_TENANT = "dsec.v1.TenantService"

# How long past the command's own timeout the HTTP request may take: the
# server needs time to kill the command and send the result back.
_EXEC_GRACE_S = 30.0

OutputCallback = Callable[[str, bytes], Any]


def _default_token() -> Optional[str]:
    token = os.environ.get("DSEC_TOKEN")
    if token:
        return token.strip()
    try:
        with open(DEFAULT_TOKEN_FILE, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


class _HybridCreate:
    """Lets ``DSecClient.create(...)`` build a client while ``client.create(spec)``
    creates a sandbox: the two names are both part of the public interface."""

    def __init__(self, factory, method):
        self._factory = factory
        self._method = method

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self._factory.__get__(objtype, objtype)
        return self._method.__get__(obj, objtype)


class DSecClient:
    """A connection pool to one DSec API endpoint.

    Build it with ``await DSecClient.create(endpoint=..., token=...)``;
    close it with ``await client.close()`` or use it as an async context
    manager. One client is safe for any number of concurrent tasks.
    """

    def __init__(self, transport: Transport):
        self._t = transport

    @classmethod
    async def _new(
        cls,
        endpoint: Optional[str] = None,
        token: Optional[str] = None,
        *,
        max_connections: int = 1024,
        timeout: Optional[float] = 300.0,
    ) -> "DSecClient":
        """Connects to ``endpoint`` (default ``$DSEC_ENDPOINT`` or
        http://127.0.0.1:7110) with ``token`` (default ``$DSEC_TOKEN`` or
        the admin token of the default data dir when readable).
        ``timeout`` bounds each request except execs, which get their
        command's timeout plus a grace period."""
        endpoint = endpoint or os.environ.get("DSEC_ENDPOINT") or DEFAULT_ENDPOINT
        if token is None:
            token = _default_token()
        return cls(Transport(endpoint, token, max_connections=max_connections, timeout=timeout))

    @property
    def endpoint(self) -> str:
        return self._t.endpoint

    async def close(self) -> None:
        await self._t.close()

    async def __aenter__(self) -> "DSecClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------ sandboxes

    async def _create_sandbox(self, spec: SandboxSpec) -> "Sandbox":
        """Creates one sandbox and returns a handle to it."""
        resp = await self._t.unary(f"{_SANDBOX}/Create", {"spec": spec.to_json()})
        return Sandbox(self, SandboxInfo.from_json(resp.get("sandbox") or {}))

    create = _HybridCreate(classmethod(_new), _create_sandbox)

    async def create_many(self, spec: SandboxSpec, n: int, *, return_exceptions: bool = False) -> List[Any]:
        """Creates ``n`` sandboxes from one spec in one request.

        By default all or nothing: if any item fails, the ones that were
        created are destroyed and the first item's error is raised. With
        ``return_exceptions=True`` the list holds a Sandbox or a DSecError
        per item, in order (as with ``asyncio.gather``).
        """
        if n < 0:
            raise ValueError(f"n must not be negative, got {n}")
        if n == 0:
            return []
        resp = await self._t.unary(f"{_SANDBOX}/BatchCreate", {"spec": spec.to_json(), "count": n})
        items: List[Any] = []
        for r in resp.get("results") or []:
            err = r.get("error")
            if err:
                items.append(error_for(err.get("code"), err.get("message", "")))
            else:
                items.append(Sandbox(self, SandboxInfo.from_json(r.get("sandbox") or {})))
        if len(items) != n:
            missing = error_for("internal", f"BatchCreate returned {len(items)} results for {n} requested")
            items += [missing] * (n - len(items))
        if return_exceptions:
            return items
        failed = [x for x in items if isinstance(x, DSecError)]
        if failed:
            made = [x.id for x in items if isinstance(x, Sandbox)]
            if made:
                await self.destroy_many(made, return_exceptions=True)
            raise failed[0]
        return items

    def sandbox(self, sandbox_id: str) -> "Sandbox":
        """A handle to an existing sandbox (no call is made)."""
        return Sandbox(self, SandboxInfo(id=sandbox_id))

    async def get(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._t.unary(f"{_SANDBOX}/Get", {"id": _id(sandbox_id)})
        return SandboxInfo.from_json(resp.get("sandbox") or {})

    async def list(self, labels: Optional[Mapping[str, str]] = None) -> List[SandboxInfo]:
        """Sandboxes of this tenant whose labels include every ``labels`` pair."""
        body: Dict[str, Any] = {}
        if labels:
            body["labels"] = {str(k): str(v) for k, v in labels.items()}
        resp = await self._t.unary(f"{_SANDBOX}/List", body)
        return [SandboxInfo.from_json(s) for s in resp.get("sandboxes") or []]

    async def destroy(self, sandbox: Union[str, "Sandbox"]) -> None:
        """Destroys a sandbox; NotFoundError if it does not exist (or is not yours)."""
        await self._t.unary(f"{_SANDBOX}/Destroy", {"id": _id(sandbox)})

    async def destroy_many(
        self, sandboxes: Iterable[Union[str, "Sandbox"]], *, return_exceptions: bool = False
    ) -> Optional[List[Optional[DSecError]]]:
        """Destroys many sandboxes in one request.

        Every sandbox is attempted. By default the first item's error is
        raised after the whole batch ran; with ``return_exceptions=True``
        the list holds None or a DSecError per id, in order.
        """
        ids = [_id(s) for s in sandboxes]
        if not ids:
            return [] if return_exceptions else None
        resp = await self._t.unary(f"{_SANDBOX}/BatchDestroy", {"ids": ids})
        by_id: Dict[str, Optional[DSecError]] = {}
        for r in resp.get("results") or []:
            err = r.get("error")
            by_id[r.get("id", "")] = error_for(err.get("code"), err.get("message", "")) if err else None
        out: List[Optional[DSecError]] = []
        for i in ids:
            if i in by_id:
                out.append(by_id[i])
            else:
                out.append(error_for("internal", f"BatchDestroy returned no result for sandbox {i}"))
        if return_exceptions:
            return out
        for e in out:
            if e is not None:
                raise e
        return None

    async def exec(
        self,
        sandbox: Union[str, "Sandbox"],
        cmd: Union[str, Sequence[str]],
        timeout: Optional[float] = None,
        *,
        env: Union[Mapping[str, str], Sequence[str], None] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[bytes, str, None] = None,
        max_output_bytes: Optional[int] = None,
        on_output: Optional[OutputCallback] = None,
    ) -> ExecResult:
        """Runs ``cmd`` in a sandbox; see :meth:`Sandbox.run`."""
        body: Dict[str, Any] = {"sandboxId": _id(sandbox)}
        if isinstance(cmd, str):
            body["shell"] = cmd
        else:
            argv = [str(a) for a in cmd]
            if not argv:
                raise ValueError("cmd must not be empty")
            body["argv"] = argv
        if timeout is not None:
            body["timeout"] = format_duration(timeout)
        envs = env_list(env)
        if envs:
            body["env"] = envs
        if cwd:
            body["cwd"] = cwd
        if user:
            body["user"] = user
        if stdin:
            body["stdin"] = b64encode(stdin)
        if max_output_bytes:
            body["maxOutputBytes"] = str(int(max_output_bytes))
        http_timeout = None if timeout is None else timeout + _EXEC_GRACE_S
        start = time.monotonic()
        try:
            if on_output is None:
                resp = await self._t.unary(f"{_SANDBOX}/Exec", body, timeout=http_timeout)
                return ExecResult.from_json(resp.get("result") or {})
            return await self._exec_stream(body, http_timeout, on_output)
        except DSecError as e:
            if e.code in INFRA_CODES:
                return ExecResult.infra_failure(str(e), time.monotonic() - start)
            raise

    async def _exec_stream(self, body: Dict[str, Any], http_timeout, on_output: OutputCallback) -> ExecResult:
        result: Optional[ExecResult] = None
        async for msg in self._t.server_stream(f"{_SANDBOX}/ExecStream", body, timeout=http_timeout):
            if "stdout" in msg:
                r = on_output("stdout", b64decode(msg["stdout"]))
            elif "stderr" in msg:
                r = on_output("stderr", b64decode(msg["stderr"]))
            elif "result" in msg:
                result = ExecResult.from_json(msg["result"] or {})
                continue
            else:
                continue
            if asyncio.iscoroutine(r):
                await r
        if result is None:
            raise error_for("internal", "ExecStream ended without a result")
        return result

    async def write_file(
        self, sandbox: Union[str, "Sandbox"], path: str, data: Union[bytes, str], mode: Optional[int] = None
    ) -> None:
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "path": path, "data": b64encode(data)}
        if mode:
            body["mode"] = int(mode)
        await self._t.unary(f"{_SANDBOX}/WriteFile", body)

    async def read_file(self, sandbox: Union[str, "Sandbox"], path: str, max_bytes: Optional[int] = None) -> bytes:
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "path": path}
        if max_bytes:
            body["maxBytes"] = str(int(max_bytes))
        resp = await self._t.unary(f"{_SANDBOX}/ReadFile", body)
        return b64decode(resp.get("data"))

    # ------------------------------------------------------------ images, tenants

    async def list_images(self) -> List[ImageInfo]:
        resp = await self._t.unary(f"{_IMAGE}/List", {})
        return [ImageInfo.from_json(i) for i in resp.get("images") or []]

    async def get_image(self, ref: str) -> ImageInfo:
        resp = await self._t.unary(f"{_IMAGE}/Get", {"ref": ref})
        return ImageInfo.from_json(resp.get("image") or {})

    async def create_tenant(
        self,
        name: str,
        *,
        max_sandboxes: int = 0,
        max_cpu: float = 0,
        max_mem_mb: float = 0,
    ) -> str:
        """Creates a tenant (admin only) and returns its bearer token, shown once. 0 means unlimited."""
        quota: Dict[str, str] = {}
        if max_sandboxes:
            quota["maxSandboxes"] = str(int(max_sandboxes))
        if max_cpu:
            quota["maxMilliCpu"] = str(int(round(max_cpu * 1000)))
        if max_mem_mb:
            quota["maxMemoryBytes"] = str(int(round(max_mem_mb * 1024 * 1024)))
        body: Dict[str, Any] = {"name": name}
        if quota:
            body["quota"] = quota
        resp = await self._t.unary(f"{_TENANT}/Create", body)
        return resp.get("token", "")


class Sandbox:
    """A handle to one sandbox. ``async with`` destroys it on exit."""

    def __init__(self, client: DSecClient, info: SandboxInfo):
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def node(self) -> str:
        return self.info.node

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    async def run(
        self,
        cmd: Union[str, Sequence[str]],
        timeout: Optional[float] = None,
        *,
        env: Union[Mapping[str, str], Sequence[str], None] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[bytes, str, None] = None,
        max_output_bytes: Optional[int] = None,
        on_output: Optional[OutputCallback] = None,
    ) -> ExecResult:
        """Runs ``cmd`` (a string for ``/bin/sh -c``, or an argv list).

        ``timeout`` (seconds) kills the command's whole process tree; the
        result then has ``timed_out=True``. ``on_output(stream, data)``,
        if given, receives output as it is produced (``stream`` is
        ``"stdout"`` or ``"stderr"``; it may be a coroutine function).

        Failures of the infrastructure (server unreachable, node lost,
        internal errors) do not raise: they come back as a result with
        ``outcome == "infra_error"`` so a trainer can mask the sample.
        Errors in the request itself (no such sandbox, bad argument, no
        permission) raise the matching DSecError.
        """
        return await self._client.exec(
            self,
            cmd,
            timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            on_output=on_output,
        )

    async def write_file(self, path: str, data: Union[bytes, str], mode: Optional[int] = None) -> None:
        """Writes ``data`` (str is encoded as UTF-8) to ``path``, creating or replacing it."""
        await self._client.write_file(self, path, data, mode)

    async def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        return await self._client.read_file(self, path, max_bytes)

    async def refresh(self) -> SandboxInfo:
        """Fetches the sandbox's current description (state, node, ...)."""
        self.info = await self._client.get(self.id)
        return self.info

    async def is_alive(self) -> bool:
        """True if the sandbox exists and is running. Never raises."""
        try:
            info = await self._client.get(self.id)
        except Exception:
            return False
        return info.state == "running"

    async def destroy(self) -> None:
        await self._client.destroy(self.id)

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self._client.destroy(self.id)
        except NotFoundError:
            pass  # already gone (destroyed inside the block, or reclaimed)


def _id(sandbox: Union[str, Sandbox]) -> str:
    if isinstance(sandbox, Sandbox):
        return sandbox.id
    if not isinstance(sandbox, str) or not sandbox:
        raise ValueError(f"sandbox id must be a non-empty string, got {sandbox!r}")
    return sandbox
