"""The request side of the OpenAI-compatible API: bounded JSON bodies and the checks of the
completions and chat completions bodies (greedy only, errors naming the field).

    body = parse_json_body(raw)                                   # BadRequest on bad bytes
    req = parse_completion(body, vocab_size, tokenizer, "tiny")   # /v1/completions
    req = parse_chat(body, vocab_size, tokenizer, "tiny")         # /v1/chat/completions
    # req: {"prompt": [ids], "max_tokens", "stream", "usage_chunk"}

Chat: our models are plain language models without a chat template, so the prompt is the
messages' text contents concatenated in order (`chat_prompt`: roles only choose what is
accepted, they add no text), and the reply is the greedy continuation of it. A chat request
therefore needs the model's tokenizer (text in, text out).
"""

from __future__ import annotations

import json

from engine.jsondepth import json_depth

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 4 << 20  # a completion request is a prompt: 4 MiB is ~a million token ids
MAX_JSON_DEPTH = 16       # the deepest valid body is 5 levels (messages: [{content: [{text}]}])
MAX_INT_DIGITS = 19       # integers within int64; a 5,000-digit max_tokens is a 400, not a 500

# Fields that must hold their greedy value (or be absent / null): name -> allowed values.
GREEDY_ONLY = {
    "temperature": (0, 0.0), "top_p": (1, 1.0), "top_k": (-1, 0, 1), "min_p": (0, 0.0),
    "n": (1,), "best_of": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "echo": (False,), "logprobs": (), "suffix": (),
    "use_beam_search": (False,),
}
CHAT_GREEDY_ONLY = {**{k: v for k, v in GREEDY_ONLY.items() if k not in ("echo", "suffix",
                                                                          "best_of")},
                    "logprobs": (False,), "top_logprobs": (), "tools": (), "tool_choice": (),
                    "response_format": ()}
# Fields accepted and ignored: they do not change greedy output without an EOS token.
IGNORED = {"user", "seed", "ignore_eos", "min_tokens", "skip_special_tokens",
           "spaces_between_special_tokens", "return_token_ids", "stop_token_ids", "stop",
           "logit_bias"}
KNOWN = {"model", "prompt", "max_tokens", "stream", "stream_options"} | set(GREEDY_ONLY) | IGNORED
CHAT_KNOWN = ({"model", "messages", "max_tokens", "max_completion_tokens", "stream",
               "stream_options"} | set(CHAT_GREEDY_ONLY) | IGNORED)
ROLES = ("system", "developer", "user", "assistant")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


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


def _common(body, known: set, greedy: dict, model_name: str) -> None:
    """The checks both endpoints make: an object, no unknown field, the served model, greedy."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} is not served here (this server has {model_name!r})",
                         "model", 404, "model_not_found")
    for name, allowed in greedy.items():
        v = body.get(name)
        if v is not None and not any(_same(v, a) for a in allowed):
            raise BadRequest(f"{name} = {v!r}: this server decodes greedily only "
                             f"(allowed: {', '.join(map(repr, allowed)) or 'null'})", name)
    stop = body.get("stop")
    if stop not in (None, "", []):
        raise BadRequest(f"stop = {stop!r}: stop sequences are not supported", "stop")


def _rest(body, ids, prompt_field: str, max_tokens_field: str = "max_tokens") -> dict:
    """max_tokens, stream and stream_options of a checked body, with the prompt ids."""
    if not ids:
        raise BadRequest(f"{prompt_field}: the prompt is empty (need at least one token)",
                         prompt_field)
    max_tokens = body.get(max_tokens_field)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"{max_tokens_field} = {max_tokens!r}: need an integer >= 1",
                         max_tokens_field)
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


def parse_completion(body, vocab_size: int, tokenizer, model_name: str) -> dict:
    """Checks a /v1/completions body; returns {prompt (ids), max_tokens, stream, usage_chunk}.
    Raises BadRequest naming the field."""
    _common(body, KNOWN, GREEDY_ONLY, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest(f"text prompts need a tokenizer.json beside the weights or a "
                             f"vocabulary of >= 256 tokens (this model has {vocab_size}); send "
                             "token ids", "prompt")
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
    return _rest(body, ids, "prompt")


def chat_prompt(messages) -> str:
    """The prompt text of a chat request: the messages' contents in order (module docstring).
    A content is a string or a list of {"type": "text", "text": str} parts."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects",
                         "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise BadRequest(f"messages[{i}] must be an object with role and content (and an "
                             "optional name)", "messages")
        if m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role = {m.get('role')!r}: need one of "
                             f"{', '.join(ROLES)}", "messages")
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str)
                                         and set(p) <= {"type", "text"} for p in c):
            out.extend(p["text"] for p in c)
        else:
            raise BadRequest(f"messages[{i}].content must be a string or a list of "
                             '{"type": "text", "text": ...} parts (text only)', "messages")
    return "".join(out)


def parse_chat(body, vocab_size: int, tokenizer, model_name: str) -> dict:
    """Checks a /v1/chat/completions body; returns what parse_completion returns (the prompt:
    chat_prompt's text, encoded). max_completion_tokens is max_tokens' newer name."""
    _common(body, CHAT_KNOWN, CHAT_GREEDY_ONLY, model_name)
    if tokenizer is None:
        raise BadRequest(f"chat needs text: this model has no tokenizer.json and a vocabulary "
                         f"of {vocab_size} < 256 tokens; use /v1/completions with token ids",
                         "messages")
    ids = tokenizer.encode(chat_prompt(body.get("messages")))
    both = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(both) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise BadRequest("max_tokens and max_completion_tokens differ: send one",
                         "max_completion_tokens")
    return _rest(body, ids, "messages", both[-1] if both else "max_tokens")
