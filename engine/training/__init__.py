"""Training: the code-small target on real text and the block drafter fitted to a target.

- code_model: the timed run behind `python -m engine.cli.model train` (docs/TRAINING.md):
  corpus -> tokenizer -> target -> drafter -> tau, and its train.json record.
- corpus: the stdlib corpus, its split by file and digest, prompts cut from its files.
- bpe: the byte-level BPE (tokenizer.json; engine.text loads it).
- target: the MLA + MoE target in torch (the reference's function) and its export.
- drafter: the block drafter trained on its target's greedy outputs (data from engine.native).
- progress: a rich bar or plain lines for the loops.

Above the native engine (it generates the drafter's data) and the drafters (it trains one);
nothing below imports it. `python -m engine.cli.drafter train` runs the drafter alone.
"""
