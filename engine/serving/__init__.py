"""Serving: the OpenAI-compatible HTTP server, its continuous batcher and the byte tokenizer.

`python -m engine.serving --weights DIR ...` starts the server (docs/SERVING.md).
"""
