"""The server (`python -m engine.serving`, CPU backend, tiny model) against clients on 127.0.0.1:
served tokens == the engine's direct greedy output (AR and DDTree), the load generator against
it, the `service` suite (its own server, and --url), bad requests, disconnecting clients and an
overload burst. Fresh random weights and prompts every run; failures print the seed.

No test here depends on how fast this machine decodes: where a test needs requests that do not
finish (an overload burst, disconnecting clients), it pauses the server's decode steps through
--debug-hooks (POST /debug/pause: admissions and cancellations go on, nothing finishes) and
resumes them afterwards. Waits are bounded polls for a state, never sleeps of a guessed length."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
import urllib.request

import numpy as np
import pytest

from native_helpers import (  # noqa: F401 (fixtures)
    cuda_ready, fresh_tiny_weights, native, skip_cuda_without_gpu)

pytestmark = pytest.mark.native

MAX_BATCH, MAX_QUEUE, BUDGET = 4, 2, 7
MAX_SEQ = 4096
LONG = 4000  # tokens of a request that must not finish while the test watches (paused anyway)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    native()  # builds / locates libkdtree.so and sets KDTREE_LIB for the servers too
    return fresh_tiny_weights(tmp_path_factory, "serve_weights", drafter=True)


def _server(weights, mode, tmp_path_factory, device="cpu"):
    from bench.service import ServerProcess

    log = tmp_path_factory.mktemp(f"serve_{mode}_{device}") / "server.log"
    return ServerProcess(weights[0], mode, BUDGET, device, MAX_BATCH, MAX_QUEUE, log,
                         extra=("--served-model-name", "tiny", "--max-seq", str(MAX_SEQ),
                                "--debug-hooks"))


@pytest.fixture(scope="module")
def ar_server(weights, tmp_path_factory):
    with _server(weights, "ar", tmp_path_factory) as srv:
        yield srv


@pytest.fixture(scope="module")
def ddtree_server(weights, tmp_path_factory):
    with _server(weights, "ddtree", tmp_path_factory) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(weights):
    from engine.native.engine import Engine

    with Engine(weights[0], device="cpu") as eng:
        yield eng


def post(url, body, timeout=120):
    """(status, parsed JSON body) of POST url/v1/completions; the body may be raw bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def health(url):
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        return json.loads(r.read())


def debug_post(url, what):
    """POST url/debug/<what> (pause | resume); returns the counters it answers with."""
    req = urllib.request.Request(f"{url}/debug/{what}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["stats"]


@contextlib.contextmanager
def decode_paused(url):
    """The server's decode steps held for the with-block (resumed even when the test fails, so
    the module's shared server stays usable). Starts from an idle server, so that capacity
    counts in the block are exact."""
    wait_for(lambda: health(url)["stats"]["in_flight"] == 0, "the server to be idle")
    debug_post(url, "pause")
    try:
        yield
    finally:
        debug_post(url, "resume")


def wait_for(pred, what, timeout=120.0):
    """Polls pred() (bounded); returns its last truthy value or fails naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}")


async def _complete_all(url, prompts, n):
    """All prompts at once; even ones streamed, odd ones whole. Returns the token id lists."""
    import aiohttp

    from bench.service_load import request_once

    async def whole(s, p):
        async with s.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": n}) as r:
            body = await r.json()
            assert r.status == 200, body
            return body["choices"][0]["token_ids"]

    async def streamed(s, p):
        rec = await request_once(s, url, "tiny", p, n, keep_ids=True)
        assert rec["error"] is None, rec["error"]
        return rec["token_ids"]

    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(streamed(s, p) if i % 2 == 0 else whole(s, p)
                                      for i, p in enumerate(prompts)))


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_served_tokens_equal_engine_greedy(mode, weights, engine, request):
    srv = request.getfixturevalue(f"{mode}_server")
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    n = 12
    prompts = [rng.integers(0, engine.vocab_size, size=int(rng.integers(1, 40))).tolist()
               for _ in range(6)]  # 6 > MAX_BATCH: two have to wait and join later
    served = asyncio.run(_complete_all(srv.url, prompts, n))
    direct = engine.generate(prompts, n, mode="ar").tokens
    for i, (s, d) in enumerate(zip(served, direct)):
        assert s == d.tolist(), (f"weights seed {weights[1]}, prompt seed {seed}, {mode}: "
                                 f"prompt {i} served {s} != engine {d.tolist()}")
    # A text prompt goes through the byte tokenizer: the same as its UTF-8 bytes as ids.
    status, body = post(srv.url, {"prompt": "héllo", "max_tokens": 5})
    ref = engine.generate(list("héllo".encode()), 5, mode="ar").tokens.tolist()
    assert status == 200 and json.loads(body)["choices"][0]["token_ids"] == ref


@pytest.mark.cuda
def test_cuda_server_equals_cuda_engine(weights, tmp_path_factory, cuda_ready):
    """The same on the CUDA backend (DDTree server; the engine's AR decode on the GPU)."""
    from engine.native.engine import Engine

    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 512, size=int(rng.integers(1, 40))).tolist() for _ in range(6)]
    with _server(weights, "ddtree", tmp_path_factory, device="cuda") as srv:
        served = asyncio.run(_complete_all(srv.url, prompts, 12))
    with Engine(weights[0], device="cuda") as eng:
        direct = eng.generate(prompts, 12, mode="ar").tokens
    for i, (s, d) in enumerate(zip(served, direct)):
        assert s == d.tolist(), (f"weights seed {weights[1]}, prompt seed {seed}: prompt {i} "
                                 f"served {s} != CUDA engine {d.tolist()}")


def test_load_generator_against_server(ar_server):
    from bench.service_load import run_level, seeded_prompts, summarize_level

    before = health(ar_server.url)["stats"]
    prompts = seeded_prompts(6, 10, secrets.randbelow(2**31))
    records, wall = asyncio.run(run_level(ar_server.url, "tiny", prompts, 3, 6, 8, 120.0))
    s = summarize_level(records, wall, 8)
    assert s["errors"] == 0, s["error_examples"]
    assert s["token_check"] == {"checked": 6, "unchecked": 0, "mismatches": [],
                                "n_mismatches": 0}
    assert s["tokens"] == 48 and s["itl_s"]["n"] == 6 * 7 and s["ttft_s"]["n"] == 6
    for r in records:
        assert 0 < r["ttft"] <= r["latency"] and sum(r["chunk_tokens"]) == 8
        assert r["chunk_times"] == sorted(r["chunk_times"])
    agg = s["rates"]["aggregate_tokens_per_s"]["value"]
    assert abs(agg - 48 / wall) <= 1e-9 * agg
    after = health(ar_server.url)["stats"]
    assert after["completed"] - before["completed"] == 6 and after["active"] == 0


def test_load_generator_counts_wrong_token_counts():
    from bench.service_load import count_check

    rec = {"error": None, "usage_tokens": 7, "ids_seen": 7}
    assert "got 7 tokens" in count_check(rec, 8)
    assert "usage says 8" in count_check({**rec, "usage_tokens": 8}, 8)
    assert count_check({**rec, "usage_tokens": None, "ids_seen": 0}, 8) is None  # uncheckable


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": "x", "temperature": 0.8}, 400, "temperature"),
    ({"prompt": "x", "n": 3}, 400, "n"),
    ({"prompt": [1, 10**6]}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [1] * 100, "max_tokens": MAX_SEQ - 100}, 400, "max_tokens"),  # beyond the context
    ({"prompt": "x", "model": "gpt-17"}, 404, "model"),
])
def test_bad_requests_get_json_errors(ar_server, body, status, param):
    got, raw = post(ar_server.url, body)
    err = json.loads(raw)["error"]
    assert got == status and err["param"] == param and err["message"], err


def test_unknown_paths_and_methods_are_json(ar_server):
    for method, path, status in [("GET", "/v1/chat", 404), ("GET", "/v1/completions", 405)]:
        req = urllib.request.Request(f"{ar_server.url}{path}", method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == status and "error" in json.loads(e.value.read())
    with urllib.request.urlopen(f"{ar_server.url}/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"


def _open_stream(url, max_tokens):
    """A raw streaming request; returns the socket after the first SSE chunk arrived."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, f"the server closed the stream early: {got!r}"
        got += chunk
    return s


def test_disconnecting_clients_free_their_slots(ar_server):
    """Paused, so none of these requests can finish however fast the engine is: two streams
    that disconnect after their first chunk and a whole request whose client gives up must all
    be cancelled, and their slots freed while still paused."""
    url = ar_server.url
    with decode_paused(url):
        before = health(url)["stats"]
        socks = [_open_stream(url, LONG) for _ in range(2)]
        assert health(url)["stats"]["active"] == 2
        for s in socks:
            s.close()
        # A whole (non-streamed) request whose client gives up is freed too: it is admitted
        # (its slot taken) and never completes while paused, so the client's timeout fires.
        with pytest.raises(OSError):  # socket.timeout / URLError: the client stops waiting
            post(url, {"prompt": [4, 5], "max_tokens": LONG}, timeout=1.0)
        st = wait_for(lambda: (h := health(url)["stats"])["in_flight"] == 0 and h,
                      "the server to release the disconnected clients' slots")
        assert st["active"] == 0 and st["queued"] == 0 and st["paused"], st
        assert st["cancelled"] - before["cancelled"] == 3, st
        assert st["completed"] == before["completed"], "a disconnected request ran to its end"
        assert st["steps"] == before["steps"], "a decode step ran while paused"


def test_overload_burst_gets_429_and_server_stays_healthy(ar_server, engine, weights):
    """20 requests at once against MAX_BATCH slots + MAX_QUEUE queue places, decode paused:
    exactly MAX_BATCH + MAX_QUEUE are accepted (the admission count is exact, whatever the
    arrival order or speed), the other 14 get 429 at once, /health answers meanwhile; after
    resume the accepted ones complete with the engine's greedy tokens."""
    import aiohttp

    url = ar_server.url
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    n_burst, n_tokens = 20, 8
    prompts = [rng.integers(0, engine.vocab_size, size=int(rng.integers(1, 12))).tolist()
               for _ in range(n_burst)]
    accepted = MAX_BATCH + MAX_QUEUE

    async def burst():
        async with aiohttp.ClientSession() as s:
            async def one(p):
                async with s.post(f"{url}/v1/completions",
                                  json={"prompt": p, "max_tokens": n_tokens}) as r:
                    return r.status, await r.json(), r.headers.get("Retry-After")

            async def stats():
                async with s.get(f"{url}/health") as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["stats"]

            before = await stats()
            tasks = [asyncio.ensure_future(one(p)) for p in prompts]
            # Every request has had its admission decision once requests + rejected grew by 20.
            deadline = time.monotonic() + 120
            while True:
                st = await stats()
                if (st["requests"] - before["requests"]) + (st["rejected"] - before["rejected"]) \
                        == n_burst and st["active"] == MAX_BATCH:
                    break
                assert time.monotonic() < deadline, f"seed {seed}: burst not admitted: {st}"
                await asyncio.sleep(0.05)
            held = dict(st)
            assert not any(t.done() and t.result()[0] == 200 for t in tasks), \
                "a request completed while decoding was paused"
            await asyncio.get_running_loop().run_in_executor(None, debug_post, url, "resume")
            return before, held, await asyncio.gather(*tasks)

    with decode_paused(url):
        before, held, out = asyncio.run(burst())
    codes = [c for c, _, _ in out]
    assert codes.count(200) == accepted and codes.count(429) == n_burst - accepted, \
        f"seed {seed}: {codes}"
    assert held["in_flight"] == accepted and held["queued"] == MAX_QUEUE, held
    assert held["rejected"] - before["rejected"] == n_burst - accepted, held
    ok = [i for i, c in enumerate(codes) if c == 200]
    direct = engine.generate([prompts[i] for i in ok], n_tokens, mode="ar").tokens
    for i, d in zip(ok, direct):
        got = out[i][1]["choices"][0]["token_ids"]
        assert got == d.tolist(), (f"weights seed {weights[1]}, prompt seed {seed}: "
                                   f"request {i} served {got} != engine {d.tolist()}")
    for c, body, retry in out:
        if c == 429:
            assert body["error"]["code"] == "overloaded" and retry == "1", body
    assert health(url)["status"] == "ok"
    # Capacity is back: a request after the burst is served, with the engine's tokens.
    status, raw = post(url, {"prompt": [3, 1, 4], "max_tokens": 6})
    ref = engine.generate([3, 1, 4], 6, mode="ar").tokens.tolist()
    assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == ref


def test_service_suite_with_its_own_server_and_with_url(ar_server, tmp_path, monkeypatch):
    """`python -m bench --suite service` (the harness) starting its own AR server, then the
    same suite measuring the running server through --url."""
    import bench

    # max_batch 1 below the level of 3: the suite's server must queue the excess, not 429 it.
    args = {"modes": "ar", "concurrency": "1,3", "requests": 3, "max_tokens": 6,
            "prompt_tokens": 8, "max_batch": 1, "models": "tiny"}
    for url in (None, ar_server.url):
        ctx = bench.Context(out_dir=tmp_path / str(bool(url)), devices=["cpu"],
                            args={**args, "url": url})
        (outcome,) = bench.run_suites(["service"], ctx)
        doc = json.loads(outcome.json_path.read_text())
        assert outcome.status == "ok", doc.get("error") or doc.get("traceback")
        assert [r["case"]["concurrency"] for r in doc["results"]] == [1, 3]
        for r in doc["results"]:
            assert r["backend"] == ("url" if url else "ar/cpu")
            assert ("url" in r["case"]) == bool(url), "our server's free port must not key records"
            assert r["errors"] == 0 and r["tokens"] == 18 and len(r["requests"]) == 3
            assert r["validation"]["ok"] and r["validation"]["token_check"]["checked"] == 3
            if not url:
                assert r["validation"]["engine_check"]["ok"]
        assert "TTFT p50 ms" in (tmp_path / str(bool(url)) / "service.txt").read_text()
