"""The HTTP server (engine/serving/server.py) against hostile bodies and clients, over a real
socket with a fake engine: every malformed body is a JSON 4xx, and neither client errors nor
client disconnects leave a traceback in the log."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web

from engine.serving.batcher import Batcher
from engine.serving.protocol import MAX_BODY_BYTES, MAX_JSON_DEPTH, BadRequest, parse_json_body
from engine.serving.server import Server
from engine.serving.tokenizer import ByteTokenizer
from test_serve_units import FakeEngine

BODIES = [
    ('{"prompt": [1], "max_tokens": 1' + "0" * 5000 + "}", 400, "digits is out of range"),
    ('{"prompt": [1], "max_tokens": ' + "9" * 20 + "}", 400, "digits is out of range"),
    ('{"prompt": [1' + "0" * 40 + "]}", 400, "digits is out of range"),
    ("[" * 100_000 + "]" * 100_000, 400, "nested deeper than"),
    ('{"prompt": ' + "[" * (MAX_JSON_DEPTH + 1) + "1" + "]" * (MAX_JSON_DEPTH + 1) + "}", 400, "nested deeper than"),
    ('{"prompt": [1], "temperature": NaN}', 400, "NaN is not valid JSON"),
    ('{"prompt": [1], "temperature": 1e999}', 400, "out of range"),
    ('{"prompt": [1], "max_tokens": -Infinity}', 400, "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', 400, "not UTF-8"),
    ("", 400, "not valid JSON"),
    ('{"prompt": [1]', 400, "not valid JSON"),
    ('"just a string"', 400, "must be a JSON object"),
    ('{"prompt": [1], "max_tokens": 1.5}', 400, "max_tokens"),
    ('{"prompt": [1], "max_tokens": 1000000000000000000}', 400, "exceeds the context"),
    (b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}', 413, "Request Entity Too Large"),
]
# /v1/chat/completions: the same bounded parser, then its own fields.
CHAT_BODIES = [
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + "9" * 20 + "}", 400,
     "digits is out of range"),
    ('{"messages": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}", 400, "nested deeper than"),
    ('{"messages": []}', 400, "non-empty list"),
    ('{"messages": "hi"}', 400, "non-empty list"),
    ('{}', 400, "non-empty list"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages[0].role"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}', 400,
     "text only"),
    ('{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    ('{"messages": [{"role": "user", "content": ""}]}', 400, "prompt is empty"),
    ('{"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}', 400, "unknown field(s) prompt"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}', 400, "greedily only"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_completion_tokens": 3}',
     400, "differ"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens = 0"),
    ('{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}', 404, "not served here"),
]


@pytest.fixture
def server_url(caplog):
    """A served app on 127.0.0.1 in a background loop; yields (url, run) with run(coro)."""
    caplog.set_level(logging.DEBUG)
    loop = asyncio.new_event_loop()
    batcher = Batcher(FakeEngine(max_seq=1024, step_s=0.005), "ar", budget=7, max_batch=4, max_queue=4)
    batcher.start()
    runner = web.AppRunner(Server(batcher, "tiny", 512, tokenizer=ByteTokenizer(512)).app(), handler_cancellation=True, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", loop.run_until_complete
    loop.run_until_complete(runner.cleanup())
    loop.close()


def no_tracebacks(caplog):
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]


CASES = [("/v1/completions", *b) for b in BODIES] + [("/v1/chat/completions", *b) for b in CHAT_BODIES]


@pytest.mark.parametrize("path,body,status,needle", CASES,
                         ids=[f"{p.split('/')[-1]}-{i}-{n[:20]}" for i, (p, _, _, n) in enumerate(CASES)])
def test_malformed_body_is_a_json_4xx(server_url, caplog, path, body, status, needle):
    url, run = server_url

    async def post():
        async with aiohttp.ClientSession() as s:
            data = body.encode() if isinstance(body, str) else body
            async with s.post(url + path, data=data,
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.text()

    got, ctype, text = run(post())
    assert got == status and ctype.startswith("application/json"), (got, text[:300])
    err = json.loads(text)["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error", err
    no_tracebacks(caplog)


def test_client_disconnect_mid_stream_is_quiet_and_frees_the_slot(server_url, caplog):
    url, run = server_url

    async def go():
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 500, "stream": True})
            assert r.status == 200
            await r.content.readline()  # the first event arrived: decoding is under way
            r.close()  # hang up mid-stream
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as h:
                return await h.json()

    health = run(go())
    assert health["status"] == "ok" and health["stats"]["active"] == 0 and health["stats"]["in_flight"] == 0, health
    no_tracebacks(caplog)


def test_parse_json_body_bounds_without_a_server():
    assert parse_json_body(b'{"prompt": [1, 2], "max_tokens": 9223372036854775807}')["max_tokens"] == 2**63 - 1
    for raw in (b"1" * 20, b"[" * 17 + b"]" * 17, b"-Infinity", b"\xc3"):
        with pytest.raises(BadRequest):
            parse_json_body(raw)
