"""The tests' servers on localhost: a socket server served from a daemon thread until `close`, with an
event (`stopping`) that a handler holding back its answer waits on, so that it ends with the test."""

from __future__ import annotations

import socketserver
import threading


class LocalServer:
    """Subclasses build their handler, then `serve` it; `url` is then the server's address + path."""

    def __init__(self) -> None:
        self.stopping = threading.Event()

    def serve(self, server: socketserver.BaseServer, path: str) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}{path}"
        self.thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
