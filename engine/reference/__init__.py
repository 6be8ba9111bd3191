"""The golden: float64 numpy, readable, no cleverness; imports nothing else of `engine`.

- `ddtree`: the DDTree tree build and greedy accept walk (shared/DDTREE.md, exactly).
- `mla`: absorbed-MLA tree-verify attention and the log-sum-exp merge of attention states.
- `model`, `model_ops`: the DeepSeek-V3-style MLA + MoE decoder, its config and weights format.
- `decode`: greedy AR and DDTree decoding with that model (one request; AR == DDTree).
"""
