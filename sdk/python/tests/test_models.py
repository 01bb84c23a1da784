"""Wire encoding and error mapping, checked without a server."""

import socket
from datetime import datetime, timezone

import pytest

from libdsec import (
    BackendKind,
    DSecClient,
    DSecError,
    ExecResult,
    NotFoundError,
    ResourceExhaustedError,
    SandboxSpec,
    UnauthenticatedError,
    UnavailableError,
)
from libdsec._connect import _error_from_body
from libdsec.errors import error_for
from libdsec.models import b64decode, format_duration, parse_duration, parse_timestamp


def test_spec_to_json_uses_proto3_json_names():
    spec = SandboxSpec(
        backend=BackendKind.CONTAINER,
        base_image="busybox:latest",
        workspace="ws:1",
        toolkits=["py:3", "git:2"],
        resources={"cpu": 1.5, "mem_mb": 512, "pids": 64},
        labels={"job": "j1"},
        ttl_s=30,
        idle_timeout_s=0.25,
        env={"A": "1"},
    )
    assert spec.to_json() == {
        "backend": "container",
        "image": "busybox:latest",
        "workspace": "ws:1",
        "toolkits": ["py:3", "git:2"],
        "resources": {"milliCpu": "1500", "memoryBytes": str(512 * 1024 * 1024), "pids": "64"},
        "labels": {"job": "j1"},
        "ttl": "30s",
        "idleTimeout": "0.25s",
        "env": ["A=1"],
    }


def test_spec_defaults_omit_unset_fields():
    assert SandboxSpec(base_image="x:y").to_json() == {"backend": "container", "image": "x:y"}


def test_spec_round_trips_through_json():
    spec = SandboxSpec(base_image="a:b", resources={"cpu": 2, "mem_mb": 256}, labels={"k": "v"}, ttl_s=60)
    back = SandboxSpec.from_json(spec.to_json())
    assert back.base_image == "a:b"
    assert back.backend is BackendKind.CONTAINER
    assert back.resources == {"cpu": 2.0, "mem_mb": 256.0}
    assert back.labels == {"k": "v"}
    assert back.ttl_s == 60.0


def test_spec_rejects_unknown_resource():
    with pytest.raises(ValueError, match="memory"):
        SandboxSpec(base_image="a:b", resources={"memory": 1}).to_json()


def test_spec_rejects_malformed_env():
    with pytest.raises(ValueError, match="NOEQUALS"):
        SandboxSpec(base_image="a:b", env=["NOEQUALS"]).to_json()


@pytest.mark.parametrize(
    "seconds,text",
    [(0, "0s"), (30, "30s"), (1.5, "1.5s"), (0.000000001, "0.000000001s"), (60.0, "60s")],
)
def test_duration_format_and_parse(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_duration_rejects_negative_and_non_numbers():
    with pytest.raises(ValueError):
        format_duration(-1)
    with pytest.raises(TypeError):
        format_duration("5")
    with pytest.raises(ValueError):
        parse_duration("5m")


def test_timestamp_keeps_microseconds_of_nanosecond_text():
    got = parse_timestamp("2026-01-02T03:04:05.123456789Z")
    assert got == datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc)
    assert parse_timestamp("2026-01-02T03:04:05Z") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert parse_timestamp(None) is None


def test_bytes_decode_accepts_both_base64_alphabets_unpadded():
    assert b64decode("_-8") == b"\xff\xef"
    assert b64decode("/+8=") == b"\xff\xef"
    assert b64decode(None) == b""


def test_exec_result_decodes_and_replaces_invalid_utf8():
    r = ExecResult.from_json({"outcome": "failed", "exitCode": 2, "stdout": "aGk/", "stderr": "/w==", "duration": "0.5s"})
    assert r.exit_code == 2
    assert r.stdout == "hi?"
    assert r.stderr == "\ufffd"
    assert r.stderr_bytes == b"\xff"
    assert r.duration == 0.5
    assert r.outcome == "failed" and not r.ok
    assert r.infra_error is None


def test_exec_result_defaults_when_server_omits_fields():
    r = ExecResult.from_json({"outcome": "ok"})
    assert (r.exit_code, r.stdout, r.stderr, r.duration, r.timed_out, r.infra_error) == (0, "", "", 0.0, False, None)
    assert r.ok
    # An old server without outcome: derived from the other fields.
    assert ExecResult.from_json({"timedOut": True}).outcome == "timeout"
    assert ExecResult.from_json({"exitCode": 1}).outcome == "failed"


def test_exec_result_infra_error_is_truthy_and_exit_code_negative():
    r = ExecResult.from_json({"outcome": "infra_error"})
    assert r.infra_error
    assert r.exit_code == -1
    r = ExecResult.from_json({"outcome": "infra_error", "infraError": "node n2 stopped heartbeating"})
    assert r.infra_error == "node n2 stopped heartbeating"


@pytest.mark.parametrize(
    "code,cls",
    [("not_found", NotFoundError), ("resource_exhausted", ResourceExhaustedError), ("unauthenticated", UnauthenticatedError)],
)
def test_error_for_maps_codes(code, cls):
    e = error_for(code, "sandbox x not found")
    assert isinstance(e, cls) and isinstance(e, DSecError)
    assert e.code == code


def test_error_body_parsing():
    e = _error_from_body("M", 404, b'{"code":"not_found","message":"image \\"x:y\\" not found"}')
    assert isinstance(e, NotFoundError)
    assert 'image "x:y" not found' in str(e)
    # No Connect body (a proxy answered): the HTTP status decides.
    e = _error_from_body("M", 503, b"<html>bad gateway</html>")
    assert isinstance(e, UnavailableError) and e.http_status == 503
    assert error_for(None, "x", 418).code == "unknown"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_server_raises_unavailable_but_exec_reports_infra_error(monkeypatch):
    # A handle's operations are re-sent for a while first; keep that short.
    monkeypatch.setattr("libdsec.client._RESEND_BUDGET_S", 0.3)
    async with await DSecClient.create(endpoint=f"http://127.0.0.1:{_closed_port()}", token="t") as client:
        with pytest.raises(UnavailableError):
            await client.get("n1-0123456789abcdef")
        sb = client.sandbox("n1-0123456789abcdef")
        out = await sb.run("echo hi", timeout=5)
        assert out.outcome == "infra_error" and out.seq == 1
        assert out.infra_error and "unavailable" in out.infra_error
        assert out.exit_code == -1
        assert await sb.is_alive() is False


async def test_default_endpoint_and_token_come_from_environment(monkeypatch):
    monkeypatch.setenv("DSEC_ENDPOINT", "http://10.1.2.3:9999/")
    monkeypatch.setenv("DSEC_TOKEN", "tok\n")
    client = await DSecClient.create()
    try:
        assert client.endpoint == "http://10.1.2.3:9999"
        assert client._t.http.headers["Authorization"] == "Bearer tok"
    finally:
        await client.close()


def test_input_events_and_screenshot_wire():
    from libdsec import InputEvent, Screenshot

    assert InputEvent.text("ls").to_json() == {"kind": "text", "text": "ls"}
    assert InputEvent.key("ctrl-c").to_json() == {"kind": "key", "key": "ctrl-c"}
    assert InputEvent.move(0, 7).to_json() == {"kind": "move", "x": 0, "y": 7}
    assert InputEvent.click(3, 4, "right").to_json() == {"kind": "click", "x": 3, "y": 4, "button": "right"}
    shot = Screenshot.from_json({"png": "iVBORw0KGgo", "width": 640, "height": 480})
    assert shot.png == b"\x89PNG\r\n\x1a\n" and (shot.width, shot.height) == (640, 480)


def test_network_rules_wire():
    from libdsec import SandboxSpec

    spec = SandboxSpec(base_image="busybox:latest", network_rules={"pypi": True, "npm": False, "*.example.org": True})
    assert spec.to_json()["network"] == {"allow": ["pypi", "*.example.org"], "deny": ["npm"]}
    back = SandboxSpec.from_json(spec.to_json())
    assert back.network_rules == {"pypi": True, "*.example.org": True, "npm": False}
    assert "network" not in SandboxSpec(base_image="busybox:latest").to_json()
