"""Training: the block drafter fitted to its target's greedy outputs (data from engine.native).

Above the native engine (it generates the data) and the drafters (it trains one); nothing below
imports it. `python -m engine.cli.drafter train` runs it.
"""
