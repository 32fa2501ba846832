"""An HTTP proxy in front of a real S3 server (moto) that answers every request with an S3
error while a fault is set: a full disk (507 ``XMinioStorageFull``), ``SlowDown`` (503), a
500. moto keeps its objects in memory, so its own disk cannot fill: this is how the S3 path
meets those answers here. Otherwise requests pass through unchanged."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = {
    "storage_full": (507, "XMinioStorageFull", "Storage backend has reached its minimum free drive threshold."),
    "slow_down": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error, please try again."),
}


class S3FaultProxy:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.fault: str | None = None
        self.refused = 0  # requests answered with the fault
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.fault is not None:
                    proxy.refused += 1
                    status, code, message = FAULTS[proxy.fault]
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
                           f"<Resource>{self.path}</Resource><RequestId>fault</RequestId></Error>").encode()
                    self._reply(status, {"Content-Type": "application/xml"}, xml)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=60)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        upstream.putheader(name, value)
                    upstream.endheaders(body)
                    response = upstream.getresponse()
                    data = response.read()
                    headers = {k: v for k, v in response.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
                    self._reply(response.status, headers, data)
                finally:
                    upstream.close()

            def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="s3-fault-proxy").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
