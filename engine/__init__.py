"""kdtree-engine: DDTree speculative decoding for MLA + MoE models.

Reference (numpy) in `engine.ddtree` / `engine.mla` / `engine.model`, native bindings in
`engine.native`, orchestration in `engine.remote`.
"""

__version__ = "0.1.0"
