"""The Connect protocol over httpx: unary calls as plain JSON POSTs and
server streams as enveloped JSON messages.

Kept apart from the client so the API methods read as calls, and so every
transport failure is turned into a :class:`~libdsec.errors.DSecError` in
one place.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from typing import Any, AsyncIterator, Dict, Optional, Union

import httpx

from ._http1 import TARGET, Http1Transport
from .errors import DSecError, DeadlineExceededError, UnavailableError, error_for, parse_retry_after

_UNSET: Any = object()
_ENVELOPE = struct.Struct(">BI")
_FLAG_COMPRESSED = 0x01
_FLAG_END_STREAM = 0x02

TimeoutArg = Union[float, None, Any]


class Transport:
    """One pooled HTTP/1.1 connection set to a DSec endpoint."""

    def __init__(
        self,
        endpoint: str,
        token: Optional[str],
        *,
        max_connections: int,
        timeout: Optional[float],
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ):
        self.endpoint = endpoint.rstrip("/")
        self.default_timeout = timeout
        headers = {"Connect-Protocol-Version": "1", "User-Agent": "libdsec-python"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # HTTP/1.1 with a large pool: hundreds of requests in flight each
        # get their own connection, and keep-alive reuses them across calls.
        # Plain http:// goes through the lean transport (see _http1); TLS,
        # proxies and Pythons without asyncio.timeout through httpcore.
        # A caller-supplied transport (tests, instrumentation) replaces both.
        kwargs: Dict[str, Any] = {}
        # _direct: the lean transport, to which requests go straight (see _send).
        self._direct: Optional[Http1Transport] = None
        if transport is not None:
            kwargs["transport"] = transport
        elif (
            self.endpoint.startswith("http://")
            and hasattr(asyncio, "timeout")
            and os.environ.get("DSEC_HTTP_TRANSPORT", "") != "httpcore"
        ):
            self._direct = kwargs["transport"] = Http1Transport(max_connections)
        self._timeout = httpx.Timeout(timeout, connect=30.0, pool=None)
        self.http = httpx.AsyncClient(
            http2=False,
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=self._timeout,
            **kwargs,
        )
        self._headers = self.http.headers.copy()
        self._urls: Dict[str, Any] = {}  # method -> (URL, Host header, TARGET)

    async def close(self) -> None:
        await self.http.aclose()

    async def unary(self, method: str, body: Dict[str, Any], *, timeout: TimeoutArg = _UNSET) -> Dict[str, Any]:
        """Calls "/<service>/<method>" with a JSON body and returns the decoded response."""
        http_timeout = None if timeout is _UNSET else httpx.Timeout(timeout, connect=30.0, pool=None)
        headers = {"Content-Type": "application/json"}
        # Tell the server when this client gives up, so that a call waiting
        # in its admission queue (capacity exhausted) waits no longer. A
        # little before: the server's own answer (what it ran out of) is
        # worth more than a read timeout that races it.
        limit = self.default_timeout if timeout is _UNSET else timeout
        if limit is not None and limit > 0:
            headers["Connect-Timeout-Ms"] = str(max(1, int((limit - min(1.0, limit / 10)) * 1000)))
        try:
            resp = await self._send(method, json.dumps(body, separators=(",", ":")).encode(), headers, http_timeout)
            await resp.aread()
        except httpx.TimeoutException as e:
            raise _in_transit(DeadlineExceededError(f"{method}: no answer from {self.endpoint} in time ({type(e).__name__})")) from e
        except httpx.TransportError as e:
            raise _in_transit(UnavailableError(f"{method}: cannot reach {self.endpoint}: {e or type(e).__name__}")) from e
        if resp.status_code != 200:
            raise _error_from_body(method, resp.status_code, resp.content, resp.headers)
        try:
            return json.loads(resp.content) if resp.content else {}
        except ValueError as e:
            raise error_for("internal", f"{method}: response is not JSON: {e}", resp.status_code) from e

    async def _send(
        self, method: str, content: bytes, headers: Dict[str, str], timeout: Optional[httpx.Timeout]
    ) -> httpx.Response:
        """POSTs to "/<service>/<method>" and returns the response with its
        body not yet read; the caller reads it to the end or closes it.

        With the lean transport the request goes straight to it: the
        AsyncClient's per-request pipeline (URL merging and parsing,
        cookies, auth and redirect hooks, none of which the SDK uses) cost
        more CPU than the HTTP exchange itself, about 200 of 350 us per call
        (httpx 0.23 re-parses the URL on every property access), and a
        trainer's Python thread is what issues thousands of calls a second.
        """
        if self._direct is None:
            req = self.http.build_request(
                "POST", f"{self.endpoint}/{method}", content=content, headers=headers, **({"timeout": timeout} if timeout else {})
            )
            return await self.http.send(req, stream=True)
        dest = self._urls.get(method)
        if dest is None:
            url = httpx.URL(f"{self.endpoint}/{method}")
            dest = self._urls[method] = (url, url.netloc, (url.host, url.port or 80, url.raw_path))
        url, host, target = dest
        h = self._headers.copy()
        h.update(headers)
        h["Host"] = host.decode("ascii")
        ext = {"timeout": (timeout or self._timeout).as_dict(), TARGET: target}
        return await self._direct.handle_async_request(httpx.Request("POST", url, headers=h, content=content, extensions=ext))

    async def server_stream(
        self, method: str, body: Dict[str, Any], *, timeout: TimeoutArg = _UNSET
    ) -> AsyncIterator[Dict[str, Any]]:
        """Calls a server-streaming method and yields each response message."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        http_timeout = None if timeout is _UNSET else httpx.Timeout(timeout, connect=30.0, pool=None)
        try:
            async with _closing(
                await self._send(
                    method, _ENVELOPE.pack(0, len(payload)) + payload, {"Content-Type": "application/connect+json"}, http_timeout
                )
            ) as resp:
                if resp.status_code != 200:
                    raise _error_from_body(method, resp.status_code, await resp.aread(), resp.headers)
                buf = bytearray()
                ended = False
                async for chunk in resp.aiter_bytes():
                    if ended:
                        # Read on to the end of the body (the server ends it
                        # right after the end-of-stream message) so that the
                        # connection goes back to the pool: leaving it
                        # mid-body closes it and the next call connects anew.
                        continue
                    buf += chunk
                    while len(buf) >= _ENVELOPE.size:
                        flags, size = _ENVELOPE.unpack_from(buf)
                        if len(buf) < _ENVELOPE.size + size:
                            break
                        data = bytes(buf[_ENVELOPE.size : _ENVELOPE.size + size])
                        del buf[: _ENVELOPE.size + size]
                        if flags & _FLAG_COMPRESSED:
                            raise error_for("internal", f"{method}: server sent a compressed message; none was negotiated")
                        msg = json.loads(data) if data else {}
                        if flags & _FLAG_END_STREAM:
                            ended = True
                            end = msg
                            break
                        yield msg
                if ended:
                    err = end.get("error")
                    if err:
                        raise error_for(
                            err.get("code"),
                            f"{method}: {err.get('message', '')}",
                            200,
                            retry_after=_retry_after_meta(end.get("metadata")),
                        )
                    return
                raise _in_transit(
                    UnavailableError(f"{method}: stream from {self.endpoint} ended without an end-of-stream message")
                )
        except httpx.TimeoutException as e:
            raise _in_transit(DeadlineExceededError(f"{method}: no answer from {self.endpoint} in time ({type(e).__name__})")) from e
        except httpx.TransportError as e:
            raise _in_transit(UnavailableError(f"{method}: connection to {self.endpoint} failed: {e or type(e).__name__}")) from e


class _closing:
    """Closes a streamed response on the way out, read to its end or not."""

    def __init__(self, resp: httpx.Response):
        self.resp = resp

    async def __aenter__(self) -> httpx.Response:
        return self.resp

    async def __aexit__(self, *exc) -> None:
        await self.resp.aclose()


def _in_transit(e: DSecError) -> DSecError:
    """Marks an error as a failure in transit (see DSecError.transport_failure)."""
    e.transport_failure = True
    return e


def _retry_after_meta(metadata: Any) -> Optional[float]:
    """The Retry-After hint of a stream's end message (trailers as lists)."""
    if not isinstance(metadata, dict):
        return None
    for key, values in metadata.items():
        if key.lower() == "retry-after" and values:
            return parse_retry_after(values[0] if isinstance(values, list) else str(values))
    return None


def _error_from_body(method: str, status: int, content: bytes, headers: Optional[httpx.Headers] = None) -> DSecError:
    code = None
    message = ""
    try:
        body = json.loads(content)
        if isinstance(body, dict):
            code = body.get("code")
            message = body.get("message", "")
    except ValueError:
        message = content[:200].decode("utf-8", errors="replace")
    if not message:
        message = f"HTTP {status}"
    retry_after = parse_retry_after(headers.get("retry-after")) if headers is not None else None
    return error_for(code, f"{method}: {message}", status, retry_after=retry_after)
