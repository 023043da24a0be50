"""Hostile peers for the security tests: real HTTP servers that an attacker would point an
engine at (a bootstrap server that records who asks it, one that answers a byte at a time,
one whose answer never ends)."""

from __future__ import annotations

import http.server
import json
import threading
import time


class Hostile:
    """A bootstrap server an attacker runs. ``mode``: ``"record"`` answers ``/query`` with an
    engine whose side channel is ``side`` and records every request; ``"drip"`` answers one byte
    every ``every`` seconds; ``"huge"`` sends ``size`` bytes."""

    def __init__(self, mode: str = "record", side: str = "tcp://127.0.0.1:1", every: float = 0.2, size: int = 0):
        outer = self
        self.hits: list[str] = []
        self.closed = False

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hits.append(self.path)
                body = json.dumps({"0": {"engine_id": "evil", "worker_addr": {"0": {"0": side}}}}).encode()
                if mode == "huge":
                    body = b" " * size
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if mode != "drip":
                        self.wfile.write(body)
                        return
                    for b in body:
                        if outer.closed:
                            return
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(every)
                except OSError:
                    pass

            do_POST = do_GET

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.httpd.shutdown()
        self.httpd.server_close()
