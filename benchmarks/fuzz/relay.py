"""A TCP relay that counts the bytes a server takes off the wire: the evidence that a server refuses a request
without reading its body (tests/test_grpc_security.py)."""

import socket
import threading

CHUNK = 64 * 1024
"""Bytes forwarded at a time; the relay's socket buffers are as small, so its count runs at most a few chunks
ahead of what the server has accepted (a server that stops reading stops the relay)."""


class CountingRelay:
    """Relays every connection to 127.0.0.1:`port`; `to_server` counts the bytes passed on to the server."""

    def __init__(self, port: int):
        self._target = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.to_server = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> "CountingRelay":
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._listener.close()
        for s in self._sockets:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed by __exit__
                return
            server = socket.socket()
            for s in (client, server):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CHUNK)
            server.connect(self._target)
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), name="relay-up", daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), name="relay-down", daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(CHUNK):
                sink.sendall(data)
                if counted:
                    with self._lock:
                        self.to_server += len(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # either side closed
            return
