"""Suite `service`: a served model under concurrency, as a client sees it (issue 7).

    python -m bench --suite service --out DIR [--quick] [--device cpu|cuda] [--url URL]

With --url: sweeps the server at URL (any OpenAI-compatible /v1/completions: ours, vLLM's,
SGLang's). Without: for each target of `models` (bench/models.py: `tiny`, then `code-small`)
and each mode (AR, then DDTree) starts our server (`python -m engine.serving`) on 127.0.0.1 on a
free port, on cuda when ctx.devices has it, else cpu: tiny (seed 0, its block drafter seed 1,
from the weights cache of bench/weights.py, never the run folder; DDTree serves with the trained
block drafter of bench/weights.trained_drafter_weights) as `kdtree-tiny` with seeded token-id
prompts; code-small (trained once per host into the cache: bench/weights.code_small_weights;
--quick: its toy version) as `kdtree-code-small` with TEXT prompts (the server encodes them with
the folder's tokenizer.json): `code_small_prompt_tokens` (lo,hi) tokens cut from the held-out
files of its training split and decoded; or, with the `weights` option, that folder alone.
params["weights"] / params["drafter"] record tiny's folder, config, sha256 per file and drafter
(trained or random, steps, data source, held-out accuracy); params["code_small"] the same for
code-small. Each server: /health awaited; its tokens for 3 prompts checked against the engine's
direct greedy output; the sweep; stop. Server logs go to DIR/service_server[_code-small]_<mode>.log.

The sweep (bench/service_load.py has the measurement and the formulas): one warm-up request,
then per concurrency level a fixed number of streamed greedy requests with max_tokens each,
prompts from a seeded generator (fixed seed: runs compare like with like) or a prompts file.
One record per (target, server, level) with the raw per-request records (stored compact:
integer microseconds and gaps, see bench/service_load.py; expand_request reads old and new
forms), `samples` = request latencies (s), aggregate and per-request tokens/s, TTFT / ITL / TPOT
p50, p90, p99, request throughput and errors; `target` names the model (tiny's records keep the
case keys of earlier runs; code-small's case has its own model id and prompt lengths).
Validation (`ok`) fails when a token count differs from max_tokens or, for our server, when
served tokens differ from Engine.generate's AR tokens for the same prompts.

Options: ctx.args keys, else environment variables KDT_SERVICE_<KEY> (upper case; max_tokens,
prompt_tokens and code_small_prompt_tokens read KDT_SERVICE_OUTPUT_LEN, KDT_SERVICE_PROMPT_LEN
and KDT_SERVICE_CODE_SMALL_PROMPT_LEN), else the defaults below (--quick: QUICK). models (comma
list of tiny, code-small), concurrency (comma list), requests (per level), max_tokens,
prompt_tokens (tiny's), code_small_prompt_tokens (lo,hi), prompts (a file: .jsonl {"prompt":
...} lines, or text lines; tiny's), modes (comma list of ar, ddtree), budget (the DDTree node
budget, 15), round_tokens (64: the server shrinks a round's budget along 15, 7, 3 while requests
x (budget + 1) exceeds it and runs AR steps past that: budget 15 up to 4 requests, 7 up to 8, 3
up to 16, AR beyond; engine/serving/batcher.py), weights, max_batch (default: the largest
level), timeout_s (per request).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench import REPO_ROOT, format_table
from bench import models as bm
from bench.models import check_models
from bench.service_load import (REQUESTS_FORMAT, compact_request, get_model, load_prompts,
                                request_once, run_level, seeded_prompts, summarize_level)
from bench.timing import summarize

NAME = "service"
DEFAULTS = {"concurrency": "1,4,8,10,16,32", "requests": 64, "max_tokens": 256,
            "prompt_tokens": 32, "seed": 1234, "prompts": None, "modes": "ar,ddtree",
            "budget": 15, "round_tokens": 64, "weights": None, "max_batch": None,
            "timeout_s": 600.0, "models": "tiny,code-small", "code_small_prompt_tokens": "64,128"}
QUICK = {**DEFAULTS, "concurrency": "1,4", "requests": 8, "max_tokens": 32,
         "code_small_prompt_tokens": "16,24"}
# Names with "token" in them are refused in host inventories' env (secret filter): lengths instead.
ENV_NAMES = {"max_tokens": "KDT_SERVICE_OUTPUT_LEN", "prompt_tokens": "KDT_SERVICE_PROMPT_LEN",
             "code_small_prompt_tokens": "KDT_SERVICE_CODE_SMALL_PROMPT_LEN"}
VALIDATE_PROMPTS, VALIDATE_TOKENS = 3, 16
HEALTH_TIMEOUT_S = 300.0  # engine creation + drafter load (+ CUDA context) on a busy host


def options(ctx) -> dict:
    base = QUICK if ctx.quick else DEFAULTS
    out = {}
    for key, default in base.items():
        v = ctx.args.get(key)
        if v is None:
            v = os.environ.get(ENV_NAMES.get(key, f"KDT_SERVICE_{key.upper()}"), default)
        out[key] = v
    try:
        for key in ("requests", "max_tokens", "prompt_tokens", "seed", "budget", "round_tokens"):
            out[key] = int(out[key])
        out["timeout_s"] = float(out["timeout_s"])
        c = out["concurrency"]
        out["concurrency"] = [int(x) for x in (c.split(",") if isinstance(c, str) else c)]
        m = out["modes"]
        out["modes"] = [x.strip() for x in (m.split(",") if isinstance(m, str) else m)]
        m = out["models"]
        out["models"] = [x.strip() for x in (m.split(",") if isinstance(m, str) else m)]
        c = out["code_small_prompt_tokens"]
        out["code_small_prompt_tokens"] = [int(x) for x in (c.split(",") if isinstance(c, str) else c)]
        if out["max_batch"] is not None:
            out["max_batch"] = int(out["max_batch"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"service: bad option: {e}") from None
    if not out["concurrency"] or min(out["concurrency"]) < 1 or out["requests"] < 1:
        raise ValueError(f"service: concurrency {out['concurrency']} and requests "
                         f"{out['requests']} must be >= 1")
    bad = [m for m in out["modes"] if m not in ("ar", "ddtree")]
    if bad:
        raise ValueError(f"service: modes {bad}: expected ar and/or ddtree")
    out["models"] = check_models(out["models"])
    lo_hi = out["code_small_prompt_tokens"]
    if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
        raise ValueError(f"service: code_small_prompt_tokens {lo_hi}: need lo,hi with 1 <= lo <= hi")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict | None]:
    """(HTTP status, parsed body or None); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None
    except (OSError, ValueError):
        return 0, None


def wait_healthy(url: str, timeout_s: float, proc=None, log_path=None) -> dict:
    """Polls GET url/health until 200 (bounded); fails early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = get_json(f"{url}/health", timeout=2.0)
        if status == 200:
            return body
        if proc is not None and proc.poll() is not None:
            tail = Path(log_path).read_text()[-2000:] if log_path else ""
            raise RuntimeError(f"the server exited with {proc.returncode} before /health "
                               f"answered; its log ({log_path}) ends:\n{tail}")
        time.sleep(0.2)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:g} s"
                       + (f" (log: {log_path})" if log_path else ""))


class ServerProcess:
    """`python -m engine.serving` on 127.0.0.1:<free port> for a with-block; `.url` inside."""

    def __init__(self, weights, mode: str, budget: int, device: str, max_batch: int,
                 max_queue: int, log_path, extra=()):
        self.argv = [sys.executable, "-m", "engine.serving", "--weights", str(weights), "--mode",
                     mode, "--budget", str(budget), "--device", device, "--max-batch",
                     str(max_batch), "--max-queue", str(max_queue), *extra]
        self.log_path = Path(log_path)
        self.proc = None
        self.url = None

    def __enter__(self) -> "ServerProcess":
        port = free_port()
        self.argv += ["--bind", "127.0.0.1", "--port", str(port)]
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_healthy(self.url, HEALTH_TIMEOUT_S, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __exit__(self, *exc) -> None:
        self.stop()


async def _served_ids(url: str, prompts: list, n: int) -> list:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        model = await get_model(s, url)
        recs = [await request_once(s, url, model, p, n, keep_ids=True) for p in prompts]
    for r in recs:
        if r["error"]:
            raise RuntimeError(f"validation request to {url} failed: {r['error']}")
    return [r["token_ids"] for r in recs]


def slot_rows(prompts: list, max_tokens: int, mode: str, budget: int) -> int:
    """--max-seq for our server: the longest prompt (text: its UTF-8 bytes, the byte tokenizer)
    + max_tokens + the tree width (budget + 1 for DDTree, 1 for AR), at least the server's 1024.
    Without it, KDT_SERVICE_OUTPUT_LEN=1024 would make every request a 400."""
    longest = max(len(p.encode("utf-8")) if isinstance(p, str) else len(p) for p in prompts)
    return max(1024, longest + max_tokens + (budget + 1 if mode == "ddtree" else 1))


def engine_check(url: str, weights, device: str, prompts: list, max_seq: int = 1024) -> dict:
    """Served token ids == Engine.generate(mode='ar') for the same prompts (exact); text prompts
    are encoded as the server encodes them (the folder's tokenizer: engine/serving/tokenizer.py)."""
    from engine.native.engine import Engine
    from engine.serving.tokenizer import load_tokenizer

    served = asyncio.run(_served_ids(url, prompts, VALIDATE_TOKENS))
    with Engine(weights, device=device, max_seq=max_seq) as eng:
        tok = load_tokenizer(weights, eng.vocab_size)
        ids = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
        direct = [t.tolist() for t in eng.generate(ids, VALIDATE_TOKENS, mode="ar").tokens]
    for i, (s, d) in enumerate(zip(served, direct)):
        if s != d:
            return {"ok": False, "error": f"prompt {i}: served {s} != engine {d}"}
    return {"ok": True, "prompts": len(prompts), "tokens": VALIDATE_TOKENS}


async def sweep(url: str, prompts: list, opts: dict, ours: bool) -> tuple[str, list]:
    """(model id, [(concurrency, records, wall, server stats)]) after one unrecorded warm-up
    request. Server stats: our /health counters after the level (cumulative), else None."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=opts["timeout_s"])) as s:
        model = await get_model(s, url)
        warm = await request_once(s, url, model, prompts[0], min(opts["max_tokens"], 16))
        if warm["error"]:
            raise RuntimeError(f"warm-up request to {url} failed: {warm['error']}")
    levels = []
    for c in opts["concurrency"]:
        records, wall = await run_level(url, model, prompts, c, opts["requests"],
                                        opts["max_tokens"], opts["timeout_s"])
        stats = get_json(f"{url}/health")[1] if ours else None
        levels.append((c, records, wall, stats))
    return model, levels


def _records(backend: str, url: str, model: str, levels, opts: dict, extra_case: dict,
             check: dict | None) -> list:
    out = []
    for c, records, wall, server_stats in levels:
        s = summarize_level(records, wall, opts["max_tokens"])
        samples = [r["latency"] for r in records if not r["error"]]
        tc = s["token_check"]
        ok = tc["n_mismatches"] == 0 and (check is None or check["ok"])
        out.append({
            "bench": NAME, "backend": backend,
            # The case is the record's identity for `invoke compare`: our server's URL (a free
            # port) stays out of it; a URL given with --url is part of what was measured.
            "case": {"concurrency": c, "requests": opts["requests"],
                     "max_tokens": opts["max_tokens"], "prompt_tokens": opts["prompt_tokens"],
                     "model": model, **({"url": url} if backend == "url" else {}),
                     **extra_case},
            "server_url": url,
            "samples": samples, "summary": summarize(samples) if samples else None,
            **s, "server_stats": server_stats,
            "validation": {"ok": ok, "token_check": tc, "engine_check": check,
                           **({} if ok else {"error": (tc["mismatches"][:1] or
                                                       [check and check.get("error")])[0]})},
            # raw records, compact (bench/service_load.py: expand_request reads both forms)
            "requests_format": REQUESTS_FORMAT,
            "requests": [compact_request(r) for r in records],
        })
    return out


def _targets(ctx, opts, device: str) -> list:
    """[(name, target folder, served folder, served model name or None, prompts, case extras,
    training record or None)]:
    tiny with seeded id prompts (or the prompts file), code-small with text prompts cut from its
    held-out files; a `weights` option serves that folder alone."""
    if opts["prompts"]:
        base_prompts = load_prompts(opts["prompts"])
    else:
        base_prompts = seeded_prompts(max(opts["requests"], VALIDATE_PROMPTS),
                                      opts["prompt_tokens"], opts["seed"])
    ddtree = "ddtree" in opts["modes"]
    if opts["weights"]:
        w = Path(opts["weights"])
        return [("weights", w, w, None, base_prompts, {}, None)]
    out = []
    for name in opts["models"]:
        if name == "tiny":
            t = bm.tiny(ctx.quick, device, block=ddtree, block_random=False)
            out.append(("tiny", t.folder, t.engine_weights, "kdtree-tiny", base_prompts, {}, None))
        else:
            t = bm.code_small(device, ctx.quick)
            training = t.training
            tok = bm.tokenizer(t)
            ids = bm.code_small_prompts(t, max(opts["requests"], VALIDATE_PROMPTS),
                                        opts["code_small_prompt_tokens"], opts["seed"])
            lo, hi = opts["code_small_prompt_tokens"]
            out.append(("code-small", t.folder, t.engine_weights, "kdtree-code-small",
                        [tok.decode(p) for p in ids], {"prompt_tokens": f"{lo}-{hi}"}, training))
    return out


def run(ctx) -> dict:
    opts = options(ctx)
    url = ctx.args.get("url")
    results = []
    params = {k: v for k, v in opts.items()} | {
        "url": url, "prompts_source": opts["prompts"] or f"seeded({opts['seed']})"}
    if url:
        url = url.rstrip("/")
        prompts = load_prompts(opts["prompts"]) if opts["prompts"] else seeded_prompts(
            max(opts["requests"], VALIDATE_PROMPTS), opts["prompt_tokens"], opts["seed"])
        model, levels = asyncio.run(sweep(url, prompts, opts, ours=False))
        results += _records("url", url, model, levels, opts, {}, None)
        params["models"] = None
        return {"params": params, "results": results, "table": table(results)}
    device = "cuda" if "cuda" in ctx.devices else "cpu"
    from bench import weights as bw

    targets = _targets(ctx, opts, device)
    params["models"] = [t[0] for t in targets]
    max_batch = opts["max_batch"] or max(opts["concurrency"])
    # A queue as deep as the largest level: a max_batch below it queues, never 429s.
    max_queue = max(max(opts["concurrency"]), max_batch)
    for name, target, weights, served_name, prompts, case_extra, training in targets:
        record = {"weights": bw.describe(target),
                  "drafter": bw.drafter_record(weights) if "ddtree" in opts["modes"] else None}
        if name == "code-small":  # tiny's (or the weights option's) stay where they were
            params["code_small"] = {**record, "served_model": served_name, "training": training,
                                    "prompts_source": "held-out files of the target's train.json "
                                    f"split, seed {opts['seed']}, sent as text",
                                    "prompt_tokens": opts["code_small_prompt_tokens"]}
        else:
            params.update(record)
        for mode in opts["modes"]:
            tag = "" if name in ("tiny", "weights") else f"_{name}"
            log = Path(ctx.out_dir) / f"service_server{tag}_{mode}.log"
            rows = slot_rows(prompts, opts["max_tokens"], mode, opts["budget"])
            extra = (("--served-model-name", served_name) if served_name else ()) + \
                ("--max-seq", str(rows), "--round-tokens", str(opts["round_tokens"]))
            with ServerProcess(weights, mode, opts["budget"], device, max_batch,
                               max_queue, log, extra=extra) as srv:
                check = engine_check(srv.url, weights, device, prompts[:VALIDATE_PROMPTS], rows)
                model, levels = asyncio.run(sweep(srv.url, prompts, opts, ours=True))
            recs = _records(f"{mode}/{device}", srv.url, model, levels, opts,
                            {"mode": mode, "budget": opts["budget"] if mode == "ddtree"
                             else None, "round_tokens": opts["round_tokens"] if mode == "ddtree"
                             else None, "device": device, **case_extra}, check)
            results += [dict(r, target=name) for r in recs]
    return {"params": params, "results": results, "table": table(results)}


def _ms(d, key) -> float | None:
    return None if not d else d[key] * 1e3


def table(results: list) -> str:
    rows = []
    for r in results:
        rows.append([r.get("target") or "-", r["backend"], r["case"]["concurrency"],
                     r["rates"]["aggregate_tokens_per_s"]["value"],
                     (r["per_request_tokens_per_s"] or {}).get("p50"),
                     _ms(r["ttft_s"], "p50"), _ms(r["ttft_s"], "p99"),
                     _ms(r["itl_s"], "p50"), _ms(r["itl_s"], "p99"),
                     r["rates"]["request_throughput"]["value"], r["errors"],
                     "ok" if r["validation"]["ok"] else "FAIL"])
    return format_table(["model", "server", "conc", "tok/s", "req tok/s p50", "TTFT p50 ms",
                         "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "req/s", "errors", "valid"],
                        rows)
