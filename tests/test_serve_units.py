"""Server pieces without the native engine: the byte and BPE tokenizers, request parsing of
completions and chat (greedy only, errors naming the field) and the continuous-batching worker
over a fake engine."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.serving.batcher import Batcher, Overloaded, Unavailable
from engine.serving.protocol import BadRequest, parse_chat, parse_completion
from engine.serving.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from bpe_helpers import TEXTS, train_tokenizer

VOCAB = 512
TOK = ByteTokenizer(VOCAB)


# ------------------------------------------------------------------ tokenizer

@settings(max_examples=100, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert all(0 <= t < 256 for t in ids)
    assert TOK.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1), st.data())
def test_stream_decoder_any_split_equals_whole(text, data):
    """Chunks split inside multi-byte characters still decode to the whole text."""
    ids = TOK.encode(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    dec, out, prev = TOK.stream_decoder(), [], 0
    for c in cuts + [len(ids)]:
        out.append(dec.feed(ids[prev:c]))
        prev = c
    out.append(dec.feed([], final=True))
    assert "".join(out) == text


def test_tokenizer_non_byte_ids_and_small_vocab():
    assert TOK.decode([104, 300, 105]) == "h<|300|>i"
    with pytest.raises(ValueError, match="vocab_size = 100"):
        ByteTokenizer(100)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tokenizers import Tokenizer

    path = train_tokenizer(tmp_path_factory.mktemp("bpe") / "tokenizer.json")
    return BPETokenizer(path, VOCAB), Tokenizer.from_file(str(path)), path


def test_bpe_round_trip_and_agrees_with_the_library(bpe):
    tok, lib, _ = bpe
    for text in TEXTS + ["", "x", "\x00\t\r\n", "never seen: \u00e6\u00f8\u00e5 \U0001f600 \u0915\u094d\u0937"]:
        ids = tok.encode(text)
        assert ids == lib.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode()) / 2  # merges learned: not bytes
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    n = lib.get_vocab_size()
    for _ in range(300):  # any ids, invalid UTF-8 and special tokens included
        ids = rng.integers(0, n, size=int(rng.integers(0, 12))).tolist()
        assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=False), (seed, ids)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1), st.data())
def test_bpe_stream_any_split_equals_whole(bpe_tok, text, data):
    """Chunks split anywhere (inside characters too: a token may end mid-character) decode to
    the whole text."""
    ids = bpe_tok.encode(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    dec, out, prev = bpe_tok.stream_decoder(), [], 0
    for c in cuts + [len(ids)]:
        out.append(dec.feed(ids[prev:c]))
        prev = c
    out.append(dec.feed([], final=True))
    assert "".join(out) == text


@pytest.fixture(scope="module")
def bpe_tok(bpe):
    return bpe[0]


def test_bpe_ids_beyond_the_tokenizer_and_bad_files(bpe, tmp_path):
    tok, lib, path = bpe
    n = lib.get_vocab_size()
    assert tok.decode(tok.encode("ab") + [n, VOCAB - 1]) == f"ab<|{n}|><|{VOCAB - 1}|>"
    with pytest.raises(ValueError, match=f"the tokenizer has {n} ids but the model's vocab_size is 100"):
        BPETokenizer(path, 100)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizers JSON file"):
        BPETokenizer(bad, VOCAB)
    import json as _json

    doc = _json.loads(path.read_text())
    doc["decoder"] = None
    bad.write_text(_json.dumps(doc))
    with pytest.raises(ValueError, match="byte-level BPE"):
        BPETokenizer(bad, VOCAB)


def test_load_tokenizer_prefers_the_folder_file(bpe, tmp_path):
    assert isinstance(load_tokenizer(tmp_path, VOCAB), ByteTokenizer)
    assert load_tokenizer(tmp_path, 100) is None
    (tmp_path / "tokenizer.json").write_bytes(bpe[2].read_bytes())
    assert isinstance(load_tokenizer(tmp_path, VOCAB), BPETokenizer)


# ------------------------------------------------------------------ request parsing

def parse(body, tokenizer=TOK):
    return parse_completion(body, VOCAB, tokenizer, "tiny")


def test_parse_accepts_text_ids_and_greedy_settings():
    r = parse({"prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 1.0, "n": 1,
               "stream": True, "stream_options": {"include_usage": True}, "model": "tiny",
               "ignore_eos": True, "seed": 3})
    assert r == {"prompt": [104, 105], "max_tokens": 5, "stream": True, "usage_chunk": True}
    r = parse({"prompt": [[1, 2, 511]]})  # a batch of one
    assert r["prompt"] == [1, 2, 511] and r["max_tokens"] == 16 and r["stream"] is False


@pytest.mark.parametrize("body, param, status", [
    ([1, 2], None, 400),
    ({}, "prompt", 400),
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": []}, "prompt", 400),
    ({"prompt": [1, 512]}, "prompt", 400),
    ({"prompt": [1, -1]}, "prompt", 400),
    ({"prompt": [1, True]}, "prompt", 400),
    ({"prompt": ["a", "b"]}, "prompt", 400),
    ({"prompt": 5}, "prompt", 400),
    ({"prompt": "x", "temperature": 0.7}, "temperature", 400),
    ({"prompt": "x", "temperature": False}, "temperature", 400),
    ({"prompt": "x", "top_p": 0.9}, "top_p", 400),
    ({"prompt": "x", "top_k": 5}, "top_k", 400),
    ({"prompt": "x", "n": 2}, "n", 400),
    ({"prompt": "x", "logprobs": 1}, "logprobs", 400),
    ({"prompt": "x", "echo": True}, "echo", 400),
    ({"prompt": "x", "stop": ["\n"]}, "stop", 400),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", 400),
    ({"prompt": "x", "stream": "yes"}, "stream", 400),
    ({"prompt": "x", "stream_options": {"foo": 1}}, "stream_options", 400),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", 400),
    ({"prompt": "x", "model": "other"}, "model", 404),
])
def test_parse_rejects_naming_the_field(body, param, status):
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert e.value.param == param and e.value.status == status, str(e.value)
    if param:
        assert param in str(e.value)


def test_parse_text_needs_a_byte_vocabulary():
    with pytest.raises(BadRequest, match="token ids"):
        parse_completion({"prompt": "x"}, 100, None, "tiny")


def test_parse_text_through_the_bpe(bpe_tok):
    r = parse({"prompt": TEXTS[0], "max_tokens": 3}, bpe_tok)
    assert r["prompt"] == bpe_tok.encode(TEXTS[0]) and len(r["prompt"]) < len(TEXTS[0])


def test_parse_chat_joins_the_messages_in_order(bpe_tok):
    msgs = [{"role": "system", "content": "# a helper\n"},
            {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"},
                                         {"type": "text", "text": "\n    return"}]}]
    r = parse_chat({"messages": msgs, "max_completion_tokens": 7, "stream": True,
                    "temperature": 0, "logprobs": False, "model": "tiny"}, VOCAB, bpe_tok, "tiny")
    assert r == {"prompt": bpe_tok.encode("# a helper\ndef add(a, b):\n    return"),
                 "max_tokens": 7, "stream": True, "usage_chunk": False}
    r = parse_chat({"messages": msgs[1:], "max_tokens": 4, "max_completion_tokens": 4}, VOCAB,
                   bpe_tok, "tiny")
    assert r["max_tokens"] == 4


@pytest.mark.parametrize("body, param, status", [
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs", 400),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", 400),
    ({"messages": [{"role": "user", "content": "x"}], "echo": False}, "echo", 400),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", 400),
    ({"messages": [{"role": "user"}]}, "messages", 400),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages", 400),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", 400),
    ({"messages": None}, "messages", 400),
])
def test_parse_chat_rejects_naming_the_field(bpe_tok, body, param, status):
    with pytest.raises(BadRequest) as e:
        parse_chat(body, VOCAB, bpe_tok, "tiny")
    assert e.value.param == param and e.value.status == status, str(e.value)
    assert param in str(e.value)


def test_parse_chat_needs_a_tokenizer():
    with pytest.raises(BadRequest, match="chat needs text"):
        parse_chat({"messages": [{"role": "user", "content": "x"}]}, 100, None, "tiny")


# ------------------------------------------------------------------ batcher over a fake engine

class FakeEngine:
    """The step API of engine.native.Engine with a known token stream: a slot's tokens are
    t0 = sum(prompt) % 97, then t_{i+1} = (7 t_i + 3) % 101; a step adds 1 token (ar) or 3
    (ddtree). Records each step's slots. With hold_at=k, step number k (0-based) waits for
    `gate` (an Event) before it runs: a test can act while the worker is known to be mid-decode."""

    def __init__(self, max_slots=4, max_seq=1024, step_s=0.002, hold_at=None):
        self.max_slots, self.max_seq, self.device = max_slots, max_seq, "cpu"
        self.step_s, self.toks, self.prompts = step_s, {}, {}
        self.log, self.released = [], []
        self.hold_at, self.gate, self.holding = hold_at, threading.Event(), threading.Event()

    @staticmethod
    def stream(prompt, n):
        t, out = sum(prompt) % 97, []
        for _ in range(n):
            out.append(t)
            t = (7 * t + 3) % 101
        return out

    def add(self, prompt):
        slot = min(s for s in range(self.max_slots) if s not in self.toks)
        self.prompts[slot], self.toks[slot] = prompt, self.stream(prompt, 1)
        return slot

    def tokens(self, slot):
        return list(self.toks[slot])

    def step(self, mode, budget, drafter):
        if len(self.log) == self.hold_at:
            self.holding.set()
            assert self.gate.wait(60), "FakeEngine: the test never opened the gate"
        time.sleep(self.step_s)
        self.log.append(sorted(self.toks))
        for slot, out in self.toks.items():
            self.toks[slot] = self.stream(self.prompts[slot], len(out) + (1 if mode == "ar" else 3))
        return {}

    def release(self, slot):
        del self.toks[slot], self.prompts[slot]
        self.released.append(slot)


async def collect(job):
    out = []
    while True:
        kind, value = await job.queue.get()
        if kind != "tokens":
            return out, kind, value
        out.extend(value)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_batcher_joins_at_step_boundaries_and_trims(mode):
    seed = secrets.randbelow(1000)
    eng = FakeEngine(hold_at=2)  # the third step waits: A is mid-decode, however slow we are
    b = Batcher(eng, mode, budget=7, max_batch=4, max_queue=2)
    b.start()

    async def main():
        loop = asyncio.get_running_loop()
        a = b.submit([seed, 1], 400, loop)
        first = []
        while len(first) < 3:  # A is decoding: C joins mid-flight
            kind, value = await a.queue.get()
            first.extend(value)
        await loop.run_in_executor(None, eng.holding.wait, 60)
        c = b.submit([seed, 2], 10, loop)
        eng.gate.set()
        rest_a, ka, _ = await collect(a)
        out_c, kc, _ = await collect(c)
        return first + rest_a, ka, out_c, kc

    try:
        out_a, ka, out_c, kc = asyncio.run(main())
    finally:
        b.stop()
    assert (ka, kc) == ("done", "done"), f"seed {seed}"
    assert out_a == FakeEngine.stream([seed, 1], 400), f"seed {seed}: A's tokens"
    assert out_c == FakeEngine.stream([seed, 2], 10), f"seed {seed}: C's tokens (trimmed)"
    joint = [s for s in eng.log if len(s) == 2]
    assert joint, f"seed {seed}: no step ever carried both requests: {eng.log[:5]}"
    assert eng.log[:3] == [[0]] * 3 and eng.log[3] == [0, 1], f"seed {seed}: {eng.log[:5]}"
    assert eng.log[0] == [0] and not eng.toks, "slots must be released when requests end"
    st = b.stats()
    assert st["completed"] == 2 and st["active"] == 0 and st["tokens"] == 410


def test_batcher_overload_cancel_and_stop():
    eng = FakeEngine(max_slots=2, step_s=0.005)
    b = Batcher(eng, "ar", max_batch=2, max_queue=1)
    b.start()
    b.pause()  # nothing finishes until resume(): the capacity check below cannot race a step

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [b.submit([i], 200, loop) for i in range(3)]  # 2 slots + 1 queued
        with pytest.raises(Overloaded, match="queued"):
            b.submit([9], 5, loop)
        await jobs[0].queue.get()  # job 0 is active (admitted, first token sent; paused)
        b.cancel(jobs[0])
        b.cancel(jobs[2])  # still queued (or just admitted into job 0's slot): freed either way
        b.resume()
        out1, k1, _ = await collect(jobs[1])
        return k1, out1

    try:
        k1, out1 = asyncio.run(main())
        assert k1 == "done" and out1 == FakeEngine.stream([1], 200)
        st = b.stats()
        assert st["cancelled"] == 2 and st["completed"] == 1 and st["rejected"] == 1
        assert st["active"] == 0 and not eng.toks, f"cancelled slots not freed: {eng.toks}"
    finally:
        b.stop()
    assert not b.alive()

    async def after_stop():
        b.submit([1], 5, asyncio.get_running_loop())

    with pytest.raises(Unavailable):
        asyncio.run(after_stop())


@pytest.mark.parametrize("max_batch, max_queue", [(1, 0), (2, 1), (3, 3), (4, 0)])
def test_batcher_admits_exactly_capacity_while_paused(max_batch, max_queue):
    """Paused: admissions go on (first tokens sent), no step runs, nothing finishes, and
    exactly max_batch + max_queue of a burst are accepted; after resume all of them complete
    with their own tokens and the counters balance."""
    seed = secrets.randbelow(1000)
    eng = FakeEngine(max_slots=max_batch)
    b = Batcher(eng, "ddtree", budget=7, max_batch=max_batch, max_queue=max_queue)
    b.start()
    b.pause()
    n = max_batch + max_queue + 3

    async def main():
        loop = asyncio.get_running_loop()
        jobs, rejected = [], 0
        for i in range(n):
            try:
                jobs.append(b.submit([seed, i], 5, loop))
            except Overloaded:
                rejected += 1
        firsts = [await j.queue.get() for j in jobs[:max_batch]]  # admitted while paused
        st = b.stats()
        b.resume()
        return jobs, rejected, firsts, st, [await collect(j) for j in jobs]

    try:
        jobs, rejected, firsts, held, outs = asyncio.run(main())
    finally:
        b.stop()
    assert len(jobs) == max_batch + max_queue and rejected == n - len(jobs), f"seed {seed}"
    assert all(kind == "tokens" for kind, _ in firsts)
    assert held["steps"] == 0 and held["completed"] == 0 and held["paused"], held
    assert held["in_flight"] == len(jobs) and held["queued"] == max_queue, held
    for i, (toks, kind, _) in enumerate(outs):
        first = firsts[i][1] if i < max_batch else []
        assert kind == "done" and first + toks == FakeEngine.stream([seed, i], 5), \
            f"seed {seed}: job {i}"
    st = b.stats()
    assert st["completed"] == len(jobs) and st["rejected"] == rejected and st["in_flight"] == 0


def test_batcher_engine_failure_fails_the_batch_and_keeps_serving():
    class Flaky(FakeEngine):
        fail_once = True

        def step(self, mode, budget, drafter):
            if self.fail_once:
                self.fail_once = False
                raise RuntimeError("device fell over")
            return super().step(mode, budget, drafter)

    eng = Flaky()
    b = Batcher(eng, "ar", max_batch=4, max_queue=4)
    b.start()

    async def main():
        loop = asyncio.get_running_loop()
        bad = await collect(b.submit([1], 5, loop))
        good = await collect(b.submit([2], 5, loop))
        return bad, good

    try:
        bad, good = asyncio.run(main())
    finally:
        b.stop()
    assert bad[1] == "error" and "device fell over" in bad[2]
    assert good[1] == "done" and good[0] == FakeEngine.stream([2], 5)
    assert b.stats()["failed"] == 1 and not eng.toks


def test_batcher_rejects_prompts_beyond_the_context():
    b = Batcher(FakeEngine(max_seq=64), "ddtree", budget=15, max_batch=4, max_queue=4)
    with pytest.raises(ValueError, match="exceeds the context of 64"):
        b.submit(list(range(40)), 10, None)  # 40 + 10 + 16 > 64


def test_service_suite_sizes_slots_for_its_requests():
    """The suite's server gets cache rows for the longest prompt (text in UTF-8 bytes) +
    max_tokens + the tree width, never fewer than the server's default 1024."""
    from bench.service import slot_rows

    n = secrets.randbelow(2000) + 1
    prompts = [[1] * 40, "h\u00e9llo" * 20]  # 120 bytes: the text is the longest
    assert slot_rows(prompts, n, "ddtree", 63) == max(1024, 120 + n + 64), f"n = {n}"
    assert slot_rows(prompts, n, "ar", 63) == max(1024, 120 + n + 1), f"n = {n}"


def test_round_budget_shrinks_with_the_batch():
    """round_tokens: the budget halves along 2^k - 1 while requests x (B + 1) exceeds it, down
    to 3, then 0 (AR steps); round_tokens 0 keeps the budget."""
    from engine.serving.batcher import Batcher

    class E:
        max_slots = 64

    b = Batcher(E(), "ddtree", budget=63, max_batch=64, round_tokens=128)
    assert [b.step_budget(n) for n in (1, 2, 3, 4, 8, 16, 32, 33, 64)] == \
        [63, 63, 31, 31, 15, 7, 3, 0, 0]
    assert [Batcher(E(), "ddtree", budget=15, max_batch=64, round_tokens=64).step_budget(n)
            for n in (1, 4, 5, 8, 16, 17, 32)] == [15, 15, 7, 7, 3, 0, 0]
    assert Batcher(E(), "ddtree", budget=15, max_batch=64).step_budget(64) == 15
    with pytest.raises(ValueError, match="round_tokens"):
        Batcher(E(), "ddtree", budget=15, max_batch=64, round_tokens=-1)
