"""DSecClient and Sandbox: the asyncio interface trainers write against."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import re
import time
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import httpx

from ._connect import _UNSET, Transport
from .errors import INFRA_CODES, DSecError, NotFoundError, error_for
from .models import (
    CheckpointResult,
    ExecResult,
    ImageInfo,
    InputEvent,
    JobResult,
    NodeInfo,
    OpResult,
    PoolInfo,
    ReadFileResult,
    RunCodeResult,
    SandboxInfo,
    SandboxSpec,
    Screenshot,
    TenantInfo,
    _resources_json,
    b64decode,
    b64encode,
    env_list,
    format_duration,
    network_json,
    network_rules,
)

__all__ = ["DSecClient", "Sandbox", "DEFAULT_ENDPOINT", "DEFAULT_TOKEN_FILE"]

DEFAULT_ENDPOINT = "http://127.0.0.1:7110"
DEFAULT_TOKEN_FILE = "/var/lib/dsec/admin.token"

_SANDBOX = "dsec.v1.SandboxService"
_IMAGE = "dsec.v1.ImageService"
_TENANT = "dsec.v1.TenantService"
_POOL = "dsec.v1.PoolService"
_FN = "dsec.v1.FnService"
_CLUSTER = "dsec.v1.ClusterService"

# How long past the command's own timeout the HTTP request may take: the
# server needs time to kill the command and send the result back.
_EXEC_GRACE_S = 30.0

# Re-sending numbered operations (those that carry a trajectory seq, see
# DSecClient._send). A re-send is safe because the server records each
# numbered operation once and answers a repeat with the recorded result.
#
# After a failure in transit, re-send for up to this long after the first
# failure (a restarting server, a dropped connection).
_RESEND_BUDGET_S = 30.0
# "beyond the next expected": an earlier number of the same handle has not
# reached the server yet (it was sent concurrently, or is itself being
# re-sent for up to _RESEND_BUDGET_S), so wait for it a bit longer than that.
_AHEAD_BUDGET_S = 60.0
_AHEAD_MARK = "beyond the next expected"
_NO_TRAJECTORY_MARK = "keeps no trajectory"
# A replayed failure: the operation failed this way when it ran, and will
# every time its number is sent again.
_RECORDED_MARK = "recorded at seq"
# Another request holds the number: it is used up.
_MISMATCH_MARK = "recorded for a different request"
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0

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
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> "DSecClient":
        """Connects to ``endpoint`` (default ``$DSEC_ENDPOINT`` or
        http://127.0.0.1:7110) with ``token`` (default ``$DSEC_TOKEN`` or
        the admin token of the default data dir when readable).
        ``timeout`` bounds each request except execs, which get their
        command's timeout plus a grace period. ``transport``, if given, is
        the httpx transport every request goes through (for tests and
        instrumentation); by default the client picks its own."""
        endpoint = endpoint or os.environ.get("DSEC_ENDPOINT") or DEFAULT_ENDPOINT
        if token is None:
            token = _default_token()
        return cls(Transport(endpoint, token, max_connections=max_connections, timeout=timeout, transport=transport))

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
        return _handle(self, SandboxInfo.from_json(resp.get("sandbox") or {}))

    create = _HybridCreate(classmethod(_new), _create_sandbox)

    async def create_many(self, spec: SandboxSpec, n: int, *, return_exceptions: bool = False) -> List[Any]:
        """Creates ``n`` sandboxes from one spec in one request.

        By default all or nothing: if any item fails, the ones that were
        created are destroyed and the first item's error is raised. With
        ``return_exceptions=True`` the list holds a Sandbox or a DSecError
        per item, in order (as with ``asyncio.gather``).
        """
        return await self._create_batch("BatchCreate", spec, n, return_exceptions, _UNSET)

    async def acquire(
        self, count: int, spec: SandboxSpec, *, return_exceptions: bool = False, timeout: Any = _UNSET
    ) -> List[Any]:
        """Gets ``count`` sandboxes of ``spec`` in one request, taking warm
        ones from a matching pool first (see :meth:`create_pool`); each is a
        handle numbering its operations from 1.

        When the nodes are full the server queues the creates for as long as
        the request may last (``timeout`` seconds, by default the client's);
        what it cannot place in time fails alone (``ResourceExhaustedError``,
        or ``UnavailableError`` with ``retry_after`` set when the queue
        itself is full). Nothing is retried by the client.

        By default all or nothing: if any item fails, the sandboxes that
        were had are released again and the first item's error is raised.
        With ``return_exceptions=True`` the list holds a Sandbox or a
        DSecError per item, in order.
        """
        return await self._create_batch("Acquire", spec, count, return_exceptions, timeout)

    async def _create_batch(self, method: str, spec: SandboxSpec, n: int, return_exceptions: bool, timeout: Any) -> List[Any]:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"count must be an integer, got {n!r}")
        if n < 0:
            raise ValueError(f"count must not be negative, got {n}")
        if n == 0:
            return []
        kwargs = {} if timeout is _UNSET else {"timeout": timeout}
        resp = await self._t.unary(f"{_SANDBOX}/{method}", {"spec": spec.to_json(), "count": n}, **kwargs)
        items: List[Any] = []
        for i, r in enumerate(resp.get("results") or []):
            err = r.get("error")
            if err:
                items.append(error_for(err.get("code"), f"sandbox {i + 1} of {n}: {err.get('message', '')}"))
            else:
                items.append(_handle(self, SandboxInfo.from_json(r.get("sandbox") or {})))
        if len(items) != n:
            missing = error_for("internal", f"{method} returned {len(items)} results for {n} requested")
            items += [missing] * (n - len(items))
        if return_exceptions:
            return items
        failed = [x for x in items if isinstance(x, DSecError)]
        if failed:
            made = [x.id for x in items if isinstance(x, Sandbox)]
            if made:
                end = self.release if method == "Acquire" else self.destroy_many
                await end(made, return_exceptions=True)
            raise failed[0]
        return items

    def sandbox(self, sandbox_id: str, next_seq: int = 1) -> "Sandbox":
        """A handle to an existing sandbox (no call is made).

        The handle numbers its operations from ``next_seq``, 1 by default:
        a trainer that restarts and re-issues the same operations in the
        same order gets the recorded results back (``replayed=True``)
        until it reaches the first operation the sandbox has not seen.
        """
        return Sandbox(self, SandboxInfo(id=_id(sandbox_id)), next_seq=next_seq)

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
        return await self._end_batch("BatchDestroy", sandboxes, return_exceptions)

    async def release(
        self, sandboxes: Iterable[Union[str, "Sandbox"]], *, return_exceptions: bool = False
    ) -> Optional[List[Optional[DSecError]]]:
        """Ends many sandboxes in one request: one whose spec matches a pool
        that wants more is reset (processes killed, writable layer wiped)
        and goes back to the pool for the next acquire; the others are
        destroyed. Results as :meth:`destroy_many`."""
        return await self._end_batch("Release", sandboxes, return_exceptions)

    async def _end_batch(
        self, method: str, sandboxes: Iterable[Union[str, "Sandbox"]], return_exceptions: bool
    ) -> Optional[List[Optional[DSecError]]]:
        ids = [_id(s) for s in sandboxes]
        if not ids:
            return [] if return_exceptions else None
        resp = await self._t.unary(f"{_SANDBOX}/{method}", {"ids": ids})
        by_id: Dict[str, Optional[DSecError]] = {}
        for r in resp.get("results") or []:
            err = r.get("error")
            sid = r.get("id", "")
            by_id[sid] = error_for(err.get("code"), f"{sid}: {err.get('message', '')}") if err else None
        out: List[Optional[DSecError]] = []
        for i in ids:
            if i in by_id:
                out.append(by_id[i])
            else:
                out.append(error_for("internal", f"{method} returned no result for sandbox {i}"))
        if return_exceptions:
            return out
        for e in out:
            if e is not None:
                raise e
        return None

    # ------------------------------------------------------------ operations
    #
    # exec, write_file, read_file, submit_reward (and snapshot, checkpoint
    # and rollback, below) are steps of the sandbox's trajectory. They are plain methods that return a coroutine:
    # the request is checked and its step number (seq) taken when the
    # method is called, before anything is awaited, so concurrent calls on
    # one Sandbox handle are numbered in the order they were made. The seq
    # is the caller's ``seq=`` if given, else the next number of the
    # handle when ``sandbox`` is a Sandbox, else none (a bare id string:
    # the server numbers the operation and nothing is re-sent).

    def exec(
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
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[ExecResult]:
        """Runs ``cmd`` in a sandbox; see :meth:`Sandbox.run`."""
        body = _exec_body(sandbox, cmd, timeout, env, cwd, user, stdin, max_output_bytes)
        _number(body, sandbox, seq, request_id)
        http_timeout = None if timeout is None else timeout + _EXEC_GRACE_S
        return self._exec(body, sandbox, http_timeout, on_output)

    async def verify(
        self,
        sandbox: Union[str, "Sandbox"],
        cmd: Union[str, Sequence[str]],
        artifacts: Sequence[str],
        timeout: Optional[float] = None,
        *,
        env: Union[Mapping[str, str], Sequence[str], None] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        seq: Optional[int] = None,
    ) -> ExecResult:
        """Grades a sandbox's work: see :meth:`Sandbox.verify`."""
        arts = [str(a) for a in artifacts]
        if not arts:
            raise ValueError("artifacts: at least one path to copy into the verifier is required")
        exec_body = _exec_body(None, cmd, timeout, env, cwd, user, None, None)
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "artifacts": arts, "exec": exec_body}
        _number(body, sandbox, seq, None)
        resp = await self._send(body, sandbox, lambda: self._t.unary(f"{_SANDBOX}/Verify", body))
        return ExecResult.from_json(resp.get("result") or {})

    async def _exec(
        self, body: Dict[str, Any], sandbox: Union[str, "Sandbox"], http_timeout, on_output: Optional[OutputCallback]
    ) -> ExecResult:
        start = time.monotonic()
        try:
            if on_output is None:
                resp = await self._send(
                    body, sandbox, lambda: self._t.unary(f"{_SANDBOX}/Exec", body, timeout=http_timeout)
                )
                return ExecResult.from_json(resp.get("result") or {})
            return await self._exec_stream(body, sandbox, http_timeout, on_output)
        except DSecError as e:
            if e.code in INFRA_CODES:
                return ExecResult.infra_failure(str(e), time.monotonic() - start, seq=int(body.get("seq", 0)))
            raise

    async def _exec_stream(
        self, body: Dict[str, Any], sandbox: Union[str, "Sandbox"], http_timeout, on_output: OutputCallback
    ) -> ExecResult:
        # Bytes handed to on_output so far, across re-sends: a re-sent
        # stream starts from the beginning again, and the caller should see
        # each byte once.
        delivered = {"stdout": 0, "stderr": 0}

        async def emit(stream: str, data: bytes) -> None:
            delivered[stream] += len(data)
            r = on_output(stream, data)
            if asyncio.iscoroutine(r):
                await r

        async def attempt() -> ExecResult:
            seen = {"stdout": 0, "stderr": 0}  # bytes of this attempt's stream
            result: Optional[ExecResult] = None
            async for msg in self._t.server_stream(f"{_SANDBOX}/ExecStream", body, timeout=http_timeout):
                if "result" in msg:
                    result = ExecResult.from_json(msg["result"] or {})
                    continue
                for stream in ("stdout", "stderr"):
                    if stream in msg:
                        data = b64decode(msg[stream])
                        skip = max(0, delivered[stream] - seen[stream])
                        seen[stream] += len(data)
                        if data[skip:]:
                            await emit(stream, data[skip:])
            if result is None:
                raise error_for("internal", "ExecStream ended without a result")
            if result.replayed:
                # A replay may come as the recorded result alone: pass on
                # the output the caller has not seen yet.
                for stream, full in (("stdout", result.stdout_bytes), ("stderr", result.stderr_bytes)):
                    if len(full) > delivered[stream]:
                        await emit(stream, full[delivered[stream] :])
            return result

        return await self._send(body, sandbox, attempt)

    async def run(
        self,
        spec: SandboxSpec,
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
        """Creates a sandbox from ``spec``, runs ``cmd`` in it and destroys
        it, in one request (``dsec run``): the server does create, exec and
        destroy back to back, and destroys the sandbox even if the command
        fails or this call is abandoned.

        ``cmd`` and the keyword arguments are as for :meth:`exec`. Output
        goes to ``on_output(stream, data)`` as it is produced when given;
        otherwise it is collected into the result's ``stdout``/``stderr``.
        A failure before the command could start (bad spec, quota, no room)
        raises; a sandbox or node failing afterwards, or the connection
        breaking mid-run, gives a result with ``outcome == "infra_error"``.
        Nothing is re-sent: a Run that may have started is never repeated.
        """
        body: Dict[str, Any] = {"spec": spec.to_json(), "exec": _exec_body(None, cmd, timeout, env, cwd, user, stdin, max_output_bytes)}
        http_timeout = None if timeout is None else timeout + _EXEC_GRACE_S + 120.0
        out: Dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        result: Optional[ExecResult] = None
        started = False
        start = time.monotonic()
        try:
            async for msg in self._t.server_stream(f"{_SANDBOX}/Run", body, timeout=http_timeout):
                started = True
                if "result" in msg:
                    result = ExecResult.from_json(msg["result"] or {})
                    continue
                for stream in ("stdout", "stderr"):
                    if stream in msg:
                        data = b64decode(msg[stream])
                        if on_output is None:
                            out[stream] += data
                        else:
                            r = on_output(stream, data)
                            if asyncio.iscoroutine(r):
                                await r
        except DSecError as e:
            # Once the sandbox exists, a broken stream is the
            # infrastructure's failure, as for exec.
            if started and e.code in INFRA_CODES:
                return ExecResult.infra_failure(str(e), time.monotonic() - start)
            raise
        if result is None:
            raise error_for("internal", "Run ended without a result")
        if on_output is None:
            o, e = bytes(out["stdout"]), bytes(out["stderr"])
            result = dataclasses.replace(
                result,
                stdout_bytes=o,
                stderr_bytes=e,
                stdout=o.decode("utf-8", errors="replace"),
                stderr=e.decode("utf-8", errors="replace"),
            )
        return result

    def write_file(
        self,
        sandbox: Union[str, "Sandbox"],
        path: str,
        data: Union[bytes, str],
        mode: Optional[int] = None,
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[OpResult]:
        """Writes ``data`` to ``path`` in a sandbox; see :meth:`Sandbox.write_file`."""
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "path": _path(path), "data": b64encode(data)}
        if mode:
            if not 0 <= int(mode) <= 0o7777:
                raise ValueError(f"mode {mode:#o} has bits beyond 0o7777")
            body["mode"] = int(mode)
        _number(body, sandbox, seq, request_id)
        return self._op(f"{_SANDBOX}/WriteFile", body, sandbox, OpResult.from_json)

    def read_file_result(
        self,
        sandbox: Union[str, "Sandbox"],
        path: str,
        max_bytes: Optional[int] = None,
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[ReadFileResult]:
        """Reads ``path``; the result has the bytes with the read's seq and replayed flag."""
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "path": _path(path)}
        if max_bytes:
            body["maxBytes"] = str(_non_negative("max_bytes", max_bytes))
        _number(body, sandbox, seq, request_id)
        return self._op(f"{_SANDBOX}/ReadFile", body, sandbox, ReadFileResult.from_json)

    def read_file(
        self,
        sandbox: Union[str, "Sandbox"],
        path: str,
        max_bytes: Optional[int] = None,
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[bytes]:
        """Reads ``path`` and returns its bytes (see read_file_result for the seq)."""
        return _data_of(self.read_file_result(sandbox, path, max_bytes, seq=seq, request_id=request_id))

    def submit_reward(
        self,
        sandbox: Union[str, "Sandbox"],
        value: float,
        metadata: Optional[Mapping[str, str]] = None,
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[OpResult]:
        """Records a reward in the sandbox's trajectory; see :meth:`Sandbox.submit_reward`."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"reward value must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"reward value must be finite, got {value!r}")
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "value": float(value)}
        if metadata:
            body["metadata"] = {str(k): str(v) for k, v in metadata.items()}
        _number(body, sandbox, seq, request_id)
        return self._op(f"{_SANDBOX}/SubmitReward", body, sandbox, OpResult.from_json)

    # snapshot, checkpoint and rollback are steps of the trajectory too,
    # numbered as above; delete_checkpoint, freeze and thaw are not.

    def snapshot(
        self,
        sandbox: Union[str, "Sandbox"],
        ref: str,
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[ImageInfo]:
        """Makes an image of a sandbox's file system; see :meth:`Sandbox.snapshot`."""
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "ref": _ref(ref)}
        _number(body, sandbox, seq, request_id)
        return self._op(f"{_SANDBOX}/Snapshot", body, sandbox, _snapshot_image)

    def checkpoint_result(
        self,
        sandbox: Union[str, "Sandbox"],
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[CheckpointResult]:
        """Checkpoints a sandbox in place; returns the id with the step's ``seq`` and ``replayed``."""
        body: Dict[str, Any] = {"sandboxId": _id(sandbox)}
        _number(body, sandbox, seq, request_id)
        return self._op(f"{_SANDBOX}/Checkpoint", body, sandbox, CheckpointResult.from_json)

    def checkpoint(
        self,
        sandbox: Union[str, "Sandbox"],
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[str]:
        """Checkpoints a sandbox in place and returns the checkpoint id; see :meth:`Sandbox.checkpoint`."""
        return _id_of(self.checkpoint_result(sandbox, seq=seq, request_id=request_id))

    def rollback(
        self,
        sandbox: Union[str, "Sandbox"],
        checkpoint_id: str,
        *,
        seq: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> Awaitable[OpResult]:
        """Rolls a sandbox back to a checkpoint; see :meth:`Sandbox.rollback`."""
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            raise ValueError(f"checkpoint_id must be a non-empty string, got {checkpoint_id!r}")
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), "checkpointId": checkpoint_id}
        _number(body, sandbox, seq, request_id)
        return self._op(f"{_SANDBOX}/Rollback", body, sandbox, OpResult.from_json)

    async def delete_checkpoint(self, sandbox: Union[str, "Sandbox"], checkpoint_id: str) -> None:
        """Frees a checkpoint (a rollback reading it meanwhile still completes)."""
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            raise ValueError(f"checkpoint_id must be a non-empty string, got {checkpoint_id!r}")
        await self._t.unary(f"{_SANDBOX}/DeleteCheckpoint", {"sandboxId": _id(sandbox), "checkpointId": checkpoint_id})

    async def freeze(self, sandbox: Union[str, "Sandbox"]) -> SandboxInfo:
        """Freezes a sandbox and returns its description; see :meth:`Sandbox.freeze`."""
        resp = await self._t.unary(f"{_SANDBOX}/Freeze", {"sandboxId": _id(sandbox)})
        return SandboxInfo.from_json(resp.get("sandbox") or {})

    async def thaw(self, sandbox: Union[str, "Sandbox"]) -> SandboxInfo:
        """Thaws a frozen sandbox and returns its description."""
        resp = await self._t.unary(f"{_SANDBOX}/Thaw", {"sandboxId": _id(sandbox)})
        return SandboxInfo.from_json(resp.get("sandbox") or {})

    async def screenshot(self, sandbox: Union[str, "Sandbox"]) -> Screenshot:
        """What the sandbox's screen shows, as a PNG (fullvm sandboxes;
        others raise FailedPreconditionError)."""
        resp = await self._t.unary(f"{_SANDBOX}/Screenshot", {"sandboxId": _id(sandbox)})
        return Screenshot.from_json(resp)

    async def input(self, sandbox: Union[str, "Sandbox"], *events: InputEvent) -> None:
        """Sends keyboard and mouse events to the sandbox's screen, in
        order (at most 256 in one call; fullvm sandboxes)."""
        await self._t.unary(f"{_SANDBOX}/Input", {"sandboxId": _id(sandbox), "events": [e.to_json() for e in events]})

    async def set_network(
        self, sandbox: Union[str, "Sandbox"], rules: Optional[Mapping[str, bool]] = None, *, replace: bool = False
    ) -> Dict[str, bool]:
        """Changes a sandbox's egress policy: ``rules`` (``{"pypi": True,
        "npm": False}``) are added, a rule for a target already there
        replacing it, or with ``replace=True`` are the whole policy. New
        connections follow it at once; open ones it no longer allows are
        closed. Returns the whole policy; with no rules it only reads it."""
        body: Dict[str, Any] = {"sandboxId": _id(sandbox), **network_json(rules)}
        if replace:
            body["replace"] = True
        resp = await self._t.unary(f"{_SANDBOX}/SetNetwork", body)
        return network_rules(resp.get("network")) or {}

    async def freeze_job(self, labels: Mapping[str, str], *, return_exceptions: bool = False) -> List[JobResult]:
        """Freezes every sandbox of this tenant whose labels include every
        ``labels`` pair (at least one), on every node, in one request: a
        trainer that loses its GPUs pauses its whole job, and ``thaw_job``
        resumes it. Returns one JobResult per sandbox. Every sandbox is
        attempted; by default the first failure's error is then raised,
        with ``return_exceptions=True`` failures are left in the results'
        ``error``."""
        return await self._job("FreezeJob", labels, return_exceptions)

    async def thaw_job(self, labels: Mapping[str, str], *, return_exceptions: bool = False) -> List[JobResult]:
        """Thaws every frozen sandbox matching ``labels``; as :meth:`freeze_job`."""
        return await self._job("ThawJob", labels, return_exceptions)

    async def _job(self, method: str, labels: Mapping[str, str], return_exceptions: bool) -> List[JobResult]:
        if not labels:
            raise ValueError("labels must select the job: at least one label is required")
        body = {"labels": {str(k): str(v) for k, v in labels.items()}}
        resp = await self._t.unary(f"{_SANDBOX}/{method}", body)
        results = []
        for r in resp.get("results") or []:
            sid, err = r.get("id", ""), r.get("error")
            error = error_for(err.get("code"), f"{sid}: {err.get('message', '')}") if err else None
            results.append(JobResult(id=sid, error=error))
        if not return_exceptions:
            for r in results:
                if r.error is not None:
                    raise r.error
        return results

    # batch_exec and batch_rollback number their items as the single
    # operations do: each item takes its handle's next number when the
    # method is called, so a trainer can mix batch and single operations
    # on the same handles and the numbering stays in step.

    def batch_exec(
        self,
        sandboxes: Sequence[Union[str, "Sandbox"]],
        commands: Union[str, Sequence[Any]],
        timeout: Optional[float] = None,
        *,
        return_exceptions: bool = False,
    ) -> Awaitable[List[Any]]:
        """Runs one command in each sandbox, all in one request.

        ``commands`` has one command per sandbox, or a single one (or a
        plain string) for all of them. A command is a string (run with
        ``/bin/sh -c``), an argv list, or a mapping with ``cmd`` and any of
        :meth:`exec`'s keyword arguments (``timeout``, ``env``, ``cwd``,
        ``user``, ``stdin``, ``max_output_bytes``, ``seq``,
        ``request_id``). ``timeout`` applies to commands that set none.

        Each command is its sandbox handle's next trajectory step, exactly
        as :meth:`Sandbox.run` would number it; items that fail in transit
        are re-sent with their numbers, and a number the server refused
        without recording goes back to its handle. A sandbox should appear
        once per batch (its commands would run concurrently).

        Returns one item per sandbox, in order: an ExecResult, or a
        DSecError for a command that was refused (no such sandbox, frozen,
        bad argument). As with :meth:`exec`, infrastructure failures are
        ExecResults with ``outcome == "infra_error"``, never errors. Every
        item is attempted; by default the first error is then raised, with
        ``return_exceptions=True`` errors are left in the list.
        """
        handles = list(sandboxes)
        if isinstance(commands, (str, Mapping)):
            commands = [commands]
        else:
            commands = list(commands)
        if len(commands) not in (1, len(handles)) or not commands:
            raise ValueError(f"{len(commands)} commands for {len(handles)} sandboxes: give one per sandbox, or one for all")
        if len(commands) == 1:
            commands = commands * len(handles)
        # Every body is built and checked before any number is taken, so a
        # bad item refuses the whole batch without using up numbers.
        bodies, numbering, timeouts = [], [], []
        for i, (sb, c) in enumerate(zip(handles, commands)):
            opts: Dict[str, Any] = {"timeout": timeout}
            if isinstance(c, Mapping):
                unknown = set(c) - _BATCH_EXEC_KEYS
                if unknown or "cmd" not in c:
                    raise ValueError(
                        f"commands[{i}]: want a mapping with 'cmd' and any of {sorted(_BATCH_EXEC_KEYS - {'cmd'})}"
                        + (f"; unknown: {sorted(unknown)}" if unknown else "")
                    )
                opts.update(c)
            else:
                opts["cmd"] = c
            try:
                bodies.append(
                    _exec_body(
                        sb, opts["cmd"], opts["timeout"], opts.get("env"), opts.get("cwd"), opts.get("user"),
                        opts.get("stdin"), opts.get("max_output_bytes"),
                    )
                )
            except (TypeError, ValueError) as e:
                raise type(e)(f"commands[{i}]: {e}") from e
            numbering.append((opts.get("seq"), opts.get("request_id")))
            timeouts.append(opts["timeout"])
        for body, sb, (seq, request_id) in zip(bodies, handles, numbering):
            _number(body, sb, seq, request_id)
        http_timeout = None if any(t is None for t in timeouts) else max(timeouts, default=0) + _EXEC_GRACE_S
        return self._batch_exec(bodies, handles, http_timeout, return_exceptions)

    async def _batch_exec(self, bodies, handles, http_timeout, return_exceptions: bool) -> List[Any]:
        if not bodies:
            return []
        start = time.monotonic()
        items = await self._send_batch("BatchExec", "exec in", bodies, handles, ExecResult.from_json, http_timeout)
        for i, item in enumerate(items):
            if isinstance(item, DSecError) and item.code in INFRA_CODES:
                items[i] = ExecResult.infra_failure(str(item), time.monotonic() - start, seq=int(bodies[i].get("seq", 0)))
        return _per_item(items, return_exceptions)

    def batch_rollback(
        self,
        sandboxes: Sequence[Union[str, "Sandbox"]],
        checkpoint_ids: Sequence[str],
        *,
        return_exceptions: bool = False,
    ) -> Awaitable[List[Any]]:
        """Rolls ``sandboxes[i]`` back to ``checkpoint_ids[i]``, all in one
        request (see :meth:`Sandbox.rollback`). Each rollback is its
        handle's next trajectory step. Returns an OpResult or a DSecError
        per sandbox, in order; errors as :meth:`batch_exec`."""
        handles = list(sandboxes)
        if isinstance(checkpoint_ids, str):
            raise ValueError("checkpoint_ids must be a list with one id per sandbox, not a single string")
        ids = list(checkpoint_ids)
        if len(ids) != len(handles):
            raise ValueError(f"{len(ids)} checkpoint ids for {len(handles)} sandboxes: give one per sandbox")
        bodies = []
        for i, (sb, ck) in enumerate(zip(handles, ids)):
            if not isinstance(ck, str) or not ck:
                raise ValueError(f"checkpoint_ids[{i}] must be a non-empty string, got {ck!r}")
            bodies.append({"sandboxId": _id(sb), "checkpointId": ck})
        for body, sb in zip(bodies, handles):
            _number(body, sb, None, None)
        return self._batch_rollback(bodies, handles, return_exceptions)

    async def _batch_rollback(self, bodies, handles, return_exceptions: bool) -> List[Any]:
        if not bodies:
            return []
        items = await self._send_batch("BatchRollback", "roll back", bodies, handles, OpResult.from_json, _UNSET)
        return _per_item(items, return_exceptions)

    async def _send_batch(
        self,
        method: str,
        verb: str,
        bodies: List[Dict[str, Any]],
        handles: List[Union[str, "Sandbox"]],
        decode: Callable[[Dict[str, Any]], Any],
        http_timeout: Any,
    ) -> List[Any]:
        """Sends a batch of numbered requests and returns a decoded result
        or a DSecError per item. Items are re-sent as :meth:`_send` re-sends
        a single operation (in transit, ``unavailable``, "beyond the next
        expected", a node without a trajectory), each with the same budget,
        counted from the first failure of its kind; unnumbered items are
        sent once. Then refused numbers go back to their handles."""
        out: List[Any] = [None] * len(bodies)
        pending = list(range(len(bodies)))
        delay = _BACKOFF_FIRST_S
        give_up: Dict[float, float] = {}
        kwargs = {} if http_timeout is _UNSET else {"timeout": http_timeout}
        while pending:
            call_err: Optional[DSecError] = None
            results: List[Dict[str, Any]] = []
            try:
                resp = await self._t.unary(f"{_SANDBOX}/{method}", {"requests": [bodies[i] for i in pending]}, **kwargs)
                results = resp.get("results") or []
            except DSecError as e:
                call_err = e
            again: List[int] = []
            hint = 0.0
            stop = math.inf
            now = time.monotonic()
            for j, i in enumerate(pending):
                sid = bodies[i]["sandboxId"]
                if call_err is not None:
                    err: Optional[DSecError] = call_err
                elif j >= len(results):
                    err = error_for("internal", f"{method} returned {len(results)} results for {len(pending)} requests")
                elif results[j].get("error"):
                    e = results[j]["error"]
                    err = error_for(e.get("code"), f"{verb} {sid}: {e.get('message', '')}")
                elif results[j].get("result") is None and method == "BatchExec":
                    err = error_for("internal", f"{method} returned neither a result nor an error for {sid}")
                else:
                    out[i] = decode(results[j].get("result") or {})
                    continue
                out[i] = err
                if "seq" not in bodies[i]:
                    continue
                if err.transport_failure or (err.code == "unavailable" and _RECORDED_MARK not in err.message):
                    budget = _RESEND_BUDGET_S
                elif err.code == "failed_precondition" and _AHEAD_MARK in err.message:
                    budget = _AHEAD_BUDGET_S
                elif err.code == "failed_precondition" and _NO_TRAJECTORY_MARK in err.message and isinstance(handles[i], Sandbox):
                    del bodies[i]["seq"]
                    handles[i]._numbered = False
                    again.append(i)
                    continue
                else:
                    continue
                until = give_up.setdefault(budget, now + budget)
                if now < until:
                    again.append(i)
                    stop = min(stop, until)
                    hint = max(hint, err.retry_after or 0.0)
            pending = again
            if pending and stop < math.inf:
                await asyncio.sleep(min(max(delay * random.uniform(0.5, 1.0), hint), max(0.0, stop - now)))
                delay = min(delay * 2, _BACKOFF_MAX_S)
        # Give refused numbers back, a few at a time (each may cost a Get).
        sem = asyncio.Semaphore(16)

        async def give_back(i: int) -> None:
            async with sem:
                await self._give_back(int(bodies[i]["seq"]), handles[i], out[i])

        await asyncio.gather(
            *(give_back(i) for i, x in enumerate(out) if isinstance(x, DSecError) and "seq" in bodies[i])
        )
        return out

    async def _op(self, method: str, body: Dict[str, Any], sandbox: Union[str, "Sandbox"], decode: Callable[[Dict[str, Any]], Any]):
        return decode(await self._send(body, sandbox, lambda: self._t.unary(method, body)))

    async def _send(self, body: Dict[str, Any], sandbox: Union[str, "Sandbox"], attempt: Callable[[], Awaitable[Any]]) -> Any:
        """Runs ``attempt`` (one request of ``body``) and, for a numbered
        operation (``body`` has a seq), runs it again with the same seq
        while it fails in a way a re-send can fix:

        - in transit, or ``unavailable``: the server may or may not have
          got it; if it did, the re-send returns the recorded result (or
          waits for the first one to finish) instead of running it twice;
        - ``failed_precondition`` "beyond the next expected": an earlier
          number of this handle has not reached the server yet.

        Each with backoff and a time budget; every other error is raised
        at once. An unnumbered operation is sent once: repeating it could
        run it twice.

        A node started without a trajectory log refuses numbered operations
        without running them: an operation numbered through a handle is
        then sent again without its number, and the handle stops numbering
        (a bare id with an explicit seq gets the error).

        A refusal the server did not record (a frozen sandbox) may give the
        number back to the handle; see _give_back.
        """
        if "seq" not in body:
            return await attempt()
        delay = _BACKOFF_FIRST_S
        give_up: Dict[float, float] = {}  # budget -> when to stop, from the first failure of its kind
        while True:
            try:
                return await attempt()
            except DSecError as e:
                if e.transport_failure or (e.code == "unavailable" and _RECORDED_MARK not in e.message):
                    budget = _RESEND_BUDGET_S
                elif e.code == "failed_precondition" and _AHEAD_MARK in e.message:
                    budget = _AHEAD_BUDGET_S
                elif e.code == "failed_precondition" and _NO_TRAJECTORY_MARK in e.message and isinstance(sandbox, Sandbox):
                    del body["seq"]
                    sandbox._numbered = False
                    return await attempt()
                else:
                    await self._give_back(int(body["seq"]), sandbox, e)
                    raise
                now = time.monotonic()
                stop = give_up.setdefault(budget, now + budget)
                if now >= stop:
                    raise
                # A saturated server says when to come back.
                hint = e.retry_after or 0.0
            # Jitter keeps many clients from coming back in lockstep after
            # a server restart.
            await asyncio.sleep(min(max(delay * random.uniform(0.5, 1.0), hint), max(0.0, stop - now)))
            delay = min(delay * 2, _BACKOFF_MAX_S)

    async def _give_back(self, seq: int, sandbox: Union[str, "Sandbox"], e: DSecError) -> None:
        """Returns number ``seq`` to the handle that took it when the server
        refused the operation without recording it (the sandbox is frozen,
        being rolled back or still being created): the sandbox still
        expects ``seq``, and the handle's later operations would otherwise
        wait on it as "beyond the next expected". Only when the handle has
        taken no later number, and only after the sandbox confirms it
        expects ``seq`` next (a refusal recorded under its number, or a
        number taken by someone else meanwhile, keeps it used)."""
        if not isinstance(sandbox, Sandbox) or sandbox._next_seq != seq + 1 or e.transport_failure:
            return
        if e.code != "failed_precondition":
            return
        if any(mark in e.message for mark in (_RECORDED_MARK, _AHEAD_MARK, _MISMATCH_MARK)):
            return
        try:
            info = await self.get(sandbox.id)
        except DSecError:
            return
        if info.next_seq == seq and sandbox._next_seq == seq + 1:
            sandbox._next_seq = seq

    async def trajectory(
        self, sandbox: Union[str, "Sandbox"], include_data: bool = False, *, page_size: int = 0
    ) -> List[Dict[str, Any]]:
        """A sandbox's whole trajectory, in log order: one dict per record
        (the JSON the server keeps: ``seq``, ``kind``, ``exec``, ``file``,
        ``reward``, ``prev``, ``hash``...; byte strings are base64).
        ``include_data`` inlines data the server keeps out of the records
        (large outputs, file contents). Also works after the sandbox was
        destroyed, for as long as the server keeps its trajectory."""
        records: List[Dict[str, Any]] = []
        token = ""
        while True:
            body: Dict[str, Any] = {"sandboxId": _id(sandbox)}
            if include_data:
                body["includeData"] = True
            if page_size:
                body["pageSize"] = int(page_size)
            if token:
                body["pageToken"] = token
            resp = await self._t.unary(f"{_SANDBOX}/GetTrajectory", body)
            records.extend(json.loads(r) for r in resp.get("records") or [])
            token = resp.get("nextPageToken") or ""
            if not token:
                return records

    # ------------------------------------------------------------ pools, fncall

    async def create_pool(
        self,
        spec: SandboxSpec,
        size: int,
        *,
        min_size: int = 0,
        idle_shrink_s: Optional[float] = None,
    ) -> PoolInfo:
        """Creates a warm pool keeping ``size`` sandboxes of ``spec`` created
        and clean; creates and acquires by this tenant with a matching spec
        (same backend, images, resources and env) take from it. Returns at
        once: the pool fills in the background (watch ``ready`` with
        :meth:`list_pools`). Unused for ``idle_shrink_s`` seconds (server
        default 10 minutes) it shrinks to ``min_size``."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an integer >= 1, got {size!r}")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or not 0 <= min_size <= size:
            raise ValueError(f"min_size must be an integer in [0, size], got {min_size!r}")
        body: Dict[str, Any] = {"spec": spec.to_json(), "size": size}
        if min_size:
            body["minSize"] = min_size
        if idle_shrink_s is not None:
            body["idleShrink"] = format_duration(idle_shrink_s)
        resp = await self._t.unary(f"{_POOL}/Create", body)
        return PoolInfo.from_json(resp.get("pool") or {})

    async def list_pools(self) -> List[PoolInfo]:
        """The pools this tenant can see, with their fill and hit counts."""
        resp = await self._t.unary(f"{_POOL}/List", {})
        return [PoolInfo.from_json(p) for p in resp.get("pools") or []]

    async def delete_pool(self, pool_id: str) -> None:
        """Deletes a pool: it stops keeping sandboxes ready."""
        if not isinstance(pool_id, str) or not pool_id:
            raise ValueError(f"pool id must be a non-empty string, got {pool_id!r}")
        await self._t.unary(f"{_POOL}/Delete", {"id": pool_id})

    async def run_code(
        self,
        code: str,
        language: str,
        *,
        stdin: Union[bytes, str, None] = None,
        compile_timeout: Optional[float] = None,
        run_timeout: Optional[float] = None,
        memory_limit_mb: Optional[int] = None,
        files: Optional[Mapping[str, Union[bytes, str]]] = None,
        fetch_files: Optional[Sequence[str]] = None,
        args: Optional[Sequence[str]] = None,
        image: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
    ) -> RunCodeResult:
        """Runs ``code`` in ``language`` (a name from the server's language
        table: python, bash, c, cpp, go, nodejs, ...) in a clean sandbox
        from a warm pool and returns its output: a stateless call, as
        SandboxFusion's ``/run_code``.

        ``compile_timeout`` and ``run_timeout`` are seconds (server default
        10 each); ``files`` are written before compiling (path -> content),
        ``fetch_files`` are read back after the run; ``image`` overrides
        the language's image (NAME:TAG). A program that fails is not an
        error: look at ``status`` and ``run_result``. A DSecError means the
        call was refused (unknown language, bad argument, or
        ``UnavailableError`` with ``retry_after`` when saturated)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        if not isinstance(language, str) or not language:
            raise ValueError(f"language must be a non-empty string, got {language!r}")
        body: Dict[str, Any] = {"code": code, "language": language}
        if stdin:
            body["stdin"] = b64encode(stdin)
        if compile_timeout is not None:
            body["compileTimeout"] = format_duration(compile_timeout)
        if run_timeout is not None:
            body["runTimeout"] = format_duration(run_timeout)
        if memory_limit_mb:
            body["memoryLimitMb"] = str(_non_negative("memory_limit_mb", memory_limit_mb))
        if files:
            body["files"] = {_path(str(k)): b64encode(v) for k, v in files.items()}
        if fetch_files:
            if isinstance(fetch_files, str):
                raise TypeError("fetch_files must be a list of paths, not a single string")
            body["fetchFiles"] = [_path(str(f)) for f in fetch_files]
        if args:
            if isinstance(args, str):
                raise TypeError("args must be a list of strings, not a single string")
            body["args"] = [str(a) for a in args]
        if image:
            body["image"] = _ref(image)
        if max_output_bytes:
            body["maxOutputBytes"] = str(_non_negative("max_output_bytes", max_output_bytes))
        # The call compiles and runs within its own limits; the request may
        # also wait for a warm sandbox. Allow for both.
        limit = (compile_timeout or 10.0) + (run_timeout or 10.0) + _EXEC_GRACE_S
        default = self._t.default_timeout
        resp = await self._t.unary(f"{_FN}/RunCode", body, timeout=None if default is None else max(default, limit))
        return RunCodeResult.from_json(resp)

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
        max_import_mb: float = 0,
        defaults: Optional[Mapping[str, float]] = None,
    ) -> str:
        """Creates a tenant (admin only) and returns its bearer token, shown
        once. Quotas of 0 are unlimited (``max_import_mb`` 0: the server's
        limit). ``defaults`` (the ``resources`` keys of SandboxSpec: cpu,
        mem_mb, pids, disk_mb) are what its sandboxes get for resources
        their spec leaves out; a key missing takes the node's default."""
        quota = _quota_json(max_sandboxes=max_sandboxes, max_cpu=max_cpu, max_mem_mb=max_mem_mb, max_import_mb=max_import_mb)
        body: Dict[str, Any] = {"name": name}
        if any(v != "0" for v in quota.values()):
            body["quota"] = {k: v for k, v in quota.items() if v != "0"}
        res = _resources_json(defaults or {})
        if res:
            body["defaults"] = res
        resp = await self._t.unary(f"{_TENANT}/Create", body)
        return resp.get("token", "")

    async def update_tenant(
        self,
        name: str,
        *,
        max_sandboxes: Optional[int] = None,
        max_cpu: Optional[float] = None,
        max_mem_mb: Optional[float] = None,
        max_import_mb: Optional[float] = None,
        defaults: Optional[Mapping[str, Optional[float]]] = None,
    ) -> TenantInfo:
        """Changes what is given of a tenant's quota and defaults (admin
        only) and returns the tenant. None keeps a value; 0 sets a quota
        back to unlimited and a default (a ``defaults`` key with 0) back to
        the node's. Live sandboxes keep what they got."""
        body: Dict[str, Any] = {"name": name}
        for key, value in (("max_sandboxes", max_sandboxes), ("max_cpu", max_cpu),
                           ("max_mem_mb", max_mem_mb), ("max_import_mb", max_import_mb)):
            if value is not None:
                if float(value) < 0:
                    raise ValueError(f"{key} must not be negative, got {value!r}")
                json_key, convert = _QUOTA_FIELDS[key]
                body[json_key] = str(convert(value))
        for key, value in (defaults or {}).items():
            if value is None:
                continue
            if key not in _DEFAULT_FIELDS:
                raise ValueError(f"defaults[{key!r}]: unknown resource (want cpu, mem_mb, pids or disk_mb)")
            if float(value) < 0:
                raise ValueError(f"defaults[{key!r}] must not be negative, got {value!r}")
            json_key, convert = _DEFAULT_FIELDS[key]
            body[json_key] = str(convert(value))
        resp = await self._t.unary(f"{_TENANT}/Update", body)
        return TenantInfo.from_json(resp.get("tenant") or {})

    async def get_tenant(self, name: str = "") -> TenantInfo:
        """A tenant's quota, defaults and usage; ``name`` empty is the
        caller's own tenant (a tenant may get only itself)."""
        resp = await self._t.unary(f"{_TENANT}/Get", {"name": name} if name else {})
        return TenantInfo.from_json(resp.get("tenant") or {})

    async def list_tenants(self) -> List[TenantInfo]:
        """Every tenant (admin only)."""
        resp = await self._t.unary(f"{_TENANT}/List", {})
        return [TenantInfo.from_json(t) for t in resp.get("tenants") or []]

    # ------------------------------------------------------------ cluster

    async def list_nodes(self) -> List[NodeInfo]:
        """Every node the server knows, alive or not, sorted by id (admin
        only): capacity, charge, measured use and pressure, sandboxes by
        backend and state (see NodeInfo)."""
        resp = await self._t.unary(f"{_CLUSTER}/ListNodes", {})
        return [NodeInfo.from_json(n) for n in resp.get("nodes") or []]


def _cores(v: float) -> int:
    return int(round(float(v) * 1000))


def _mib(v: float) -> int:
    return int(round(float(v) * 1024 * 1024))


# UpdateTenantRequest's fields by the SDK's keyword or resources key.
_QUOTA_FIELDS: Dict[str, Any] = {
    "max_sandboxes": ("maxSandboxes", int),
    "max_cpu": ("maxMilliCpu", _cores),
    "max_mem_mb": ("maxMemoryBytes", _mib),
    "max_import_mb": ("maxImportBytes", _mib),
}
_DEFAULT_FIELDS: Dict[str, Any] = {
    "cpu": ("defaultMilliCpu", _cores),
    "mem_mb": ("defaultMemoryBytes", _mib),
    "pids": ("defaultPids", int),
    "disk_mb": ("defaultDiskBytes", _mib),
}


def _quota_json(*, max_sandboxes: float = 0, max_cpu: float = 0, max_mem_mb: float = 0, max_import_mb: float = 0) -> Dict[str, str]:
    return {
        "maxSandboxes": str(int(max_sandboxes)),
        "maxMilliCpu": str(_cores(max_cpu)),
        "maxMemoryBytes": str(_mib(max_mem_mb)),
        "maxImportBytes": str(_mib(max_import_mb)),
    }


class Sandbox:
    """A handle to one sandbox. ``async with`` destroys it on exit.

    The handle numbers the sandbox's operations (run, write_file,
    read_file, submit_reward, snapshot, checkpoint, rollback) 1, 2, 3, ...
    in the order they are called
    (``next_seq`` is the number the next one gets). The server records each
    numbered operation once: a number it has already recorded returns the
    recorded result (``replayed=True``) instead of running again. So a
    trainer that restarts, takes a new handle with ``client.sandbox(id)``
    and re-issues the same operations in the same order fast-forwards to
    where it was; and a request whose response was lost is re-sent
    transparently. Operations on one sandbox should all go through one
    handle: operations sent with a bare id are numbered by the server and
    take numbers the handle does not know about.
    """

    def __init__(self, client: DSecClient, info: SandboxInfo, next_seq: int = 1):
        self._client = client
        self.info = info
        self.next_seq = next_seq
        # False once the sandbox is known to have no trajectory (its node
        # runs without one): its operations are then sent without a number.
        self._numbered = True

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def node(self) -> str:
        return self.info.node

    @property
    def next_seq(self) -> int:
        """The trajectory step the next operation on this handle gets."""
        return self._next_seq

    @next_seq.setter
    def next_seq(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"next_seq must be an integer >= 1, got {value!r}")
        self._next_seq = value

    def _take_seq(self) -> int:
        # Synchronous on purpose: the number is fixed when the operation is
        # called, so call order is trajectory order even for concurrent calls.
        n = self._next_seq
        self._next_seq += 1
        return n

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def run(
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
        request_id: Optional[str] = None,
    ) -> Awaitable[ExecResult]:
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

        The command is the handle's next trajectory step (``result.seq``);
        ``result.replayed`` says it was recorded earlier and not run again.
        ``request_id`` is kept in the trajectory record.
        """
        return self._client.exec(
            self,
            cmd,
            timeout,
            env=env,
            cwd=cwd,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
            on_output=on_output,
            request_id=request_id,
        )

    async def verify(
        self,
        cmd: Union[str, Sequence[str]],
        artifacts: Sequence[str],
        timeout: Optional[float] = None,
        *,
        env: Union[Mapping[str, str], Sequence[str], None] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
    ) -> ExecResult:
        """Runs a grading command in a verifier: a fresh sandbox of this
        sandbox's images as created (its resources and environment, no
        network) holding only ``artifacts`` copied from this sandbox
        (absolute paths, files or directories, each to the same path).
        Nothing else the agent changed (a ``conftest.py`` that passes every
        test, a patched test runner, a trojaned binary) reaches the grade.
        The verifier is destroyed afterwards; the step is the handle's next
        trajectory step, like an exec."""
        return await self._client.verify(self, cmd, artifacts, timeout, env=env, cwd=cwd, user=user)

    def write_file(
        self, path: str, data: Union[bytes, str], mode: Optional[int] = None, *, request_id: Optional[str] = None
    ) -> Awaitable[OpResult]:
        """Writes ``data`` (str is encoded as UTF-8) to ``path``, creating or
        replacing it. Returns the write's ``seq`` and ``replayed``."""
        return self._client.write_file(self, path, data, mode, request_id=request_id)

    def read_file(
        self, path: str, max_bytes: Optional[int] = None, *, request_id: Optional[str] = None
    ) -> Awaitable[bytes]:
        """Reads ``path`` and returns its bytes."""
        return self._client.read_file(self, path, max_bytes, request_id=request_id)

    def read_file_result(
        self, path: str, max_bytes: Optional[int] = None, *, request_id: Optional[str] = None
    ) -> Awaitable[ReadFileResult]:
        """As read_file, but returns the bytes with the read's ``seq`` and ``replayed``."""
        return self._client.read_file_result(self, path, max_bytes, request_id=request_id)

    def submit_reward(
        self, value: float, metadata: Optional[Mapping[str, str]] = None, *, request_id: Optional[str] = None
    ) -> Awaitable[OpResult]:
        """Records a reward (and string metadata) as the sandbox's next trajectory step."""
        return self._client.submit_reward(self, value, metadata, request_id=request_id)

    def snapshot(self, ref: str, *, request_id: Optional[str] = None) -> Awaitable[ImageInfo]:
        """Makes an image ``ref`` (NAME:TAG, private to this tenant) of the
        sandbox's file system: its layers plus one holding what it changed.
        Sandboxes created from ``ref``, on any node, start from the file
        system as it is now; processes and ``/tmp`` (a tmpfs) are not part
        of it. The sandbox is frozen while its changes are packed and keeps
        running afterwards. A trajectory step: the image's ``seq`` and
        ``replayed`` say which."""
        return self._client.snapshot(self, ref, request_id=request_id)

    def checkpoint(self, *, request_id: Optional[str] = None) -> Awaitable[str]:
        """Checkpoints the sandbox's file system in place and returns the
        checkpoint id, for :meth:`rollback`. A trajectory step. Checkpoints
        live on the sandbox's node until deleted or the sandbox ends."""
        return self._client.checkpoint(self, request_id=request_id)

    def checkpoint_result(self, *, request_id: Optional[str] = None) -> Awaitable[CheckpointResult]:
        """As checkpoint, but returns the id with the step's ``seq`` and ``replayed``."""
        return self._client.checkpoint_result(self, request_id=request_id)

    def rollback(self, checkpoint_id: str, *, request_id: Optional[str] = None) -> Awaitable[OpResult]:
        """Kills every process in the sandbox and resets its file system to
        exactly the checkpoint's. The sandbox keeps its id; the checkpoint
        stays, so the sandbox can be rolled back to it again. A trajectory
        step: returns its ``seq`` and ``replayed``."""
        return self._client.rollback(self, checkpoint_id, request_id=request_id)

    async def delete_checkpoint(self, checkpoint_id: str) -> None:
        """Frees a checkpoint. Not a trajectory step."""
        await self._client.delete_checkpoint(self, checkpoint_id)

    async def freeze(self) -> SandboxInfo:
        """Stops every process in the sandbox (cgroup freezer): they use no
        CPU and keep their memory. Until :meth:`thaw`, operations raise
        FailedPreconditionError and the state is ``"frozen"``. Not a
        numbered step (recorded as an event)."""
        self.info = await self._client.freeze(self)
        return self.info

    async def thaw(self) -> SandboxInfo:
        """Resumes a frozen sandbox."""
        self.info = await self._client.thaw(self)
        return self.info

    async def screenshot(self) -> Screenshot:
        """What the sandbox's screen shows: ``Screenshot(png, width,
        height)``. Only fullvm sandboxes have a screen."""
        return await self._client.screenshot(self)

    async def input(self, *events: InputEvent) -> None:
        """Sends keyboard and mouse input to the sandbox's screen, e.g.
        ``await sb.input(InputEvent.text("ls"), InputEvent.key("ret"))``."""
        await self._client.input(self, *events)

    async def set_network(self, rules: Optional[Mapping[str, bool]] = None, *, replace: bool = False) -> Dict[str, bool]:
        """Changes (or, with no rules, reads) the sandbox's egress policy;
        see :meth:`DSecClient.set_network`."""
        return await self._client.set_network(self, rules, replace=replace)

    async def trajectory(self, include_data: bool = False) -> List[Dict[str, Any]]:
        """The sandbox's trajectory records; see :meth:`DSecClient.trajectory`."""
        return await self._client.trajectory(self, include_data)

    async def refresh(self) -> SandboxInfo:
        """Fetches the sandbox's current description (state, node, ...).
        It does not change the handle's ``next_seq``."""
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


def _handle(client: DSecClient, info: SandboxInfo) -> Sandbox:
    """A handle to a sandbox just created, numbering from 1 (its first step)."""
    sb = Sandbox(client, info)
    # next_seq 0 means the sandbox's node keeps no trajectory.
    sb._numbered = info.next_seq != 0
    return sb


def _id(sandbox: Union[str, Sandbox]) -> str:
    if isinstance(sandbox, Sandbox):
        return sandbox.id
    if not isinstance(sandbox, str) or not sandbox:
        raise ValueError(f"sandbox id must be a non-empty string, got {sandbox!r}")
    return sandbox


# The keys a batch_exec command mapping may have: cmd and exec's options.
_BATCH_EXEC_KEYS = frozenset({"cmd", "timeout", "env", "cwd", "user", "stdin", "max_output_bytes", "seq", "request_id"})


def _per_item(items: List[Any], return_exceptions: bool) -> List[Any]:
    """The batch convention: every item ran; raise the first error unless
    the caller takes them in the list."""
    if not return_exceptions:
        for x in items:
            if isinstance(x, DSecError):
                raise x
    return items


def _exec_body(
    sandbox: Union[str, Sandbox, None],
    cmd: Union[str, Sequence[str]],
    timeout: Optional[float],
    env: Union[Mapping[str, str], Sequence[str], None],
    cwd: Optional[str],
    user: Optional[str],
    stdin: Union[bytes, str, None],
    max_output_bytes: Optional[int],
) -> Dict[str, Any]:
    """The ExecRequest JSON of one command, checked, without its number
    (and without a sandbox id when ``sandbox`` is None: Run's)."""
    body: Dict[str, Any] = {} if sandbox is None else {"sandboxId": _id(sandbox)}
    if isinstance(cmd, str):
        if not cmd:
            raise ValueError("cmd must not be empty")
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
        body["maxOutputBytes"] = str(_non_negative("max_output_bytes", max_output_bytes))
    return body


def _number(body: Dict[str, Any], sandbox: Union[str, Sandbox], seq: Optional[int], request_id: Optional[str]) -> Optional[int]:
    """Puts the operation's seq (see DSecClient "operations") and request id
    into ``body`` and returns the seq, or None when the server numbers it.
    Called last when building a request, so a request refused for a bad
    argument never uses up a number of the handle."""
    if request_id:
        body["requestId"] = str(request_id)
    if seq is not None:
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise ValueError(f"seq must be an integer >= 1, got {seq!r}")
        n: Optional[int] = seq
    elif isinstance(sandbox, Sandbox) and sandbox._numbered:
        n = sandbox._take_seq()
    else:
        return None
    body["seq"] = str(n)  # uint64: a string in proto3 JSON
    return n


async def _data_of(result: Awaitable[ReadFileResult]) -> bytes:
    return (await result).data


async def _id_of(result: Awaitable[CheckpointResult]) -> str:
    return (await result).id


def _snapshot_image(d: Dict[str, Any]) -> ImageInfo:
    image = ImageInfo.from_json(d.get("image") or {})
    image.seq = int(d.get("seq", 0))
    image.replayed = bool(d.get("replayed", False))
    return image


# Arguments the server would refuse are refused here instead, before the
# operation takes a number: the server refuses them without recording
# anything, so the number would stay unused and every later operation of
# the handle would wait on it ("beyond the next expected").


def _non_negative(name: str, value: int) -> int:
    if int(value) < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return int(value)


# An image name: '/'-separated components of lowercase letters and digits
# joined by one '.', one or two '_', or '-'s; a tag of up to 128 of
# [A-Za-z0-9_.-], not starting with '.' or '-'.
_NAME_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def _ref(ref: str) -> str:
    """Checks an image reference NAME[:TAG] as the server does."""
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"ref must be a non-empty NAME:TAG string, got {ref!r}")
    name, sep, tag = ref.rpartition(":")
    if not sep:
        name, tag = ref, "latest"
    ok = (
        "@" not in ref
        and "/" not in tag
        and 0 < len(name) <= 255
        and all(_NAME_COMPONENT.fullmatch(c) for c in name.split("/"))
        and _TAG.fullmatch(tag) is not None
    )
    if not ok:
        raise ValueError(
            f"ref {ref!r} is not a valid image reference NAME:TAG (name: lowercase letters and digits "
            "separated by '.', '_' or '-' and '/'; tag: letters, digits, '_', '.', '-')"
        )
    return ref


def _path(path: str) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    return path
