"""The service load generator: streaming greedy completions at fixed concurrency (aiohttp).

Talks to any OpenAI-compatible /v1/completions (ours, vLLM's, SGLang's). Each request is

    {"model", "prompt", "max_tokens", "temperature": 0, "stream": true, "ignore_eos": true,
     "stream_options": {"include_usage": true}}

and each server-sent chunk is timed on arrival. Per request (`request_once`): TTFT = first
chunk carrying a token - send; latency = [DONE] (or the end of the stream) - send; the chunks'
arrival times and token counts (from `token_ids` when the server sends them, else one per
non-empty text chunk). Token count check: the server's usage.completion_tokens, else the number
of token_ids, must equal max_tokens (ignore_eos: no early stop); a text-only server without
usage cannot be checked, and the record says so.

Per level (`run_level`): `concurrency` workers take requests from one shared list of
`n_requests` until it is empty; wall = first send to last completion. `summarize_level` gives
(formulas also in the record):
  aggregate_tokens_per_s   = tokens of all ok requests / wall
  request_throughput       = ok requests / wall
  per_request_tokens_per_s = tokens / latency, per request (p50, p90, p99, mean)
  ttft                     = p50, p90, p99 over ok requests (seconds)
  itl                      = per-token inter-token latency: a chunk of k tokens arriving g
                             seconds after the previous one counts k times g / k (so DDTree's
                             multi-token chunks and one-token chunks are comparable); p50/90/99
  tpot                     = (latency - ttft) / (tokens - 1), per request (p50, p90, p99)

Stored form of the raw per-request records (`compact_request`, format REQUESTS_FORMAT): times
as integer microseconds, chunk arrivals as gaps (the first gap from the send is the TTFT) in one
space-separated string, chunk token counts as one int when every chunk carried the same count
(else a string like the gaps). Absolute times are
rounded to the microsecond before taking gaps, so `expand_request` gives every time back to
within 0.5 us (no drift over a long stream); it also reads the older form (float seconds,
`chunk_times`) unchanged. The summaries are computed from the full-precision records before
they are stored.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
REQUESTS_FORMAT = "us-gaps-2"  # see the module docstring; the older form has no such tag


def _us(t):
    return None if t is None else int(round(t * 1e6))


def compact_request(rec: dict) -> dict:
    """The stored form of one raw request record (module docstring)."""
    out = {k: rec[k] for k in ("index", "status", "error", "prompt_tokens", "tokens",
                               "usage_tokens", "ids_seen", "token_ids") if k in rec}
    out["start_us"] = _us(rec.get("start"))
    out["latency_us"] = _us(rec.get("latency"))
    abs_us = [_us(t) for t in rec.get("chunk_times") or []]
    # one string of integers, not a list: the suite JSON is written with indent=1, one line
    # per list element, which would triple the size
    out["chunk_gaps_us"] = " ".join(str(b - a) for a, b in zip([0] + abs_us[:-1], abs_us))
    ks = rec.get("chunk_tokens") or []
    out["chunk_tokens"] = ks[0] if ks and all(k == ks[0] for k in ks) else " ".join(map(str, ks))
    return out


def expand_request(rec: dict) -> dict:
    """A raw request record (seconds, chunk_times, chunk_tokens list) from either stored form."""
    if "chunk_gaps_us" not in rec:
        return rec  # the older form: already raw
    out = {k: v for k, v in rec.items() if k not in ("start_us", "latency_us", "chunk_gaps_us")}
    times, t = [], 0
    for g in rec["chunk_gaps_us"].split():
        t += int(g)
        times.append(t * 1e-6)
    ks = rec["chunk_tokens"]
    out["chunk_times"] = times
    out["chunk_tokens"] = [ks] * len(times) if isinstance(ks, int) else [int(k) for k in ks.split()]
    out["ttft"] = times[0] if times else None
    out["start"] = None if rec.get("start_us") is None else rec["start_us"] * 1e-6
    out["latency"] = None if rec.get("latency_us") is None else rec["latency_us"] * 1e-6
    return out


def seeded_prompts(n: int, length: int, seed: int, vocab: int = 256) -> list:
    """n token-id prompts of `length` ids in [0, vocab): bytes under our tokenizer, and ids
    that exist in any real vocabulary."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length).tolist() for _ in range(n)]


def load_prompts(path) -> list:
    """A prompts file: .jsonl with {"prompt": str or [ids]} per line, else one text per line."""
    path = Path(path)
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"prompts file {path}: no prompts in it")
    if path.suffix != ".jsonl":
        return lines
    out = []
    for i, ln in enumerate(lines, 1):
        try:
            p = json.loads(ln)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"prompts file {path}, line {i}: need {{\"prompt\": ...}}: {e}") from None
        if not (isinstance(p, str) or isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompts file {path}, line {i}: prompt must be a string or token ids")
        out.append(p)
    return out


async def get_model(session, url: str) -> str:
    """The first model id of GET /v1/models."""
    async with session.get(f"{url}/v1/models") as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/v1/models: HTTP {r.status}: {(await r.text())[:200]}")
        data = (await r.json()).get("data") or []
    if not data or "id" not in data[0]:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return data[0]["id"]


async def request_once(session, url: str, model: str, prompt, max_tokens: int,
                       keep_ids: bool = False) -> dict:
    """One streamed completion; returns its record (see the module docstring)."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    rec = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else None, "status": None,
           "error": None, "ttft": None, "latency": None, "tokens": 0, "chunk_times": [],
           "chunk_tokens": [], "usage_tokens": None, "ids_seen": 0}
    ids = []
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as r:
            rec["status"] = r.status
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:300]}"
                return rec
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = f"in-stream error: {obj['error']}"
                    break
                if obj.get("usage"):
                    rec["usage_tokens"] = obj["usage"].get("completion_tokens")
                for ch in obj.get("choices") or []:
                    tid = ch.get("token_ids")
                    k = len(tid) if tid is not None else (1 if ch.get("text") else 0)
                    if tid:
                        ids.extend(tid)
                        rec["ids_seen"] += len(tid)
                    if k:
                        t = time.perf_counter() - t0
                        if rec["ttft"] is None:
                            rec["ttft"] = t
                        rec["chunk_times"].append(t)
                        rec["chunk_tokens"].append(k)
                        rec["tokens"] += k
    except (OSError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    except Exception as e:  # aiohttp.ClientError and friends: a failed request, not a crash
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    rec["latency"] = time.perf_counter() - t0
    if rec["error"] is None and rec["ttft"] is None:
        rec["error"] = "the stream carried no token"
    if rec["usage_tokens"] is not None:
        rec["tokens"] = rec["usage_tokens"]  # exact, whatever the chunking
    if keep_ids:
        rec["token_ids"] = ids
    return rec


def count_check(rec: dict, max_tokens: int) -> str | None:
    """Why the record's token count is wrong, or None (also None when it cannot be checked)."""
    if rec["error"]:
        return None
    exact = rec["usage_tokens"] if rec["usage_tokens"] is not None else (
        rec["ids_seen"] or None)
    if rec["usage_tokens"] is not None and rec["ids_seen"] and rec["ids_seen"] != rec["usage_tokens"]:
        return f"usage says {rec['usage_tokens']} tokens, token_ids carried {rec['ids_seen']}"
    if exact is not None and exact != max_tokens:
        return f"got {exact} tokens, asked for max_tokens = {max_tokens} (ignore_eos)"
    return None


async def run_level(url: str, model: str, prompts: list, concurrency: int, n_requests: int,
                    max_tokens: int, timeout_s: float) -> tuple[list, float]:
    """n_requests requests (prompts cycled) with `concurrency` in flight; (records, wall s)."""
    import aiohttp

    todo = iter(range(n_requests))
    records = [None] * n_requests
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def worker():
            for i in todo:  # one shared iterator: a worker takes the next request when free
                start = time.perf_counter() - t0
                rec = await request_once(session, url, model, prompts[i % len(prompts)],
                                         max_tokens)
                rec["index"], rec["start"] = i, start  # start: seconds after the level began
                records[i] = rec

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
        wall = time.perf_counter() - t0
    return records, wall


def _pcts(values) -> dict | None:
    if not len(values):
        return None
    x = np.asarray(values, np.float64)
    out = {f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES}
    out["mean"] = float(x.mean())
    out["n"] = int(x.size)
    return out


def summarize_level(records: list, wall: float, max_tokens: int) -> dict:
    """The level's figures (module docstring) from its raw records."""
    ok = [r for r in records if not r["error"]]
    errors = [r for r in records if r["error"]]
    tokens = sum(r["tokens"] for r in ok)
    itl = []
    for r in ok:
        prev = r["ttft"]
        for t, k in zip(r["chunk_times"][1:], r["chunk_tokens"][1:]):
            itl.extend([(t - prev) / k] * k)
            prev = t
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    bad_counts = [(r.get("index"), why) for r in records
                  if (why := count_check(r, max_tokens)) is not None]
    checkable = sum(1 for r in ok if r["usage_tokens"] is not None or r["ids_seen"])
    return {
        "wall_s": wall,
        "ok_requests": len(ok),
        "errors": len(errors),
        "error_examples": sorted({r["error"] for r in errors})[:5],
        "tokens": tokens,
        "rates": {
            "aggregate_tokens_per_s": {"value": tokens / wall if wall > 0 else 0.0,
                                       "formula": "tokens of all ok requests / wall"},
            "request_throughput": {"value": len(ok) / wall if wall > 0 else 0.0,
                                   "formula": "ok requests / wall (requests per second)"},
        },
        "per_request_tokens_per_s": _pcts([r["tokens"] / r["latency"] for r in ok]),
        "ttft_s": _pcts([r["ttft"] for r in ok]),
        "itl_s": _pcts(itl),
        "tpot_s": _pcts(tpot),
        "token_check": {"checked": checkable, "unchecked": len(ok) - checkable,
                        "mismatches": bad_counts[:10], "n_mismatches": len(bad_counts)},
    }
