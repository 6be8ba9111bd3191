"""Text in, text out: a server whose weights folder holds a tokenizer.json (a byte-level BPE
trained here on a few strings, beside fresh tiny random weights) answers /v1/completions and
/v1/chat/completions with the tokenizer's text and the token ids, streamed or whole; the ids
equal the engine's greedy decode of the encoded prompt, and the streamed text chunks add up to
the decode of all ids (no character split). Fresh weights every run; failures print the seed."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request

import pytest

from bpe_helpers import TEXTS, train_tokenizer
from native_helpers import (  # noqa: F401 (fixture)
    DEVICES, fresh_tiny_weights, native, skip_cuda_without_gpu)

pytestmark = pytest.mark.native
N = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from engine.reference import model

    native()
    d, seed = fresh_tiny_weights(tmp_path_factory, "serve_text", drafter=True)
    train_tokenizer(d / "tokenizer.json", vocab_size=model.tiny_config().vocab_size - 40)
    return d, seed


async def _post(url, path, body):
    """(status, whole JSON) or, streamed, (status, [chunks])."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            if not body.get("stream"):
                return r.status, await r.json()
            chunks = []
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunks.append(json.loads(line[5:]))
            return r.status, chunks


@pytest.mark.parametrize("device", DEVICES)
def test_text_completions_and_chat(folder, tmp_path_factory, device):
    from bench.service import ServerProcess
    from engine.native.engine import Engine
    from engine.serving.tokenizer import load_tokenizer

    d, seed = folder
    log = tmp_path_factory.mktemp(f"serve_text_{device}") / "server.log"
    with Engine(d, device=device) as eng:
        tok = load_tokenizer(d, eng.vocab_size)
        prompt = TEXTS[0][:40]
        want = eng.generate([tok.encode(prompt)], N, mode="ar").tokens[0].tolist()
        chat_text = TEXTS[1][:30] + TEXTS[2][:20]
        want_chat = eng.generate([tok.encode(chat_text)], N, mode="ar").tokens[0].tolist()
    why = f"weights seed {seed}, {device}"
    with ServerProcess(d, "ddtree", 7, device, 2, 2, log,
                       extra=("--served-model-name", "code")) as srv:
        with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as r:
            health = json.loads(r.read())
        assert health["tokenizer"] == "bpe", health

        status, body = asyncio.run(_post(srv.url, "/v1/completions",
                                         {"prompt": prompt, "max_tokens": N}))
        assert status == 200, body
        ch = body["choices"][0]
        assert ch["token_ids"] == want, why
        assert ch["text"] == tok.decode(want) and body["usage"]["prompt_tokens"] == len(tok.encode(prompt))

        status, chunks = asyncio.run(_post(srv.url, "/v1/completions", {
            "prompt": prompt, "max_tokens": N, "stream": True,
            "stream_options": {"include_usage": True}}))
        assert status == 200
        ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
        assert ids == want and text == tok.decode(want), why
        assert chunks[-1]["usage"]["completion_tokens"] == N

        msgs = [{"role": "system", "content": TEXTS[1][:30]},
                {"role": "user", "content": [{"type": "text", "text": TEXTS[2][:20]}]}]
        status, body = asyncio.run(_post(srv.url, "/v1/chat/completions",
                                         {"messages": msgs, "max_completion_tokens": N}))
        assert status == 200, body
        ch = body["choices"][0]
        assert body["object"] == "chat.completion" and ch["token_ids"] == want_chat, why
        assert ch["message"] == {"role": "assistant", "content": tok.decode(want_chat)}

        status, chunks = asyncio.run(_post(srv.url, "/v1/chat/completions",
                                           {"messages": msgs, "max_tokens": N, "stream": True}))
        assert status == 200 and all(c["object"] == "chat.completion.chunk" for c in chunks)
        deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
        assert deltas[0]["role"] == "assistant"
        assert "".join(dl.get("content", "") for dl in deltas) == tok.decode(want_chat)
        assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == want_chat
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        status, body = asyncio.run(_post(srv.url, "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": ""}]}))
        assert status == 400 and "empty" in body["error"]["message"], body


def test_a_broken_tokenizer_json_stops_the_server_with_a_clear_error(folder, tmp_path):
    import subprocess
    import sys

    from bench import REPO_ROOT

    d = tmp_path / "w"
    shutil.copytree(folder[0], d)
    (d / "tokenizer.json").write_text('{"model": {"type": "WordPiece"}}')
    r = subprocess.run([sys.executable, "-m", "engine.serving", "--weights", str(d), "--mode",
                        "ar", "--port", "0"], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 5, r.stderr
    assert "tokenizer" in r.stderr and "tokenizer.json" in r.stderr, r.stderr
