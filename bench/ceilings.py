"""Machine ceilings, measured once per run: what a rate is a fraction of.

CUDA: a large device-to-device copy (GB/s, read + write counted: 2 x bytes / time) and a large
bf16 matmul (TFLOP/s = 2 n^3 / time), both timed with CUDA events.
CPU: a large memcpy (numpy copyto; GB/s, read + write counted) and a float32 matmul
(torch.mm on the CPU threads torch uses; TFLOP/s = 2 n^3 / time).
Each ceiling's `value` is the rate at the fastest sample (what the machine can do), beside
`value_at_median`; the raw samples and the formula are kept.
"""

from __future__ import annotations

from bench.timing import summarize, time_cpu, time_cuda

__all__ = ["measure"]


def _entry(samples, work, unit, formula, **params) -> dict:
    s = summarize(samples)
    return {
        "value": work / s["min"] / (1e9 if unit == "GB/s" else 1e12),
        "value_at_median": work / s["median"] / (1e9 if unit == "GB/s" else 1e12),
        "unit": unit,
        "formula": formula,
        "params": params,
        "samples": list(samples),
        "summary": s,
    }


def _measure_cpu(quick: bool) -> dict:
    import numpy as np
    import torch

    nbytes = (64 << 20) if quick else (512 << 20)
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    copy = time_cpu(lambda: np.copyto(dst, src), warmup=1, reps=5 if quick else 10)
    n = 512 if quick else 2048
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    mm = time_cpu(lambda: torch.mm(a, b), warmup=1, reps=5 if quick else 10)
    return {
        "copy": _entry(copy, 2.0 * nbytes, "GB/s", "2 * bytes / time (read + write)",
                       bytes=nbytes, how="numpy.copyto float64"),
        "matmul": _entry(mm, 2.0 * n**3, "TFLOP/s", "2 * n^3 / time", n=n, dtype="float32",
                         threads=torch.get_num_threads(), how="torch.mm"),
    }


def _measure_cuda(quick: bool) -> dict:
    import torch

    nbytes = (256 << 20) if quick else (2 << 30)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    # A copy this large does not fit in L2, so no flush is needed between reps.
    copy = time_cuda(lambda: dst.copy_(src), warmup=3, reps=10 if quick else 30, flush_l2=False)
    del src, dst
    n = 4096 if quick else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    mm = time_cuda(lambda: torch.mm(a, b), warmup=5, reps=10 if quick else 30, flush_l2=False)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "copy": _entry(copy, 2.0 * nbytes, "GB/s", "2 * bytes / time (read + write)",
                       bytes=nbytes, how="torch Tensor.copy_ bf16 device to device"),
        "matmul": _entry(mm, 2.0 * n**3, "TFLOP/s", "2 * n^3 / time", n=n, dtype="bfloat16",
                         how="torch.mm (cuBLAS)"),
        "device": props.name,
    }


def measure(device: str, quick: bool = False) -> dict:
    """Ceilings of `device` ("cpu" or "cuda"): {"copy": {...}, "matmul": {...}}."""
    if device == "cpu":
        return _measure_cpu(quick)
    if device == "cuda":
        return _measure_cuda(quick)
    raise ValueError(f"ceilings.measure: device must be 'cpu' or 'cuda', got {device!r}")
