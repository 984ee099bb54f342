"""A stand-in for llama.cpp's llama-server, for the peer benchmark's tests: it takes llama-server's flags,
answers GET /health and POST /v1/completions (plain and streamed) with `max_tokens` tokens when asked to
ignore EOS, and appends one JSON line per request to the file named by $FAKE_LLAMA_LOG, if set."""

from __future__ import annotations

import argparse
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

EOS_AFTER = 3  # tokens a request that does not ignore EOS gets


def log(record: dict[str, Any]) -> None:
    path = os.environ.get("FAKE_LLAMA_LOG")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def handler(model: str, threads: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the harness keeps the log
            pass

        def _json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                self._json(404, {"error": {"message": "not found"}})
                return
            tokens = body["max_tokens"] if body.get("ignore_eos") else min(EOS_AFTER, body["max_tokens"])
            log({"model": model, "threads": threads, "stream": body.get("stream", False), "tokens": tokens})
            if not body.get("stream"):
                self._json(
                    200, {"choices": [{"text": " tok" * tokens}], "usage": {"completion_tokens": tokens}}
                )
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(tokens):
                self.wfile.write(b'data: {"choices": [{"text": " tok"}]}\n\n')
                self.wfile.flush()
                time.sleep(0.001)
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--threads-batch", type=int)
    parser.add_argument("--parallel", type=int)
    parser.add_argument("--ctx-size", type=int)
    parser.add_argument("--cont-batching", action="store_true")
    args = parser.parse_args()
    ThreadingHTTPServer.request_queue_size = 128  # 32 streams connect at once; the default backlog is 5
    ThreadingHTTPServer((args.host, args.port), handler(args.model, args.threads)).serve_forever()


if __name__ == "__main__":
    main()
