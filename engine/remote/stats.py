"""The statistics behind compare.py's verdicts, on raw timing samples (numpy only).

`mann_whitney_u(x, y)`: U and the two-sided p of the Mann-Whitney U test (the exact
distribution for small untied samples, else the normal approximation with tie correction).
`bootstrap_change(a, b, seed)`: a 95% interval of median(b) / median(a) - 1.
`relative_spread(samples)`: IQR / median, the noise a run measured in its own samples.
"""

from __future__ import annotations

import math

import numpy as np

def _exact_u_cdf(n1: int, n2: int) -> np.ndarray:
    """Counts of each U = 0..n1*n2 over all C(n1+n2, n1) orderings (no ties).

    The generating function is the Gaussian binomial [n1+n2 choose n1]_q, built one factor at
    a time: multiply by (1 - q^(n2+i)), then divide by (1 - q^i) (a running sum with stride i);
    every intermediate is again a Gaussian binomial, so integers stay exact (int64 suffices for
    n1 + n2 <= 60: C(60, 30) < 2^63).
    """
    size = n1 * n2 + 1
    c = np.zeros(size, dtype=np.int64)
    c[0] = 1
    for i in range(1, n1 + 1):
        shift = n2 + i
        if shift < size:
            c[shift:] -= c[:size - shift].copy()
        for k in range(i, size):
            c[k] += c[k - i]
    return c


def mann_whitney_u(x, y, exact: bool | None = None) -> tuple:
    """(U of x, two-sided p) for H0: x and y come from the same distribution.

    exact: None picks the exact distribution when there are no ties and n1 + n2 <= 60, else the
    normal approximation (tie-corrected variance, continuity correction); True / False force
    one (True with ties is an error: the exact counts assume distinct values).
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n1, n2 = x.size, y.size
    if n1 == 0 or n2 == 0:
        raise ValueError(f"mann_whitney_u: empty sample (sizes {n1}, {n2})")
    allv = np.concatenate([x, y])
    order = np.argsort(allv, kind="mergesort")
    ranks = np.empty(allv.size, dtype=np.float64)
    sorted_v = allv[order]
    # average ranks over ties
    i = 0
    tie_term = 0.0
    while i < allv.size:
        j = i
        while j + 1 < allv.size and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        ranks[order[i:j + 1]] = 0.5 * (i + j) + 1.0
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    has_ties = tie_term > 0
    if exact and (has_ties or n1 + n2 > 60):
        raise ValueError(f"mann_whitney_u: exact=True needs distinct values and n1 + n2 <= 60 "
                         f"(ties: {has_ties}, n1 + n2 = {n1 + n2})")
    if exact is None:
        exact = not has_ties and n1 + n2 <= 60
    if exact:
        counts = _exact_u_cdf(n1, n2).astype(np.float64)
        total = counts.sum()
        k = int(round(u1))
        lo = counts[:k + 1].sum() / total
        hi = counts[k:].sum() / total
        return u1, float(min(1.0, 2.0 * min(lo, hi)))
    mu = n1 * n2 / 2.0
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:  # every sample equal: nothing to tell apart
        return u1, 1.0
    z = (abs(u1 - mu) - 0.5) / math.sqrt(var)  # continuity correction
    p = math.erfc(max(z, 0.0) / math.sqrt(2.0))
    return u1, float(min(1.0, p))


def bootstrap_change(a, b, seed: int, reps: int = 1000) -> tuple:
    """95% interval of median(b) / median(a) - 1 by resampling each side with replacement."""
    rng = np.random.default_rng(seed)
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    ma = np.median(a[rng.integers(0, a.size, (reps, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, (reps, b.size))], axis=1)
    ratio = mb / np.where(ma > 0, ma, np.nan) - 1.0
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size == 0:
        return (float("nan"), float("nan"))
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return float(lo), float(hi)


def relative_spread(samples) -> float:
    """IQR / median of a run's raw samples: the noise that run itself measured."""
    s = np.asarray(samples, dtype=np.float64)
    med = float(np.median(s))
    if s.size < 4 or med <= 0:
        return 0.0
    q1, q3 = np.percentile(s, [25, 75])
    return float((q3 - q1) / med)
