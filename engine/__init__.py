"""kdtree-engine: DDTree speculative decoding for MLA + MoE models.

Packages, from the bottom up; imports point down only (the import-linter contract in
pyproject.toml checks it):

- `jsondepth`: JSON nesting counted without parsing (untrusted input), for the server and remote.
- `reference`: the float64 numpy golden (DDTree, MLA attention, the model, greedy decode).
- `kdtr`, `baselines`: KDTR bundles and golden cases; other systems' paths for head-to-heads.
- `drafters`: the drafter interface, the noisy oracle, the block drafter network.
- `native`: ctypes bindings to libkdtree.so and the native Engine (the decode round).
- `training`, `serving`: drafter training; the OpenAI-compatible server.
- `cli`: commands that cut across the layers.
- `remote`: the orchestration; runs the rest on hosts as commands, imports none of it.
"""

__version__ = "0.1.0"
