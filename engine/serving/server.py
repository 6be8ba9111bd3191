"""OpenAI-compatible HTTP server over the native engine (aiohttp), greedy only.

    python -m engine.serving --weights DIR --mode ar|ddtree --budget 63 --port 8000 \\
        --device cpu|cuda [--max-batch 32] [--max-queue 64] [--bind 127.0.0.1] [--debug-hooks]

Endpoints (docs/SERVING.md):
  POST /v1/completions  prompt as a string (byte tokenizer, engine/serving/tokenizer.py) or token ids;
                        max_tokens (default 16); stream (server-sent events ending with
                        `data: [DONE]`, stream_options.include_usage for a usage chunk). Each
                        choice carries `token_ids`, the generated ids. Greedy only: a sampling
                        setting other than greedy (temperature != 0, top_p != 1, n != 1, ...)
                        is a 400. There is no EOS: every request gets exactly max_tokens tokens
                        (finish_reason "length").
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

from engine.jsondepth import json_depth
from engine.serving.batcher import Batcher, Overloaded, Unavailable
from engine.serving.tokenizer import ByteTokenizer

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 4 << 20  # a completion request is a prompt: 4 MiB is ~a million token ids
MAX_JSON_DEPTH = 16       # the deepest valid body is 3 levels (prompt: [[ids]])
MAX_INT_DIGITS = 19       # integers within int64; a 5,000-digit max_tokens is a 400, not a 500
OWNER = "kdtree-engine"

# Fields that must hold their greedy value (or be absent / null): name -> allowed values.
GREEDY_ONLY = {
    "temperature": (0, 0.0), "top_p": (1, 1.0), "top_k": (-1, 0, 1), "min_p": (0, 0.0),
    "n": (1,), "best_of": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "echo": (False,), "logprobs": (), "suffix": (),
    "use_beam_search": (False,),
}
# Fields accepted and ignored: they do not change greedy output without an EOS token.
IGNORED = {"user", "seed", "ignore_eos", "min_tokens", "skip_special_tokens",
           "spaces_between_special_tokens", "return_token_ids", "stop_token_ids", "stop",
           "logit_bias"}
KNOWN = {"model", "prompt", "max_tokens", "stream", "stream_options"} | set(GREEDY_ONLY) | IGNORED


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_response(status: int, message: str, param=None, code=None, headers=None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": code or str(status)}},
                             status=status, headers=headers)


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise BadRequest(f"a number of {len(s.lstrip('-'))} digits is out of range "
                         f"(at most {MAX_INT_DIGITS})")
    return int(s)


def _finite_float(s: str) -> float:
    x = float(s)
    if x != x or x in (float("inf"), float("-inf")):
        raise BadRequest(f"the number {s[:40]} is out of range")
    return x


def _no_constant(s: str):
    raise BadRequest(f"{s} is not valid JSON")


def parse_json_body(raw: bytes):
    """The request body as JSON within bounds; BadRequest (400) for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8: {e.reason} at byte {e.start}") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise BadRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float,
                          parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _same(v, a) -> bool:
    """v == a without bool/number confusion (JSON true is not 1)."""
    if isinstance(v, bool) or isinstance(a, bool):
        return v is a
    return isinstance(v, (int, float)) and v == a


def parse_completion(body, vocab_size: int, tokenizer, model_name: str) -> dict:
    """Checks a /v1/completions body; returns {prompt (ids), max_tokens, stream, usage_chunk}.
    Raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} is not served here (this server has {model_name!r})",
                         "model", 404, "model_not_found")
    for name, allowed in GREEDY_ONLY.items():
        v = body.get(name)
        if v is not None and not any(_same(v, a) for a in allowed):
            raise BadRequest(f"{name} = {v!r}: this server decodes greedily only "
                             f"(allowed: {', '.join(map(repr, allowed)) or 'null'})", name)
    stop = body.get("stop")
    if stop not in (None, "", []):
        raise BadRequest(f"stop = {stop!r}: stop sequences are not supported", "stop")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest(f"text prompts need a vocabulary of >= 256 tokens (this model has "
                             f"{vocab_size}); send token ids", "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = prompt
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} is outside [0, {vocab_size})", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"one prompt per request, got a batch of {len(prompt)}", "prompt")
    elif prompt is None:
        raise BadRequest("prompt is required", "prompt")
    else:
        raise BadRequest("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise BadRequest("prompt is empty (need at least one token)", "prompt")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens = {max_tokens!r}: need an integer >= 1", "max_tokens")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream = {stream!r}: need true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage",
                                                                         "continuous_usage_stats"}):
        raise BadRequest(f"stream_options = {opts!r}: only include_usage is supported",
                         "stream_options")
    return {"prompt": ids, "max_tokens": max_tokens, "stream": stream,
            "usage_chunk": bool((opts or {}).get("include_usage"))}


class Server:
    """The aiohttp application around one Batcher."""

    def __init__(self, batcher: Batcher, model_name: str, vocab_size: int,
                 instance_id: str | None = None, debug_hooks: bool = False):
        self.batcher, self.model_name, self.vocab_size = batcher, model_name, vocab_size
        self.debug_hooks = debug_hooks
        # Names this process in /health, so a starter that finds another server on the port it
        # asked for can tell (engine/remote/serve.py).
        self.instance_id = instance_id or uuid.uuid4().hex
        self.tokenizer = ByteTokenizer(vocab_size) if vocab_size >= 256 else None
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._json_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
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
                "device": self.batcher.engine.device, "stats": stats}
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
        raw = await request.read()  # over MAX_BODY_BYTES: 413 through _json_errors
        try:
            req = parse_completion(parse_json_body(raw), self.vocab_size, self.tokenizer, self.model_name)
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
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        try:
            if req["stream"]:
                return await self._stream(request, job, head, req)
            return await self._whole(job, head, req)
        except ConnectionResetError:  # the client went away mid-stream: not an error of ours
            return web.Response(status=499)
        finally:
            self.batcher.cancel(job)  # frees the slot if the client went away; else a no-op

    def _usage(self, req, n: int) -> dict:
        p = len(req["prompt"])
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    async def _whole(self, job, head, req) -> web.Response:
        ids = []
        while True:
            kind, value = await job.queue.get()
            if kind == "tokens":
                ids.extend(value)
            elif kind == "error":
                return error_response(500, value, code="engine_error")
            else:
                text = self.tokenizer.decode(ids) if self.tokenizer else ""
                return web.json_response({**head, "choices": [{
                    "index": 0, "text": text, "token_ids": ids, "logprobs": None,
                    "finish_reason": value}], "usage": self._usage(req, len(ids))})

    async def _stream(self, request, job, head, req) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        dec = self.tokenizer.stream_decoder() if self.tokenizer else None
        n = 0

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        while True:
            kind, value = await job.queue.get()
            if kind == "tokens":
                n += len(value)
                await send({**head, "choices": [{
                    "index": 0, "text": dec.feed(value) if dec else "", "token_ids": value,
                    "logprobs": None, "finish_reason": None}]})
            elif kind == "error":  # headers are sent: report in-band, as OpenAI servers do
                await send({"error": {"message": value, "type": "server_error", "param": None,
                                      "code": "engine_error"}})
                break
            else:
                await send({**head, "choices": [{
                    "index": 0, "text": dec.feed([], final=True) if dec else "", "token_ids": [],
                    "logprobs": None, "finish_reason": value}]})
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
    batcher.start()
    return Server(batcher, model_name or Path(weights).resolve().name, engine.vocab_size,
                  instance_id, debug_hooks)


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
