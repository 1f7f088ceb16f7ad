"""The viewer app served by uvicorn on a thread of its own, for code that goes on meanwhile (a benchmark driving a
browser, a test)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


@contextmanager
def serving_in_thread(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """The app's URL while the block runs, on a free port; the server is stopped on the way out."""
    sock = socket.create_server((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), name="viewer-server")
    thread.start()
    try:
        yield f"http://{host}:{sock.getsockname()[1]}/"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
