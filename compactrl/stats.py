"""95% intervals for accuracies and rewards, and paired comparisons of two rows on the same questions.

With 100 questions an accuracy's standard error is ~0.05, so a row "beats" another only when the
interval of their difference says so. A mean of 0/1 values (correct or not) gets the Wilson score
interval (right at 0 and 1, where the normal one collapses to a point); a mean of real-valued
rewards gets a percentile bootstrap over questions. Two rows played on the same episode seeds are
compared paired: the per-question differences are resampled together (the questions' difficulty
cancels, so the interval is narrower than two separate intervals suggest), and for 0/1 values
McNemar's exact test counts the questions only one row got right. Every resample draws from a
fixed-seed generator: the same inputs give the same numbers, run after run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

RESAMPLES = 10_000
SEED = 0


def _binary(*xs: np.ndarray) -> bool:
    return all(bool(np.isin(x, (0, 1)).all()) for x in xs)


def _z(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"level {level}: give a probability between 0 and 1, e.g. 0.95")
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson(k: int, n: int, level: float = 0.95) -> list[float]:
    """Wilson score interval of ``k`` successes in ``n``."""
    z, p = _z(level), k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [0.0 if k == 0 else center - half, 1.0 if k == n else center + half]  # exact at the edges


def _bootstrap(x: np.ndarray, level: float) -> list[float]:
    """Percentile interval of the mean of ``x``, questions resampled with replacement."""
    rng = np.random.default_rng(SEED)
    n = len(x)
    chunks = [x[rng.integers(0, n, size=(1000, n))].mean(1) for _ in range(RESAMPLES // 1000)]
    means = np.concatenate(chunks)  # in chunks: 10,000 x n indices at once are large for large n
    lo, hi = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
    return [float(lo), float(hi)]


def mean_ci(values: Sequence[float], level: float = 0.95) -> list[float] | None:
    """``[lo, hi]`` for the mean of per-question ``values``: Wilson when every value is 0 or 1,
    else a percentile bootstrap over questions (no normality assumed for skewed rewards).
    None when there are no values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return None
    if _binary(x):
        return wilson(int(x.sum()), x.size, level)
    return _bootstrap(x, level)


def mcnemar(a: np.ndarray, b: np.ndarray) -> float:
    """McNemar's exact two-sided p-value for paired 0/1 outcomes: a binomial(n, 1/2) test on the
    ``n`` discordant questions, computed with exact integers."""
    only_a, only_b = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


@dataclass(frozen=True)
class PairedDiff:
    """The mean of ``a - b`` over the questions, its interval and, for 0/1 values, McNemar's p."""

    diff: float
    ci: list[float]
    mcnemar_p: float | None
    n: int

    def row_fields(self) -> dict:
        """The fields a result row carries (JSON-ready)."""
        return {"paired_diff": self.diff, "paired_diff_ci": self.ci, "mcnemar_p": self.mcnemar_p}


def paired_diff(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> PairedDiff:
    """``a`` and ``b`` per question, aligned (see ``align``): the mean difference ``a - b`` with a
    paired bootstrap interval (questions resampled, both rows together) and, when both are 0/1,
    McNemar's exact p-value."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_diff needs two equally long, non-empty rows; got {a.shape} and {b.shape}")
    _z(level)
    d = a - b
    p = mcnemar(a, b) if _binary(a, b) else None
    return PairedDiff(float(d.mean()), _bootstrap(d, level), p, int(d.size))


def align(a: Mapping[int, float], b: Mapping[int, float], a_name: str = "A", b_name: str = "B"):
    """Two rows' per-episode values (episode seed -> value) as two arrays in seed order; a row
    played on other seeds cannot be compared question by question, so that is refused."""
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise ValueError(
            f"rows {a_name!r} and {b_name!r} have different episode seeds ({len(only_a)} only "
            f"in {a_name!r}: {only_a[:5]}, {len(only_b)} only in {b_name!r}: {only_b[:5]}); a paired "
            "comparison needs the same questions: give both rows the same seed and episodes"
        )
    seeds = sorted(a)
    return np.array([a[s] for s in seeds], np.float64), np.array([b[s] for s in seeds], np.float64)


def compare(a: Mapping[int, float], b: Mapping[int, float], a_name: str, b_name: str,
            level: float = 0.95) -> dict:  # fmt: skip
    """Row ``a_name`` against row ``b_name`` on their shared seeds: the row's comparison fields."""
    return {"compared_to": b_name, **paired_diff(*align(a, b, a_name, b_name), level).row_fields()}


def verdict(ci: Sequence[float], a: str = "A", b: str = "B", p: float | None = None,
            level: float = 0.95) -> str:  # fmt: skip
    """What may be written about ``a - b`` (higher is better): a row is better only when the paired
    interval excludes 0 and, given McNemar's ``p``, that test agrees (on a handful of questions all
    going one way the bootstrap interval collapses to a point; the exact test does not)."""
    lo, hi = ci
    if p is not None and p >= 1 - level:
        return "no difference measured"
    if lo > 0:
        return f"{a} better"
    if hi < 0:
        return f"{b} better"
    return "no difference measured"


def fmt_ci(value: float, ci: Sequence[float] | None, signed: bool = False) -> str:
    """``0.38 [0.29, 0.48]`` (``+`` signs for a difference); the bare value without an interval."""
    f = "{:+.2f}" if signed else "{:.2f}"
    return f.format(value) + (f" [{f.format(ci[0])}, {f.format(ci[1])}]" if ci else "")


def fmt_paired(d: dict | None, name: str) -> str:
    """A row's comparison fields (``compare``) as ``+0.04 [+0.01, +0.07] (p 0.005): NAME better``;
    ``-`` where the row has none."""
    if not d or not d.get("paired_diff_ci"):
        return "-"
    ci, p = d["paired_diff_ci"], d["mcnemar_p"]
    said = fmt_ci(d["paired_diff"], ci, True) + ("" if p is None else f" (p {p:.2g})")
    return f"{said}: {verdict(ci, name, d['compared_to'].split(' / ')[0], p)}"
