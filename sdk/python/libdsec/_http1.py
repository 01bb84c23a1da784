"""A lean HTTP/1.1 keep-alive transport for httpx over asyncio streams.

httpx's default transport (httpcore on anyio) spends ~1.2 ms of CPU per
request on this kind of machine; a trainer creating, running and destroying
hundreds of sandboxes a second issues thousands of small requests a second,
so that alone would use a whole core. This transport keeps httpx's client
API (requests, responses, timeouts, errors) and does the wire work directly:
one write per request, a pooled connection per concurrent request, bodies
framed by Content-Length or chunked encoding. It serves plain ``http://``
only; everything else (TLS, proxies) goes through httpx's own transport.
"""

from __future__ import annotations

import asyncio
import time
from typing import Dict, List, Optional, Tuple

import httpx

# An idle connection older than this is not reused: servers close idle
# keep-alive connections eventually, and a request written into a socket
# the server is closing fails.
_MAX_IDLE_S = 30.0
_MAX_HEAD = 64 * 1024

# A request extension naming the request's (host, port, raw path), for
# callers that send many requests to a few URLs: httpx 0.23 re-parses the
# URL on each property access, tens of microseconds a request.
TARGET = "libdsec.target"


class _Conn:
    __slots__ = ("reader", "writer", "idle_since", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        self.reused = False

    def usable(self) -> bool:
        return (
            not self.reader.at_eof()
            and not self.writer.is_closing()
            and time.monotonic() - self.idle_since < _MAX_IDLE_S
        )

    def close(self) -> None:
        self.writer.close()


class Http1Transport(httpx.AsyncBaseTransport):
    """Pools up to ``max_connections`` HTTP/1.1 connections per host."""

    def __init__(self, max_connections: int):
        self._max = max_connections
        self._idle: Dict[Tuple[str, int], List[_Conn]] = {}
        self._slots: Optional[asyncio.Semaphore] = None
        # Connections opened so far: with keep-alive working, this stays at
        # the most requests ever in flight at once.
        self.connections_opened = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = request.extensions.get(TARGET)
        if target is None:
            if request.url.scheme != "http":
                raise httpx.UnsupportedProtocol(f"Http1Transport serves http:// only, not {request.url.scheme}://", request=request)
            target = (request.url.host, request.url.port or 80, request.url.raw_path)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max)
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        head = _encode_head(request, target[2], len(body))
        payload = head + body if len(body) < 65536 else None

        key = (target[0], target[1])
        await self._slots.acquire()
        try:
            # A reused connection the server had closed fails before any
            # response byte; that request never reached the server, so it
            # is safe to send again on a fresh connection (once).
            for attempt in (0, 1):
                conn = await self._get(key, timeouts.get("connect"), request)
                try:
                    if payload is not None:
                        conn.writer.write(payload)
                    else:
                        conn.writer.write(head)
                        conn.writer.write(body)
                    await _with_timeout(conn.writer.drain(), timeouts.get("write"), httpx.WriteTimeout, request)
                    status, headers, raw_head = await _with_timeout(
                        _read_head(conn.reader), timeouts.get("read"), httpx.ReadTimeout, request
                    )
                except (ConnectionError, asyncio.IncompleteReadError, _NoResponse) as e:
                    conn.close()
                    if conn.reused and attempt == 0 and _nothing_received(e):
                        continue
                    if isinstance(e, (asyncio.IncompleteReadError, _NoResponse)):
                        raise httpx.RemoteProtocolError(f"server closed the connection: {e}", request=request) from e
                    raise httpx.ReadError(str(e) or type(e).__name__, request=request) from e
                except BaseException:
                    conn.close()
                    raise
                break
        except BaseException:
            self._slots.release()
            raise
        stream = _BodyStream(self, key, conn, headers, timeouts.get("read"), request)
        return httpx.Response(status, headers=raw_head, stream=stream, extensions={"http_version": b"HTTP/1.1"})

    async def _get(self, key: Tuple[str, int], connect_timeout: Optional[float], request: httpx.Request) -> _Conn:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        try:
            reader, writer = await _with_timeout(
                asyncio.open_connection(key[0], key[1], limit=_MAX_HEAD), connect_timeout, httpx.ConnectTimeout, request
            )
        except OSError as e:
            raise httpx.ConnectError(str(e) or type(e).__name__, request=request) from e
        self.connections_opened += 1
        return _Conn(reader, writer)

    def _release(self, key: Tuple[str, int], conn: Optional[_Conn]) -> None:
        if conn is not None:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(key, []).append(conn)
        if self._slots is not None:
            self._slots.release()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()


class _NoResponse(Exception):
    """The connection ended before a complete response head arrived."""

    def __init__(self, got: bytes):
        super().__init__(f"{len(got)} bytes of response head before the connection closed")
        self.got = got


def _nothing_received(e: BaseException) -> bool:
    if isinstance(e, _NoResponse):
        return not e.got
    if isinstance(e, asyncio.IncompleteReadError):
        return not e.partial
    return isinstance(e, (ConnectionResetError, BrokenPipeError))


def _encode_head(request: httpx.Request, target: bytes, length: int) -> bytes:
    lines = [request.method.encode("ascii") + b" " + target + b" HTTP/1.1"]
    has_length = False
    for k, v in request.headers.raw:
        lk = k.lower()
        if lk == b"content-length":
            has_length = True
            v = str(length).encode()
        elif lk == b"transfer-encoding":
            continue  # the body was read whole; send it with a length
        lines.append(k + b": " + v)
    if not has_length:
        lines.append(b"Content-Length: " + str(length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _read_head(reader: asyncio.StreamReader):
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        raise _NoResponse(e.partial) from e
    except asyncio.LimitOverrunError as e:
        raise httpx.RemoteProtocolError(f"response head longer than {_MAX_HEAD} bytes") from e
    lines = raw[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}")
    status = int(parts[1])
    headers: Dict[bytes, bytes] = {}
    raw_head: List[Tuple[bytes, bytes]] = []
    for line in lines[1:]:
        k, sep, v = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError(f"malformed header line {line[:100]!r}")
        k, v = k.strip(), v.strip()
        raw_head.append((k, v))
        headers[k.lower()] = v
    if status == 100:
        return await _read_head(reader)
    return status, headers, raw_head


async def _with_timeout(aw, seconds: Optional[float], exc: type, request: httpx.Request):
    if seconds is None:
        return await aw
    try:
        async with asyncio.timeout(seconds):
            return await aw
    except TimeoutError as e:
        raise exc(f"timed out after {seconds}s", request=request) from e


class _BodyStream(httpx.AsyncByteStream):
    """The response body; the connection returns to the pool once it is read to the end."""

    def __init__(self, transport: Http1Transport, key, conn: _Conn, headers: Dict[bytes, bytes], timeout, request):
        self._t = transport
        self._key = key
        self._conn: Optional[_Conn] = conn
        self._timeout = timeout
        self._request = request
        self._reusable = headers.get(b"connection", b"").lower() != b"close"
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self._mode, self._left = "chunked", 0
        elif b"content-length" in headers:
            self._mode, self._left = "length", int(headers[b"content-length"])
        else:
            self._mode, self._left, self._reusable = "close", 0, False
        self._done = False

    async def __aiter__(self):
        try:
            async for chunk in self._chunks():
                yield chunk
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            self._fail()
            raise httpx.ReadError(f"reading response body: {e or type(e).__name__}", request=self._request) from e
        except BaseException:
            self._fail()
            raise
        self._done = True
        self._finish()

    async def _chunks(self):
        r = self._conn.reader
        if self._mode == "length":
            if self._left:
                yield await _with_timeout(r.readexactly(self._left), self._timeout, httpx.ReadTimeout, self._request)
        elif self._mode == "chunked":
            while True:
                line = await _with_timeout(r.readuntil(b"\r\n"), self._timeout, httpx.ReadTimeout, self._request)
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    # Trailers, if any, end with an empty line.
                    while (await _with_timeout(r.readuntil(b"\r\n"), self._timeout, httpx.ReadTimeout, self._request)) != b"\r\n":
                        pass
                    return
                data = await _with_timeout(r.readexactly(size + 2), self._timeout, httpx.ReadTimeout, self._request)
                yield data[:-2]
        else:
            while True:
                data = await _with_timeout(r.read(65536), self._timeout, httpx.ReadTimeout, self._request)
                if not data:
                    return
                yield data

    def _fail(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._t._release(self._key, None)

    def _finish(self) -> None:
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        if self._reusable:
            self._t._release(self._key, conn)
        else:
            conn.close()
            self._t._release(self._key, None)

    async def aclose(self) -> None:
        # Closed before the end (e.g. a stream the caller stopped reading):
        # the connection is mid-response and cannot be reused.
        if not self._done:
            self._fail()
