"""The values that cross the API: sandbox specs, sandbox descriptions, exec
results and images, with their proto3 JSON encodings.

The encodings follow the proto3 JSON mapping the Connect JSON protocol uses:
lowerCamelCase field names, 64-bit integers as strings (accepted either
way), bytes as base64, durations as ``"1.5s"``, timestamps as RFC 3339.
Default values are omitted on the wire, so every decoder tolerates missing
fields.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

__all__ = [
    "BackendKind",
    "SandboxSpec",
    "SandboxInfo",
    "NodeInfo",
    "ExecResult",
    "OpResult",
    "ReadFileResult",
    "CheckpointResult",
    "JobResult",
    "ImageInfo",
    "PoolInfo",
    "CommandResult",
    "RunCodeResult",
]


class BackendKind(str, enum.Enum):
    """Which backend runs a sandbox (the spec's ``backend`` field)."""

    CONTAINER = "container"
    FNCALL = "fncall"
    MICROVM = "microvm"
    FULLVM = "fullvm"

    def __str__(self) -> str:
        return self.value


_MIB = 1024 * 1024


@dataclass
class SandboxSpec:
    """What to create.

    ``resources`` takes ``cpu`` (cores, fractions allowed), ``mem_mb``
    (MiB), ``pids`` and ``disk_mb`` (MiB the sandbox may write over its
    image); anything else is refused so a typo does not silently go
    unlimited. What is left out takes the tenant's default, else the
    node's, and is charged to the tenant's quota like an explicit value: a
    sandbox's spec as the server returns it carries what it got. ``env`` (a mapping or a list of
    ``K=V``) is added to every exec in the sandbox. ``idle_action`` is what
    ``idle_timeout_s`` does: ``"destroy"`` (the default) or ``"freeze"``
    (the sandbox keeps its processes and memory until ``thaw``).

    ``network_rules`` is the sandbox's egress policy, default deny: a
    mapping of rule to on/off (``{"pypi": True, "npm": False}``) where a
    rule is a named rule (pypi, npm, crates, goproxy, debian, ubuntu,
    github, huggingface), a host (``example.org``, ``*.example.org``,
    ``example.org:443``), an address or a CIDR; a deny wins over an allow.
    Every exec gets ``http_proxy``/``https_proxy`` pointing at the
    sandbox's proxy; ``Sandbox.set_network`` changes the rules later.
    """

    backend: Union[BackendKind, str] = BackendKind.CONTAINER
    base_image: str = ""
    workspace: Optional[str] = None
    toolkits: List[str] = field(default_factory=list)
    resources: Dict[str, float] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)
    ttl_s: Optional[float] = None
    idle_timeout_s: Optional[float] = None
    env: Union[Mapping[str, str], Sequence[str], None] = None
    idle_action: Optional[str] = None
    network_rules: Optional[Mapping[str, bool]] = None

    def to_json(self) -> Dict[str, Any]:
        """The proto3 JSON form of dsec.v1.SandboxSpec."""
        backend = self.backend.value if isinstance(self.backend, BackendKind) else str(self.backend)
        out: Dict[str, Any] = {"backend": backend}
        if self.base_image:
            out["image"] = self.base_image
        if self.workspace:
            out["workspace"] = self.workspace
        if self.toolkits:
            out["toolkits"] = list(self.toolkits)
        res = _resources_json(self.resources or {})
        if res:
            out["resources"] = res
        if self.labels:
            out["labels"] = {str(k): str(v) for k, v in self.labels.items()}
        if self.ttl_s is not None:
            out["ttl"] = format_duration(self.ttl_s)
        if self.idle_timeout_s is not None:
            out["idleTimeout"] = format_duration(self.idle_timeout_s)
        env = env_list(self.env)
        if env:
            out["env"] = env
        if self.idle_action:
            out["idleAction"] = str(self.idle_action)
        net = network_json(self.network_rules)
        if net:
            out["network"] = net
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SandboxSpec":
        """Decodes the proto3 JSON form of dsec.v1.SandboxSpec."""
        backend: Union[BackendKind, str] = d.get("backend") or BackendKind.CONTAINER.value
        try:
            backend = BackendKind(backend)
        except ValueError:
            pass  # a backend newer than this SDK: keep the name
        resources = _resources_dict(d.get("resources") or {})
        return cls(
            backend=backend,
            base_image=d.get("image", ""),
            workspace=d.get("workspace") or None,
            toolkits=list(d.get("toolkits") or []),
            resources=resources,
            labels=dict(d.get("labels") or {}),
            ttl_s=parse_duration(d["ttl"]) if d.get("ttl") else None,
            idle_timeout_s=parse_duration(d["idleTimeout"]) if d.get("idleTimeout") else None,
            env=list(d.get("env") or []) or None,
            idle_action=d.get("idleAction") or None,
            network_rules=network_rules(d.get("network")),
        )


def network_json(rules: Optional[Mapping[str, bool]]) -> Dict[str, List[str]]:
    """The proto3 JSON form of dsec.v1.NetworkPolicy for ``{rule: on}``."""
    out: Dict[str, List[str]] = {}
    for rule, on in (rules or {}).items():
        out.setdefault("allow" if on else "deny", []).append(str(rule))
    return out


def network_rules(d: Optional[Mapping[str, Any]]) -> Optional[Dict[str, bool]]:
    """``{rule: on}`` from the proto3 JSON form of dsec.v1.NetworkPolicy."""
    if not d:
        return None
    out: Dict[str, bool] = {r: True for r in d.get("allow") or []}
    out.update({r: False for r in d.get("deny") or []})
    return out or None


def _resources_json(res: Mapping[str, float]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for key, value in res.items():
        if value is None:
            continue
        if key == "cpu":
            out["milliCpu"] = str(int(round(float(value) * 1000)))
        elif key == "mem_mb":
            out["memoryBytes"] = str(int(round(float(value) * _MIB)))
        elif key == "pids":
            out["pids"] = str(int(value))
        elif key == "disk_mb":
            out["diskBytes"] = str(int(round(float(value) * _MIB)))
        else:
            raise ValueError(f"resources[{key!r}]: unknown resource (want cpu, mem_mb, pids or disk_mb)")
    return out


def _resources_dict(r: Mapping[str, Any]) -> Dict[str, float]:
    """The SDK's resources keys of a dsec.v1.Resources in JSON (zeros left out)."""
    out: Dict[str, float] = {}
    if r.get("milliCpu"):
        out["cpu"] = int(r["milliCpu"]) / 1000
    if r.get("memoryBytes"):
        out["mem_mb"] = int(r["memoryBytes"]) / _MIB
    if r.get("pids"):
        out["pids"] = int(r["pids"])
    if r.get("diskBytes"):
        out["disk_mb"] = int(r["diskBytes"]) / _MIB
    return out


@dataclass
class TenantInfo:
    """A tenant: its quota (0 = unlimited; ``max_import_mb`` 0 = the
    server's limit), the ``defaults`` its sandboxes get for resources their
    spec leaves out (the ``resources`` keys of SandboxSpec; a key missing
    takes the node's default), and ``usage``: what its sandboxes and pools
    hold now as charged to the quota (``sandboxes``, ``cpu``, ``mem_mb``)."""

    name: str
    max_sandboxes: int = 0
    max_cpu: float = 0
    max_mem_mb: float = 0
    max_import_mb: float = 0
    defaults: Dict[str, float] = field(default_factory=dict)
    usage: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TenantInfo":
        q = d.get("quota") or {}
        u = d.get("usage") or {}
        return cls(
            name=d.get("name", ""),
            max_sandboxes=int(q.get("maxSandboxes", 0)),
            max_cpu=int(q.get("maxMilliCpu", 0)) / 1000,
            max_mem_mb=int(q.get("maxMemoryBytes", 0)) / _MIB,
            max_import_mb=int(q.get("maxImportBytes", 0)) / _MIB,
            defaults=_resources_dict(d.get("defaults") or {}),
            usage={
                "sandboxes": int(u.get("sandboxes", 0)),
                "cpu": int(u.get("milliCpu", 0)) / 1000,
                "mem_mb": int(u.get("memoryBytes", 0)) / _MIB,
            },
        )


@dataclass
class SandboxInfo:
    """A sandbox as the server describes it (Get and List)."""

    id: str
    node: str = ""
    tenant: str = ""
    state: str = ""
    spec: Optional[SandboxSpec] = None
    created_at: Optional[datetime] = None
    last_active_at: Optional[datetime] = None
    layers: List[str] = field(default_factory=list)
    reason: str = ""
    # The number the sandbox's trajectory expects next (0 when its node
    # keeps no trajectory). This is the server's view; a Sandbox handle
    # keeps its own counter (Sandbox.next_seq).
    next_seq: int = 0
    # What the sandbox uses as its node last measured it (every few
    # seconds): ``cpu`` in cores averaged over ``usage_window_s`` seconds
    # (None while the node has measured it once only: cpu is then 0),
    # ``mem_mb`` its memory less inactive file pages, ``swap_mb``. Empty
    # until measured, and for backends that cannot say.
    usage: Dict[str, float] = field(default_factory=dict)
    usage_window_s: Optional[float] = None
    usage_at: Optional[datetime] = None

    @property
    def labels(self) -> Dict[str, str]:
        return dict(self.spec.labels) if self.spec else {}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SandboxInfo":
        u = d.get("usage")
        return cls(
            id=d.get("id", ""),
            node=d.get("node", ""),
            tenant=d.get("tenant", ""),
            state=d.get("state", ""),
            spec=SandboxSpec.from_json(d["spec"]) if d.get("spec") is not None else None,
            created_at=parse_timestamp(d.get("createdAt")),
            last_active_at=parse_timestamp(d.get("lastActiveAt")),
            layers=list(d.get("layers") or []),
            reason=d.get("reason", ""),
            next_seq=int(d.get("nextSeq", 0)),
            usage=_usage_dict(u) if u is not None else {},
            usage_window_s=parse_duration(u["window"]) if u and u.get("window") else None,
            usage_at=parse_timestamp(u.get("measuredAt")) if u else None,
        )


def _usage_dict(u: Mapping[str, Any]) -> Dict[str, float]:
    return {
        "cpu": int(u.get("milliCpu", 0)) / 1000,
        "mem_mb": int(u.get("memoryBytes", 0)) / _MIB,
        "swap_mb": int(u.get("swapBytes", 0)) / _MIB,
    }


@dataclass
class NodeInfo:
    """A node as the server last heard from it (``DSecClient.list_nodes``,
    admin only). A node that missed the server's node timeout is not
    ``alive``: its figures are those of its last heartbeat and its
    sandboxes count as lost.

    ``backends`` maps each backend the node offers to what it offers
    (``cpu`` cores, ``mem_mb``, ``sandboxes`` slots), what placement
    charges it (``charged_cpu``, ``charged_mem_mb``, ``charged_sandboxes``:
    measured use plus its request share of what its sandboxes request),
    what they request (``requested_cpu``, ``requested_mem_mb``), the
    shares (``request_share_cpu``, ``request_share_mem``) and what its
    sandboxes are measured to use together (``used_cpu``, ``used_mem_mb``,
    ``used_swap_mb``). ``measured`` is what the node measures about itself:
    ``cpu`` (busy cores), ``mem_total_mb``, ``mem_used_mb``,
    ``mem_available_mb``, ``swap_total_mb``, ``swap_used_mb``,
    ``psi_memory_some``, ``psi_memory_full``, ``psi_cpu_some`` (PSI avg10
    percent, -1 without PSI), ``open_files``, ``max_open_files``,
    ``threads``, ``max_threads``. ``full`` says why it refuses creates
    (empty: it takes them). ``sandboxes`` counts its sandboxes by backend,
    then state."""

    id: str
    alive: bool = False
    last_heartbeat_at: Optional[datetime] = None
    url: str = ""
    full: str = ""
    load: float = 0.0
    queued: int = 0
    pools: int = 0
    backends: Dict[str, Dict[str, float]] = field(default_factory=dict)
    measured: Dict[str, float] = field(default_factory=dict)
    sandboxes: Dict[str, Dict[str, int]] = field(default_factory=dict)

    @property
    def by_state(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for states in self.sandboxes.values():
            for state, n in states.items():
                out[state] = out.get(state, 0) + n
        return out

    @property
    def by_backend(self) -> Dict[str, int]:
        return {b: sum(states.values()) for b, states in self.sandboxes.items()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "NodeInfo":
        backends: Dict[str, Dict[str, float]] = {}
        for b in d.get("backends") or []:
            g = lambda k: int(b.get(k, 0))  # noqa: E731
            backends[b.get("backend", "")] = {
                "cpu": g("milliCpu") / 1000,
                "mem_mb": g("memoryBytes") / _MIB,
                "sandboxes": g("sandboxes"),
                "charged_cpu": g("chargedMilliCpu") / 1000,
                "charged_mem_mb": g("chargedMemoryBytes") / _MIB,
                "charged_sandboxes": g("chargedSandboxes"),
                "requested_cpu": g("requestedMilliCpu") / 1000,
                "requested_mem_mb": g("requestedMemoryBytes") / _MIB,
                "request_share_cpu": float(b.get("requestShareCpu", 0)),
                "request_share_mem": float(b.get("requestShareMemory", 0)),
                "used_cpu": g("usedMilliCpu") / 1000,
                "used_mem_mb": g("usedMemoryBytes") / _MIB,
                "used_swap_mb": g("usedSwapBytes") / _MIB,
            }
        m = d.get("measured")
        measured: Dict[str, float] = {}
        if m is not None:
            i = lambda k: int(m.get(k, 0))  # noqa: E731
            measured = {
                "cpu": i("milliCpu") / 1000,
                "mem_total_mb": i("memoryTotalBytes") / _MIB,
                "mem_used_mb": i("memoryUsedBytes") / _MIB,
                "mem_available_mb": i("memoryAvailableBytes") / _MIB,
                "swap_total_mb": i("swapTotalBytes") / _MIB,
                "swap_used_mb": i("swapUsedBytes") / _MIB,
                "psi_memory_some": float(m.get("psiMemorySome", 0)),
                "psi_memory_full": float(m.get("psiMemoryFull", 0)),
                "psi_cpu_some": float(m.get("psiCpuSome", 0)),
                "open_files": i("openFiles"),
                "max_open_files": i("maxOpenFiles"),
                "threads": i("threads"),
                "max_threads": i("maxThreads"),
            }
        sandboxes: Dict[str, Dict[str, int]] = {}
        for c in d.get("sandboxes") or []:
            sandboxes.setdefault(c.get("backend", ""), {})[c.get("state", "")] = int(c.get("count", 0))
        return cls(
            id=d.get("id", ""),
            alive=bool(d.get("alive", False)),
            last_heartbeat_at=parse_timestamp(d.get("lastHeartbeatAt")),
            url=d.get("url", ""),
            full=d.get("full", ""),
            load=float(d.get("load", 0)),
            queued=int(d.get("queued", 0)),
            pools=int(d.get("pools", 0)),
            backends=backends,
            measured=measured,
            sandboxes=sandboxes,
        )


@dataclass(frozen=True)
class ExecResult:
    """What happened to one command.

    ``outcome`` is ``"ok"`` (exit 0), ``"failed"`` (non-zero exit or
    signal), ``"timeout"`` or ``"infra_error"``. ``infra_error`` is ``None``
    unless the infrastructure failed (sandbox lost, node gone, server
    unreachable); then it is a non-empty string saying what failed, so
    ``if out.infra_error:`` reads naturally and a trainer can mask the
    sample instead of learning from it. ``exit_code`` is -1 when the
    command did not run to completion because of an infra error.
    ``stdout``/``stderr`` are decoded UTF-8 (invalid bytes replaced);
    ``stdout_bytes``/``stderr_bytes`` are exactly what was captured.
    ``duration`` is in seconds.

    ``seq`` is the command's step in the sandbox's trajectory (0 if the
    server did not say); ``replayed`` is True when the result was recorded
    earlier and returned without running the command again (fast-forward).
    """

    exit_code: int
    stdout: str
    stderr: str
    duration: float
    timed_out: bool
    infra_error: Optional[str]
    outcome: str = "ok"
    signal: int = 0
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom_killed: bool = False
    seq: int = 0
    replayed: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ExecResult":
        stdout = b64decode(d.get("stdout"))
        stderr = b64decode(d.get("stderr"))
        outcome = d.get("outcome") or ""
        infra = d.get("infraError") or None
        exit_code = int(d.get("exitCode", 0))
        timed_out = bool(d.get("timedOut", False))
        if outcome == "infra_error" or infra:
            outcome = "infra_error"
            infra = infra or "infrastructure error (no detail from server)"
            if exit_code == 0:
                exit_code = -1
        elif not outcome:
            # Older servers may leave the outcome out; derive it.
            if timed_out:
                outcome = "timeout"
            elif exit_code != 0 or d.get("signal"):
                outcome = "failed"
            else:
                outcome = "ok"
        return cls(
            exit_code=exit_code,
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr.decode("utf-8", errors="replace"),
            duration=parse_duration(d["duration"]) if d.get("duration") else 0.0,
            timed_out=timed_out,
            infra_error=infra,
            outcome=outcome,
            signal=int(d.get("signal", 0)),
            stdout_bytes=stdout,
            stderr_bytes=stderr,
            stdout_truncated=bool(d.get("stdoutTruncated", False)),
            stderr_truncated=bool(d.get("stderrTruncated", False)),
            oom_killed=bool(d.get("oomKilled", False)),
            seq=int(d.get("seq", 0)),
            replayed=bool(d.get("replayed", False)),
        )

    @classmethod
    def infra_failure(cls, what: str, duration: float = 0.0, seq: int = 0) -> "ExecResult":
        """The result of a command the infrastructure could not run."""
        return cls(
            exit_code=-1,
            stdout="",
            stderr="",
            duration=duration,
            timed_out=False,
            infra_error=what or "infrastructure error",
            outcome="infra_error",
            seq=seq,
        )


@dataclass(frozen=True)
class OpResult:
    """What write_file and submit_reward return: the operation's step in
    the sandbox's trajectory and whether it was replayed (recorded earlier,
    not done again)."""

    seq: int = 0
    replayed: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "OpResult":
        return cls(seq=int(d.get("seq", 0)), replayed=bool(d.get("replayed", False)))


@dataclass(frozen=True)
class ReadFileResult:
    """What read_file_result returns: the bytes read, with the read's step
    in the trajectory and whether it was replayed."""

    data: bytes = b""
    seq: int = 0
    replayed: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ReadFileResult":
        return cls(data=b64decode(d.get("data")), seq=int(d.get("seq", 0)), replayed=bool(d.get("replayed", False)))


@dataclass(frozen=True)
class Screenshot:
    """What a sandbox's screen shows: a PNG image and its size."""

    png: bytes = b""
    width: int = 0
    height: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Screenshot":
        return cls(png=b64decode(d.get("png")), width=int(d.get("width", 0)), height=int(d.get("height", 0)))


@dataclass(frozen=True)
class InputEvent:
    """One keyboard or mouse event for ``Sandbox.input``; make them with
    :meth:`text`, :meth:`key`, :meth:`move` and :meth:`click`."""

    kind: str
    text_: str = ""
    key_: str = ""
    x: int = 0
    y: int = 0
    button: str = ""

    @classmethod
    def text(cls, text: str) -> "InputEvent":
        """Types ``text``, one key press per character."""
        return cls("text", text_=text)

    @classmethod
    def key(cls, key: str) -> "InputEvent":
        """Presses and releases ``key``: one key or a chord joined by "-",
        with QEMU's key names ("ret", "esc", "ctrl-alt-delete", "shift-a")."""
        return cls("key", key_=key)

    @classmethod
    def move(cls, x: int, y: int) -> "InputEvent":
        """Moves the pointer to ``x``, ``y`` (pixels from the top left)."""
        return cls("move", x=x, y=y)

    @classmethod
    def click(cls, x: int, y: int, button: str = "left") -> "InputEvent":
        """Moves the pointer to ``x``, ``y`` and clicks ``button``
        ("left", "middle" or "right")."""
        return cls("click", x=x, y=y, button=button)

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"kind": self.kind}
        if self.text_:
            d["text"] = self.text_
        if self.key_:
            d["key"] = self.key_
        if self.kind in ("move", "click"):
            d["x"], d["y"] = self.x, self.y
        if self.button:
            d["button"] = self.button
        return d


@dataclass
class ImageInfo:
    """An image ref and the layers it names."""

    ref: str
    digest: str = ""
    layers: List[str] = field(default_factory=list)
    size: int = 0
    created_at: Optional[datetime] = None
    tenant: str = ""
    # Set on the image Sandbox.snapshot returns: the snapshot's step in the
    # source sandbox's trajectory, and whether it was recorded earlier and
    # not taken again (then only ref, digest and tenant are set).
    seq: int = 0
    replayed: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ImageInfo":
        return cls(
            ref=d.get("ref", ""),
            digest=d.get("digest", ""),
            layers=list(d.get("layers") or []),
            size=int(d.get("size", 0)),
            created_at=parse_timestamp(d.get("createdAt")),
            tenant=d.get("tenant", ""),
        )


@dataclass(frozen=True)
class CheckpointResult:
    """What checkpoint_result returns: the checkpoint's id (for rollback and
    delete_checkpoint), with the checkpoint's step in the trajectory and
    whether it was replayed."""

    id: str = ""
    seq: int = 0
    replayed: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "CheckpointResult":
        return cls(id=d.get("checkpointId", ""), seq=int(d.get("seq", 0)), replayed=bool(d.get("replayed", False)))


@dataclass(frozen=True)
class JobResult:
    """What a job-wide freeze or thaw did to one sandbox: ``error`` is None
    when it worked. ``id`` is ``"node/NODE"`` for a node that did not answer
    (its sandboxes are in an unknown state)."""

    id: str
    error: Optional[Exception] = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class PoolInfo:
    """A warm pool: ``size`` sandboxes of ``spec`` kept created and clean
    ahead of demand on one node. ``ready`` are waiting to be taken,
    ``in_use`` are handed out, ``resetting`` are on their way back. A
    create or acquire by the pool's tenant whose spec matches takes a ready
    one (``hits``); one that finds the pool empty counts as a ``miss``.
    Unused for ``idle_shrink_s`` seconds, the pool shrinks to
    ``min_size``."""

    id: str
    spec: Optional[SandboxSpec] = None
    size: int = 0
    ready: int = 0
    in_use: int = 0
    resetting: int = 0
    node: str = ""
    tenant: str = ""
    min_size: int = 0
    idle_shrink_s: Optional[float] = None
    hits: int = 0
    misses: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PoolInfo":
        return cls(
            id=d.get("id", ""),
            spec=SandboxSpec.from_json(d["spec"]) if d.get("spec") is not None else None,
            size=int(d.get("size", 0)),
            ready=int(d.get("ready", 0)),
            in_use=int(d.get("inUse", 0)),
            resetting=int(d.get("resetting", 0)),
            node=d.get("node", ""),
            tenant=d.get("tenant", ""),
            min_size=int(d.get("minSize", 0)),
            idle_shrink_s=parse_duration(d["idleShrink"]) if d.get("idleShrink") else None,
            hits=int(d.get("hits", 0)),
            misses=int(d.get("misses", 0)),
        )


@dataclass(frozen=True)
class CommandResult:
    """One step of a run_code call (compiling or running).

    ``status`` is ``"Finished"`` (ran to its end, any return code),
    ``"TimeLimitExceeded"`` or ``"Error"`` (could not be run).
    ``execution_time`` is the wall time in seconds. ``stdout``/``stderr``
    are decoded UTF-8 (invalid bytes replaced); ``stdout_bytes`` and
    ``stderr_bytes`` are exactly what was captured."""

    status: str = ""
    execution_time: float = 0.0
    return_code: int = 0
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom_killed: bool = False
    signal: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "CommandResult":
        out = b64decode(d.get("stdout"))
        err = b64decode(d.get("stderr"))
        return cls(
            status=d.get("status", ""),
            execution_time=float(d.get("executionTime", 0.0)),
            return_code=int(d.get("returnCode", 0)),
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            stdout_bytes=out,
            stderr_bytes=err,
            stdout_truncated=bool(d.get("stdoutTruncated", False)),
            stderr_truncated=bool(d.get("stderrTruncated", False)),
            oom_killed=bool(d.get("oomKilled", False)),
            signal=int(d.get("signal", 0)),
        )


@dataclass(frozen=True)
class RunCodeResult:
    """What a run_code call did (SandboxFusion's /run_code response).

    ``status`` is ``"Success"`` (exit 0), ``"Failed"`` (the code failed:
    compile error, non-zero exit, time or memory limit) or
    ``"SandboxError"`` (DSec failed, not the code: mask the sample).
    ``compile_result`` is None when the language is not compiled;
    ``run_result`` is None when compiling failed. ``files`` holds the
    requested ``fetch_files`` that existed after the run."""

    status: str = ""
    message: str = ""
    compile_result: Optional[CommandResult] = None
    run_result: Optional[CommandResult] = None
    files: Dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "Success"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RunCodeResult":
        return cls(
            status=d.get("status", ""),
            message=d.get("message", ""),
            compile_result=CommandResult.from_json(d["compileResult"]) if d.get("compileResult") is not None else None,
            run_result=CommandResult.from_json(d["runResult"]) if d.get("runResult") is not None else None,
            files={str(k): b64decode(v) for k, v in (d.get("files") or {}).items()},
        )


# ------------------------------------------------------------ wire helpers


def format_duration(seconds: float) -> str:
    """Formats seconds as a proto3 JSON Duration ("30s", "1.5s")."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"duration must be a number of seconds, got {seconds!r}")
    if seconds < 0:
        raise ValueError(f"duration must not be negative, got {seconds!r}")
    if isinstance(seconds, int) or float(seconds).is_integer():
        return f"{int(seconds)}s"
    text = f"{seconds:.9f}".rstrip("0").rstrip(".")
    return text + "s"


def parse_duration(text: str) -> float:
    """Parses a proto3 JSON Duration into seconds."""
    if not isinstance(text, str) or not text.endswith("s"):
        raise ValueError(f"malformed duration {text!r} (want e.g. \"1.5s\")")
    return float(text[:-1])


def parse_timestamp(text: Optional[str]) -> Optional[datetime]:
    """Parses an RFC 3339 timestamp; Python keeps microseconds, so nanoseconds are cut."""
    if not text:
        return None
    t = text.replace("Z", "+00:00").replace("z", "+00:00")
    if "." in t:
        head, rest = t.split(".", 1)
        i = 0
        while i < len(rest) and rest[i].isdigit():
            i += 1
        t = head + "." + (rest[:i][:6].ljust(6, "0")) + rest[i:]
    return datetime.fromisoformat(t)


def b64encode(data: Union[bytes, bytearray, memoryview, str]) -> str:
    if isinstance(data, str):
        data = data.encode("utf-8")
    return base64.b64encode(bytes(data)).decode("ascii")


def b64decode(text: Optional[str]) -> bytes:
    """Decodes proto3 JSON bytes, which may use the standard or URL-safe alphabet, padded or not."""
    if not text:
        return b""
    text = text.replace("-", "+").replace("_", "/")
    return base64.b64decode(text + "=" * (-len(text) % 4))


def env_list(env: Union[Mapping[str, str], Sequence[str], None]) -> List[str]:
    """Normalises an environment given as a mapping or as K=V strings."""
    if not env:
        return []
    if isinstance(env, Mapping):
        return [f"{k}={v}" for k, v in env.items()]
    if isinstance(env, str):
        raise TypeError("env must be a mapping or a list of K=V strings, not a single string")
    out = []
    for item in env:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"env entry {item!r} is not K=V")
        out.append(item)
    return out
