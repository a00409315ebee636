"""A stand-in vLLM server for the fleet tests: the routes the ``vllm`` engine uses, in another process, so that
killing it is a real kill. ``python tests/helpers/fake_vllm.py PORT LOG [--die-after K] [--fail-reload]``.

- ``POST /v1/completions`` with token-id prompts answers ``n`` choices with ``token_ids`` and
  ``logprobs.token_logprobs``, as vLLM does with ``return_token_ids`` and ``logprobs: 0``. Choice ``k`` is a
  function of (prompt, ``seed + k``) only, as vLLM's per-request seeded sampling is of the logits: another
  server answers a request exactly as this one would have. Stop ids end a choice (``finish_reason: stop``).
- ``POST /collective_rpc`` (``reload_weights``) counts reloads (``--fail-reload``: HTTP 500);
  ``/reset_prefix_cache`` answers; ``GET /health``.
- every completion request's prompt is appended to ``LOG`` (one JSON line), so a test sees where each went.
- ``--die-after K``: the process exits on its K-th completion request, before answering it (a server killed
  mid-step: the request in flight gets its connection closed, later ones are refused).
- ``--cut-after K``: on its K-th completion request the process sends the answer's headers and half its body,
  then exits (a server killed while answering: the client reads an answer cut short).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import threading

VOCAB = 1024
TOKENS = 64
"""Sampled ids are drawn from [2, TOKENS): small, so stop ids and repeated n-grams occur."""


def choice(prompt: list[int], seed: int, max_tokens: int, stops: set[int]) -> dict:
    rng = random.Random(f"{prompt}|{seed}")
    ids, logprobs, finish = [], [], "length"
    for _ in range(max_tokens):
        ids.append(rng.randrange(2, TOKENS))
        logprobs.append(-0.05 - 3 * rng.random())
        if ids[-1] in stops:
            finish = "stop"
            break
    return {"token_ids": ids, "logprobs": {"token_logprobs": logprobs}, "finish_reason": finish}


class Handler(http.server.BaseHTTPRequestHandler):
    log_path = ""
    die_after = 0
    cut_after = 0
    fail_reload = False
    count = 0
    lock = threading.Lock()

    def answer(self, code: int, body: object) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):  # noqa: N802 - the handler's name
        self.answer(200, {}) if self.path == "/health" else self.answer(404, {"error": self.path})

    def do_POST(self):  # noqa: N802 - the handler's name
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path == "/collective_rpc":
            return self.answer(500, {"error": "reload failed"}) if self.fail_reload else self.answer(200, {})
        if self.path == "/reset_prefix_cache":
            return self.answer(200, {})
        if self.path != "/v1/completions":
            return self.answer(404, {"error": self.path})
        with Handler.lock:
            Handler.count += 1
            if Handler.count == self.die_after:
                os._exit(1)  # killed mid-request: the connection closes without an answer
            cut = Handler.count == self.cut_after
            if not cut:
                with open(self.log_path, "a") as log:
                    log.write(json.dumps({"prompt": body["prompt"], "n": body["n"]}) + "\n")
        stops = set(body.get("stop_token_ids") or [])
        choices = [
            dict(choice(body["prompt"], body["seed"] + k, body["max_tokens"], stops), index=k) for k in range(body["n"])
        ]
        if cut:  # killed while answering: headers and half the body sent, then the connection is gone
            raw = json.dumps({"choices": choices}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw[: len(raw) // 2])
            self.wfile.flush()
            os._exit(1)
        self.answer(200, {"choices": choices})

    def log_message(self, *args):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("log")
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--cut-after", type=int, default=0)
    parser.add_argument("--fail-reload", action="store_true")
    args = parser.parse_args()
    Handler.log_path, Handler.die_after, Handler.fail_reload = args.log, args.die_after, args.fail_reload
    Handler.cut_after = args.cut_after
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
