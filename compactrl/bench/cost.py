"""The re-prefill cost model (KV-streams paper, appendix E) and its figure.

A rollout of N tokens compacted whenever its context reaches the budget B, keeping r tokens
(overlap + summary) each time, compacts about N/(B - r) times; re-prefill mode computes the r
kept tokens again at each compaction, so it prefills N r / (B - r) extra tokens. Stream mode
prefills none: the kept tokens keep their KV.
"""

from __future__ import annotations

from pathlib import Path


def extra_prefill(N: float, B: float, r: float) -> float:
    """Extra tokens re-prefill compaction computes over a rollout of N tokens."""
    if not 0 <= r < B:
        raise ValueError(f"need 0 <= r < B (kept tokens below the budget), got r={r}, B={B}")
    if N < 0:
        raise ValueError(f"N must be >= 0, got {N}")
    return N * r / (B - r)


def cost_table(N: int, budgets: list[int], kept: list[int]) -> list[dict]:
    return [
        {
            "N": N,
            "B": B,
            "r": r,
            "extra_prefill_tokens": extra_prefill(N, B, r),
            "extra_over_N": extra_prefill(N, B, r) / N if N else 0.0,
        }  # fmt: skip
        for B in budgets
        for r in kept
        if r < B
    ]


def plot_cost(path: str | Path, N: int, budgets: list[int]) -> Path:
    """Extra prefilled tokens (as a multiple of N) vs kept tokens r, one line per budget B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for B in sorted(budgets):
        rs = [B * i / 200 for i in range(0, 191)]  # up to r = 0.95 B
        ax.plot(rs, [extra_prefill(N, B, r) / N for r in rs], label=f"B = {B}")
    ax.set_xlabel("kept tokens per compaction r (overlap + summary)")
    ax.set_ylabel(f"extra prefill / N  (N = {N})")
    ax.set_yscale("log")
    ax.set_title("Re-prefill compaction: extra prefill N r / (B - r); stream: 0")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
