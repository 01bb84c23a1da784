"""The lean HTTP/1.1 transport against a real asyncio socket server that
answers with each body framing and closes connections the way servers do."""

import asyncio

import httpx
import pytest

from libdsec._http1 import Http1Transport


class Server:
    """Answers each request with the next canned response; records requests."""

    def __init__(self, responses, close_after_each=False):
        self.responses = list(responses)
        self.close_after_each = close_after_each
        self.requests = []
        self.connections = 0

    async def handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                resp = self.responses.pop(0)
                writer.write(resp)
                await writer.drain()
                head_only = resp.split(b"\r\n\r\n", 1)[0].lower()
                delimited_by_close = b"content-length" not in head_only and b"chunked" not in head_only
                if self.close_after_each or delimited_by_close:
                    return
        finally:
            writer.close()

    async def __aenter__(self):
        self.srv = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.srv.close()
        await self.srv.wait_closed()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_body_framings_and_keepalive():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nTrailer: x\r\n\r\n"
    async with Server([ok(b"first"), chunked, ok(b""), b"HTTP/1.1 201 Created\r\n\r\nuntil-close"]) as srv:
        async with httpx.AsyncClient(transport=Http1Transport(4)) as client:
            r = await client.post(srv.url + "/a/b?q=1", content=b'{"x":1}', headers={"X-Test": "yes"})
            assert (r.status_code, r.content) == (200, b"first")
            r = await client.post(srv.url + "/c", content=b"")
            assert r.content == b"abcdefg"
            r = await client.post(srv.url + "/d", content=b"z")
            assert r.content == b""
            r = await client.post(srv.url + "/e", content=b"z")
            assert (r.status_code, r.content) == (201, b"until-close")
        head, body = srv.requests[0]
        assert head.startswith(b"POST /a/b?q=1 HTTP/1.1\r\n")
        assert b"X-Test: yes" in head and b"Content-Length: 7" in head
        assert body == b'{"x":1}'
        # Four requests in sequence share one keep-alive connection.
        assert srv.connections == 1


async def test_reused_connection_closed_by_server_is_retried_once():
    async with Server([ok(b"1"), ok(b"2"), ok(b"3")], close_after_each=True) as srv:
        async with httpx.AsyncClient(transport=Http1Transport(4)) as client:
            for want in (b"1", b"2", b"3"):
                r = await client.post(srv.url + "/x", content=b"")
                assert r.content == want
        assert len(srv.requests) == 3
        assert srv.connections == 3


async def test_concurrent_requests_use_separate_connections_within_the_limit():
    async with Server([ok(b"%d" % i) for i in range(20)]) as srv:
        transport = Http1Transport(3)
        async with httpx.AsyncClient(transport=transport) as client:
            rs = await asyncio.gather(*(client.post(srv.url + "/x", content=b"") for _ in range(20)))
            assert sorted(int(r.content) for r in rs) == list(range(20))
        assert 1 <= srv.connections <= 3


async def test_streamed_response_is_read_incrementally():
    async with Server([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n2\r\ncd\r\n0\r\n\r\n", ok(b"next")]) as srv:
        async with httpx.AsyncClient(transport=Http1Transport(2)) as client:
            async with client.stream("POST", srv.url + "/s", content=b"") as r:
                got = [c async for c in r.aiter_raw()]
            assert got == [b"ab", b"cd"]
            assert (await client.post(srv.url + "/n", content=b"")).content == b"next"
        assert srv.connections == 1


async def test_errors_are_httpx_errors():
    async with Server([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"], close_after_each=True) as srv:
        async with httpx.AsyncClient(transport=Http1Transport(2)) as client:
            with pytest.raises(httpx.ReadError):
                await client.post(srv.url + "/x", content=b"")
            port = srv.url.rsplit(":", 1)[1]
    # The server is gone now: nothing listens on its port.
    async with httpx.AsyncClient(transport=Http1Transport(2)) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{port}/x", content=b"")


async def test_read_timeout():
    async def silent(reader, writer):
        await reader.read()  # never answers; returns when the client goes away
        writer.close()

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/x"
        async with httpx.AsyncClient(transport=Http1Transport(2)) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url, content=b"", timeout=httpx.Timeout(5.0, read=0.05))
    finally:
        srv.close()
        await srv.wait_closed()


async def test_sdk_calls_go_straight_to_the_lean_transport():
    """The SDK hands its requests to the lean transport itself (not through
    httpx.AsyncClient's pipeline): the request line, headers and body the
    server gets, keep-alive, a server error and the client's timeout all
    behave as through the client."""
    from libdsec import DeadlineExceededError, DSecClient, NotFoundError

    body = b'{"sandboxes":[]}'
    err = b'{"code":"not_found","message":"sandbox \\"x\\" not found"}'
    responses = [ok(body), b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(err), err)]
    async with Server(responses) as srv:
        client = await DSecClient.create(endpoint=srv.url, token="tok")
        # A request hook of the AsyncClient would run on every request that
        # went through its pipeline: none may.
        through_client = []
        client._t.http.event_hooks = {"request": [lambda r: through_client.append(r)], "response": []}
        async with client:
            assert await client.list() == []
            with pytest.raises(NotFoundError, match='sandbox "x" not found'):
                await client.get("x")
        assert through_client == []
        head, sent = srv.requests[0]
        assert head.startswith(b"POST /dsec.v1.SandboxService/List HTTP/1.1\r\n")
        assert b"\r\nAuthorization: Bearer tok\r\n" in head and b"\r\nContent-Type: application/json\r\n" in head
        assert b"\r\nHost: 127.0.0.1:" in head and sent == b"{}"
        assert srv.connections == 1

    async def silent(reader, writer):
        await reader.read()
        writer.close()

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        async with await DSecClient.create(endpoint=url, token="t", timeout=0.1) as client:
            with pytest.raises(DeadlineExceededError) as e:
                await client.list()
            assert e.value.transport_failure
    finally:
        srv.close()
        await srv.wait_closed()
