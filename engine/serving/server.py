"""OpenAI-compatible HTTP server over the native engine (aiohttp), greedy only.

    python -m engine.serving --weights DIR --mode ar|ddtree --budget 63 --port 8000 \\
        --device cpu|cuda [--max-batch 32] [--max-queue 64] [--bind 127.0.0.1] [--debug-hooks]

Endpoints (docs/SERVING.md):
  POST /v1/completions  prompt as a string (the weights folder's tokenizer.json, else the byte
                        tokenizer: engine/serving/tokenizer.py) or token ids;
                        max_tokens (default 16); stream (server-sent events ending with
                        `data: [DONE]`, stream_options.include_usage for a usage chunk). Each
                        choice carries `token_ids`, the generated ids. Greedy only: a sampling
                        setting other than greedy (temperature != 0, top_p != 1, n != 1, ...)
                        is a 400. There is no EOS: every request gets exactly max_tokens tokens
                        (finish_reason "length").
  POST /v1/chat/completions  messages (text; the prompt is their contents in order: no chat
                        template, engine/serving/protocol.py); the same settings; each choice
                        carries message.content (delta.content streamed) and token_ids.
  GET  /v1/models       the one served model
  GET  /health          200 with the batcher's counters while the worker runs, else 503
  POST /debug/pause     only with --debug-hooks (tests): hold the decode steps (Batcher.pause:
  POST /debug/resume    admissions and cancellations go on, nothing finishes) / release them
Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 400 bad request (bodies that
are not UTF-8 JSON, nested deeper than MAX_JSON_DEPTH, or hold integers of more than
MAX_INT_DIGITS digits, NaN or infinities are 400s too), 404 unknown model or path, 413 a body
over MAX_BODY_BYTES, 429 every slot busy and the queue full, 503 shutting down or the worker
died. Client errors and client disconnects are never logged with a traceback.
Requests are batched continuously (engine/serving/batcher.py); a client that disconnects frees its slot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from pathlib import Path

from aiohttp import web

from engine.serving.batcher import Batcher, Overloaded, Unavailable
from engine.serving.protocol import (MAX_BODY_BYTES, BadRequest, parse_chat, parse_completion,
                                     parse_json_body)
from engine.serving.tokenizer import load_tokenizer

OWNER = "kdtree-engine"


def error_response(status: int, message: str, param=None, code=None, headers=None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": code or str(status)}},
                             status=status, headers=headers)


class Server:
    """The aiohttp application around one Batcher. tokenizer: engine/serving/tokenizer.py's
    load_tokenizer result for the weights (None: token ids only)."""

    def __init__(self, batcher: Batcher, model_name: str, vocab_size: int,
                 instance_id: str | None = None, debug_hooks: bool = False, tokenizer=None):
        self.batcher, self.model_name, self.vocab_size = batcher, model_name, vocab_size
        self.debug_hooks = debug_hooks
        # Names this process in /health, so a starter that finds another server on the port it
        # asked for can tell (engine/remote/serve.py).
        self.instance_id = instance_id or uuid.uuid4().hex
        self.tokenizer = tokenizer
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._json_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        if self.debug_hooks:
            app.router.add_post("/debug/pause", self.pause)
            app.router.add_post("/debug/resume", self.resume)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, _app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.batcher.stop)

    @web.middleware
    async def _json_errors(self, request, handler):
        """aiohttp's own errors (404 path, 405 method, 413 body too large) as JSON too."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_response(e.status, f"{request.method} {request.path}: {e.reason}")

    async def health(self, _request) -> web.Response:
        stats = self.batcher.stats()
        body = {"status": "ok" if self.batcher.alive() else "unavailable", "model": self.model_name,
                "instance_id": self.instance_id,
                "mode": self.batcher.mode, "budget": self.batcher.budget,
                "max_batch": self.batcher.max_batch, "max_queue": self.batcher.max_queue,
                "device": self.batcher.engine.device,
                "tokenizer": getattr(self.tokenizer, "name", None), "stats": stats}
        if not self.batcher.alive():
            body["error"] = self.batcher.error or "shutting down"
            return web.json_response(body, status=503)
        return web.json_response(body)

    async def pause(self, _request) -> web.Response:
        """Test hook: no decode step from the next step boundary on; returns the counters."""
        self.batcher.pause()
        return web.json_response({"paused": True, "stats": self.batcher.stats()})

    async def resume(self, _request) -> web.Response:
        self.batcher.resume()
        return web.json_response({"paused": False, "stats": self.batcher.stats()})

    async def models(self, _request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": OWNER,
            "max_model_len": self.batcher.engine.max_seq}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_completion, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, parse_chat, chat=True)

    async def _serve(self, request: web.Request, parse, chat: bool) -> web.StreamResponse:
        raw = await request.read()  # over MAX_BODY_BYTES: 413 through _json_errors
        try:
            req = parse(parse_json_body(raw), self.vocab_size, self.tokenizer, self.model_name)
            job = self.batcher.submit(req["prompt"], req["max_tokens"], asyncio.get_running_loop())
        except BadRequest as e:
            return error_response(e.status, str(e), e.param, e.code)
        except ValueError as e:  # the batcher's limits (context length)
            return error_response(400, str(e), "max_tokens", "context_length_exceeded")
        except Overloaded as e:
            return error_response(429, f"server overloaded: {e}", code="overloaded",
                                  headers={"Retry-After": "1"})
        except Unavailable as e:
            return error_response(503, f"server unavailable: {e}", code="unavailable")
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        try:
            if req["stream"]:
                return await self._stream(request, job, head, req, chat)
            return await self._whole(job, head, req, chat)
        except ConnectionResetError:  # the client went away mid-stream: not an error of ours
            return web.Response(status=499)
        finally:
            self.batcher.cancel(job)  # frees the slot if the client went away; else a no-op

    def _usage(self, req, n: int) -> dict:
        p = len(req["prompt"])
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    @staticmethod
    def _choice(chat: bool, text: str, ids: list, finish, first: bool = False,
                stream: bool = False) -> dict:
        """One choice: a completion's {text, token_ids}; a chat's message (whole) or delta
        (streamed; the first delta names the role), with token_ids beside it."""
        if not chat:
            return {"index": 0, "text": text, "token_ids": ids, "logprobs": None,
                    "finish_reason": finish}
        if not stream:
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "token_ids": ids, "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if first else (
            {"content": text} if text or finish is None else {})
        return {"index": 0, "delta": delta, "token_ids": ids, "logprobs": None,
                "finish_reason": finish}

    async def _whole(self, job, head, req, chat: bool) -> web.Response:
        ids = []
        while True:
            kind, value = await job.queue.get()
            if kind == "tokens":
                ids.extend(value)
            elif kind == "error":
                return error_response(500, value, code="engine_error")
            else:
                text = self.tokenizer.decode(ids) if self.tokenizer else ""
                return web.json_response({**head, "choices": [self._choice(chat, text, ids, value)],
                                          "usage": self._usage(req, len(ids))})

    async def _stream(self, request, job, head, req, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        dec = self.tokenizer.stream_decoder() if self.tokenizer else None
        if chat:
            head = {**head, "object": "chat.completion.chunk"}
        n = 0

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        while True:
            kind, value = await job.queue.get()
            if kind == "tokens":
                await send({**head, "choices": [self._choice(
                    chat, dec.feed(value) if dec else "", value, None, first=n == 0, stream=True)]})
                n += len(value)
            elif kind == "error":  # headers are sent: report in-band, as OpenAI servers do
                await send({"error": {"message": value, "type": "server_error", "param": None,
                                      "code": "engine_error"}})
                break
            else:
                await send({**head, "choices": [self._choice(
                    chat, dec.feed([], final=True) if dec else "", [], value, first=n == 0,
                    stream=True)]})
                if req["usage_chunk"]:
                    await send({**head, "choices": [], "usage": self._usage(req, n)})
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def build(weights, mode: str = "ar", budget: int = 63, device: str = "cpu", max_batch: int = 32,
          max_queue: int = 64, max_seq: int = 1024, model_name: str | None = None,
          instance_id: str | None = None, debug_hooks: bool = False, round_tokens: int = 0,
          graphs: bool | None = None) -> Server:
    """Engine + Batcher (started) + Server for the weights folder."""
    from engine.native.engine import Engine

    engine = Engine(weights, device=device, max_slots=max_batch, max_seq=max_seq, graphs=graphs)
    if mode == "ddtree":
        engine.block_drafter()  # load it now, not inside the first request
    batcher = Batcher(engine, mode, budget, max_batch, max_queue, round_tokens=round_tokens)
    tokenizer = load_tokenizer(weights, engine.vocab_size)
    batcher.start()
    return Server(batcher, model_name or Path(weights).resolve().name, engine.vocab_size,
                  instance_id, debug_hooks, tokenizer)


async def serve(server: Server, bind: str, port: int, log=sys.stdout) -> None:
    """Listen until SIGINT / SIGTERM; prints `serving http://BIND:PORT` once listening."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, bind, port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"serving http://{host}:{port} (model {server.model_name}, mode "
          f"{server.batcher.mode}, device {server.batcher.engine.device})", file=log, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def limit_cpu_threads(n: int) -> None:
    """Small matrices: extra BLAS / torch threads only spin (engine.reference.model.limit_blas_threads)."""
    from engine.reference.model import limit_blas_threads

    limit_blas_threads(n)
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.serving", description=__doc__.split("\n")[0])
    ap.add_argument("--weights", required=True, help="folder from `python -m engine.cli.model init`")
    ap.add_argument("--mode", choices=("ar", "ddtree"), default="ddtree")
    ap.add_argument("--budget", type=int, default=63, help="DDTree node budget B")
    ap.add_argument("--round-tokens", type=int, default=0, help="DDTree: shrink a round's budget "
                    "(63, 31, 15, 7, 3) while requests x (B + 1) exceeds this, AR steps past "
                    "budget 3 (0: never)")
    ap.add_argument("--no-graphs", action="store_true", help="run rounds eagerly, without CUDA "
                    "graphs (debugging; KDTREE_GRAPHS=0 does the same)")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--bind", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--max-batch", type=int, default=32, help="engine slots (requests decoded "
                    "together)")
    ap.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot "
                    "before 429")
    ap.add_argument("--max-seq", type=int, default=1024, help="cache rows per slot")
    ap.add_argument("--served-model-name", default=None, help="default: the weights folder name")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for BLAS / torch")
    ap.add_argument("--instance-id", default=None, help="reported by /health (default: random)")
    ap.add_argument("--debug-hooks", action="store_true", help="tests: enable POST /debug/pause "
                    "and /debug/resume (hold the decode steps); never on a shared server")
    args = ap.parse_args(argv)
    if args.budget < 1:
        print(f"error: serve: --budget {args.budget}: need >= 1", file=sys.stderr)
        return 5
    if args.round_tokens < 0:
        print(f"error: serve: --round-tokens {args.round_tokens}: need >= 0", file=sys.stderr)
        return 5
    if not (Path(args.weights) / "config.json").is_file():
        print(f"error: serve: --weights {args.weights}: no config.json there (python -m "
              "engine.cli.model init --out DIR writes one)", file=sys.stderr)
        return 5
    limit_cpu_threads(args.threads)
    try:
        server = build(args.weights, args.mode, args.budget, args.device, args.max_batch,
                       args.max_queue, args.max_seq, args.served_model_name, args.instance_id,
                       args.debug_hooks, args.round_tokens, False if args.no_graphs else None)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 5
    try:
        asyncio.run(serve(server, args.bind, args.port))
    except OSError as e:  # the port is taken, or the address is not ours
        print(f"error: serve: listening on {args.bind}:{args.port}: {e}", file=sys.stderr)
        server.batcher.stop()
        return 3
    return 0
