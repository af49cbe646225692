"""Stand-in for ``areal_mega.inference.server`` in launcher tests: same CLI, answers
``GET /health`` with 200 and writes its pid to ``$FAKE_PID_DIR/server-<port>.pid``."""

import argparse
import os
from http.server import BaseHTTPRequestHandler, HTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key")
    p.add_argument("--allow-unauthenticated", action="store_true")
    p.add_argument("--num-threads", type=int, default=1)
    a = p.parse_args()
    pid_dir = os.environ.get("FAKE_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, f"server-{a.port}.pid"), "w") as f:
            f.write(str(os.getpid()))
    HTTPServer((a.host, a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
