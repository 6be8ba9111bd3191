"""KDTR bundles: safetensors files that carry one kernel case (inputs, expected outputs, metadata).

- `bundle`: the container (save, load, strict header checks).
- `cases`: the golden cases, computed by engine.reference.
`python -m engine.kdtr generate --out DIR` writes them (docs/REFERENCE.md).
"""
