"""A TCP gate in front of a server, for fault injection (``services.cli.chaos``, the chaos tests). Open, it forwards every connection to the
server; closed, nothing listens on its port (new connections are refused) and every open
connection is cut, as when the server stops, while the server behind it keeps its data."""

from __future__ import annotations

import socket
import threading

from services.cli.local_stack import free_port


class TcpGate:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def open(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the port again after close()
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-gate").start()

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            cut, self._open = self._open, set()
        for sock in cut:
            _shut(sock)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:
                _shut(client)
                continue
            with self._lock:
                if self._listener is not listener:  # closed meanwhile
                    _shut(client)
                    _shut(server)
                    continue
                self._open |= {client, server}
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                _shut(sock)
                with self._lock:
                    self._open.discard(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
