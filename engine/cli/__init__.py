"""Commands that cut across the layers, at the top of the stack (each `python -m engine.cli.X`).

- `model`: `init` writes a target's weights and its block drafter's; `check` prints its logit spread.
- `decode`: AR vs DDTree with the float64 reference model, checking the tokens agree.
- `drafter`: `train` fits the block drafter to the target's greedy outputs.
"""
