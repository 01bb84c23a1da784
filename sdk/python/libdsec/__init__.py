"""libdsec: the asyncio Python client for DSec sandboxes.

It speaks the Connect JSON protocol over httpx to a DSec API server::

    from libdsec import DSecClient, SandboxSpec, BackendKind

    async with await DSecClient.create() as client:
        spec = SandboxSpec(backend=BackendKind.CONTAINER, base_image="busybox:latest")
        async with await client.create(spec) as sb:
            out = await sb.run("echo hello", timeout=60)
            print(out.exit_code, out.stdout)

Trainers driving many sandboxes use the batch calls: ``acquire``,
``batch_exec``, ``batch_rollback`` and ``release`` (one request per step,
one result per sandbox). ``create_pool`` keeps sandboxes warm ahead of
demand, and ``run_code`` runs a snippet in a language statelessly. A
saturated service answers ``UnavailableError`` with ``retry_after`` set.

Only httpx is needed (Debian: python3-httpx).
"""

from .client import DEFAULT_ENDPOINT, DEFAULT_TOKEN_FILE, DSecClient, Sandbox
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .models import (
    BackendKind,
    CheckpointResult,
    CommandResult,
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
)

__all__ = [
    "DSecClient",
    "Sandbox",
    "SandboxSpec",
    "SandboxInfo",
    "BackendKind",
    "ExecResult",
    "OpResult",
    "ReadFileResult",
    "CheckpointResult",
    "JobResult",
    "ImageInfo",
    "PoolInfo",
    "TenantInfo",
    "NodeInfo",
    "RunCodeResult",
    "CommandResult",
    "Screenshot",
    "InputEvent",
    "DEFAULT_ENDPOINT",
    "DEFAULT_TOKEN_FILE",
] + list(_errors_all)
