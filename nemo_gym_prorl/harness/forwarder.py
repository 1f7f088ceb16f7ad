"""The loopback forwarder a sandbox runs for its model proxy: 127.0.0.1:PORT in the sandbox's own network
namespace, each connection piped to the proxy's Unix socket (its directory bound into the sandbox). A harness's
``OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`` reaches the proxy and nothing else.

The proxy copies this file into the sandbox, whose python3 may be any 3.8+ (the image's Debian 3.11, the host's):
standard library only, nothing of our package. Once it listens it tells the proxy (``POST READY_PATH``), so the
harness starts only after; it runs until it is killed (the proxy's close, the sandbox's end).

    python3 forwarder.py SOCKET PORT
"""

import asyncio
import sys

READY_PATH = "/_prorl/forwarder-ready"
_CHUNK = 65536


async def _pipe(reader, writer, other):
    """Copy until EOF, then half-close (the other side may still answer); an error ends both sides."""
    try:
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()
        other.close()


async def _forward(socket_path, client_reader, client_writer):
    try:
        proxy_reader, proxy_writer = await asyncio.open_unix_connection(socket_path)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(
        _pipe(client_reader, proxy_writer, client_writer), _pipe(proxy_reader, client_writer, proxy_writer)
    )
    proxy_writer.close()
    client_writer.close()


async def _announce(socket_path):
    reader, writer = await asyncio.open_unix_connection(socket_path)
    request = f"POST {READY_PATH} HTTP/1.1\r\nHost: proxy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    writer.write(request.encode())
    await writer.drain()
    status = await reader.readline()
    writer.close()
    if status.split()[1:2] != [b"200"]:
        raise SystemExit(f"forwarder: the model proxy refused the announcement: {status!r}")


async def main(socket_path, port):
    server = await asyncio.start_server(lambda r, w: _forward(socket_path, r, w), "127.0.0.1", port)
    await _announce(socket_path)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        raise SystemExit("usage: python3 forwarder.py SOCKET PORT")
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
