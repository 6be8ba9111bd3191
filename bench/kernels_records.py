"""What the `kernels` suite's two parts share (bench/kernels.py: the suite and its tree build /
accept cases; bench/kernels_attention.py: its verify-attention cases): the shape of a result
record and of a rate, and the device sync before a case reads its outputs back."""

from __future__ import annotations

from bench.timing import summarize


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def record(bench, device, case, validation, samples=None, rates=None, seed=None) -> dict:
    rec = {"bench": bench, "backend": device, "case": case, "validation": validation,
           "seed": seed, "samples": samples or []}
    if samples:
        rec["summary"] = summarize(samples)
    if rates:
        rec["rates"] = rates
    return rec


def rate(value, unit, formula) -> dict:
    return {"value": value, "unit": unit, "formula": formula}
