"""Real asset servers on 127.0.0.1 for the remote-input tests (https with a self-signed
certificate made by the ``openssl`` CLI, or plain http), with routes that misbehave on purpose.

Routes, for an asset NAME registered with ``add``:
  /a/NAME              the asset; needs ``Authorization: Bearer <token>`` if the server has one
  /mismatch/NAME       same size, different bytes
  /truncated/NAME      announces the full Content-Length, sends half, closes
  /drop/NAME           no Content-Length, sends half, then resets the connection
  /flaky-drop/NAME     resets mid-body on the first request, serves the asset afterwards
  /flaky503/NAME       503 on the first request, serves the asset afterwards
  /longer/NAME         the asset plus extra bytes, no Content-Length
  /redirect-same/NAME  302 to /a/NAME on the same origin
  /redirect-other/NAME 302 to ``redirect_target + /a/NAME`` (another origin)
Every request is recorded (method, path, Authorization header) in ``requests``.
"""

from __future__ import annotations

import socket
import ssl
import struct
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1/localhost (cert.pem doubles as the CA bundle)."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


class AssetServer:
    def __init__(self, *, token: str | None = None, tls: tuple[Path, Path] | None = None):
        self.token = token
        self.assets: dict[str, bytes] = {}
        self.requests: list[dict] = []
        self.redirect_target: str | None = None
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        handler = self._handler_class()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.origin = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def add(self, name: str, data: bytes) -> None:
        self.assets[name] = data

    def url(self, route: str, name: str) -> str:
        return f"{self.origin}/{route}/{name}"

    def paths(self) -> list[str]:
        with self._lock:
            return [r["path"] for r in self.requests]

    def first_time(self, key: str) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None):
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _reset(self):
                # SO_LINGER 0: close() sends a TCP reset, i.e. the connection drops mid-file.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                try:
                    self.connection.close()
                except OSError:
                    pass

            def finish(self):
                try:
                    super().finish()
                except (OSError, ValueError):
                    pass

            def do_GET(self):
                with server._lock:
                    server.requests.append(
                        {"path": self.path, "authorization": self.headers.get("Authorization")}
                    )
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[1] not in server.assets:
                    return self._send(404, b"no such asset")
                route, name = parts
                data = server.assets[name]
                if server.token is not None and route != "redirect-other":
                    given = self.headers.get("Authorization")
                    if given is None:
                        return self._send(401, b"bearer token required")
                    if given != f"Bearer {server.token}":
                        return self._send(403, b"bearer token rejected")
                half = data[: len(data) // 2]
                if route == "a" or (route.startswith("flaky") and not server.first_time(route)):
                    return self._send(200, data)
                if route == "flaky503":
                    return self._send(503, b"try again")
                if route == "mismatch":
                    return self._send(200, bytes(b ^ 0xFF for b in data))
                if route == "truncated":
                    self._send(200, half, {"Content-Length": str(len(data))})
                    self.close_connection = True
                    return None
                if route in ("drop", "flaky-drop"):
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(half)
                    self.wfile.flush()
                    return self._reset()
                if route == "longer":
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(data + b"and some more")
                    self.close_connection = True
                    return None
                if route == "redirect-same":
                    return self._send(302, b"", {"Location": f"/a/{name}"})
                if route == "redirect-other":
                    return self._send(302, b"", {"Location": f"{server.redirect_target}/a/{name}"})
                return self._send(404, b"no such route")

        return Handler
