"""Small, dependency-free statistics for benchmark reports.

A benchmark claim is a mean over repeated runs with its spread and a 95% confidence interval
(Student-t), never a single run. Latency distributions are reported as p50/p90/p99.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
_Z975 = 1.959963984540054  # standard normal 0.975 quantile


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: from the table for df <= 30, else the normal quantile with the first two
    Cornish-Fisher terms (error < 1e-4 for df > 30; tends to 1.96 as df grows)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Summary:
    """Repeated-run summary. stdev is the sample standard deviation (n - 1); with one value the
    spread is unknown, so stdev and the interval are NaN."""

    n: int
    mean: float
    min: float
    max: float
    stdev: float
    ci95_low: float
    ci95_high: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def format(self, digits: int = 1, spread: str = "minmax") -> str:
        """'mean (low-high)' with low-high the min-max range or the 95% interval ("ci"); one
        run prints its value alone."""
        if self.n == 1:
            return format_range(self.mean, float("nan"), float("nan"), digits)
        if spread == "minmax":
            return format_range(self.mean, self.min, self.max, digits)
        if spread == "ci":
            return format_range(self.mean, self.ci95_low, self.ci95_high, digits)
        raise ValueError(f"spread must be 'minmax' or 'ci', got {spread!r}")


def _check_values(values: Sequence[float], what: str) -> list[float]:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError(f"{what} needs at least one value, got an empty list")
    if any(math.isnan(v) for v in vals):
        raise ValueError(f"{what} got NaN among its values; drop failed runs before summarising")
    return vals


def summarize(values: Sequence[float]) -> Summary:
    """Mean, range, sample stdev and 95% CI: mean -+ t_{0.975, n-1} * stdev / sqrt(n)."""
    vals = _check_values(values, "summarize")
    n = len(vals)
    mean = statistics.fmean(vals)
    if n == 1:
        nan = float("nan")
        return Summary(n, mean, vals[0], vals[0], nan, nan, nan)
    stdev = statistics.stdev(vals)
    half = t_quantile_975(n - 1) * stdev / math.sqrt(n)
    return Summary(n, mean, min(vals), max(vals), stdev, mean - half, mean + half)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks: rank
    h = (n - 1) * q / 100, value = x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h])."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(_check_values(values, "percentile"))
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"mean": .., "p50": .., "p90": .., "p99": ..}; an empty input gives NaNs (e.g. no request
    produced two tokens, so there is no inter-token latency to report)."""
    if not values:
        return {"mean": float("nan"), **{f"p{q:g}": float("nan") for q in qs}}
    out = {"mean": statistics.fmean(values)}
    for q in qs:
        out[f"p{q:g}"] = percentile(values, q)
    return out


def format_range(mean: float, low: float, high: float, digits: int = 1) -> str:
    """'123.4 (120.1-125.0)'; a NaN range (one run) prints the mean alone."""
    if math.isnan(low) or math.isnan(high):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def relative_change(new: float, base: float) -> str:
    """'+12.3%' change of new over base; 'n/a' when the base is zero or missing."""
    if not base or math.isnan(base) or math.isnan(new):
        return "n/a"
    return f"{(new / base - 1.0) * 100.0:+.1f}%"


def parse_positive_list(text: str, kind: type, flag: str) -> list:
    """'1,2,4' -> [1, 2, 4] for a command-line flag; ValueError naming the flag otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} must be a comma-separated list of positive numbers, got {text!r}")
    return values
