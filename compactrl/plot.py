"""Training curves of a run directory (``compactrl plot RUN_DIR``) as one PNG.

Reads ``metrics.jsonl`` (one JSON object per step, written by ``rl/loop.py``) and, when present,
the held-out evaluations in ``summary.json``. The default panels are reward (mean, and max
lighter), loss (and the critic's value loss when there is one), KL (``mismatch_kl``, and
``ref_kl`` when nonzero; log scale when all positive) and time per step (generate / train /
sync stacked); ``metrics=[...]`` draws one panel per named metric instead. Supervised steps
(``phase`` ``sft`` / ``sft_evicted``) are shaded. Input is checked before anything is drawn.

Several run directories (``compactrl plot RUN_DIR RUN_DIR ...``) are compared instead: held-out
success (``eval_every``) against training wall-clock hours, evaluations left out, as the KV-streams
paper draws it: a colour per strategy, circles for stream, squares for reprefill, diamonds for full.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DEFAULT_PANELS = ("reward", "loss", "kl", "time")
MODE_MARKERS = {"stream": "o", "reprefill": "s", "full": "D"}
SHADES = {"sft": ("tab:green", "SFT"), "sft_evicted": ("tab:olive", "SFT (evicted)")}


class PlotError(ValueError):
    """Bad input: the message is one line naming the file (and line) at fault."""


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl``; a missing or empty file or a bad line is a PlotError."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        what = "does not exist" if not Path(run_dir).exists() else "has no metrics.jsonl"
        raise PlotError(f"{run_dir} {what}: give a run directory written by compactrl train")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(f"{path}, line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise PlotError(f"{path}, line {n}: not a metrics row (an object with an integer 'step')")
            rows.append(row)
    if not rows:
        raise PlotError(f"{path} is empty: no step has been logged yet")
    return rows


def available_metrics(rows: list[dict]) -> list[str]:
    """Numeric fields logged at some step (what ``metrics=`` accepts)."""
    names = {k for r in rows for k, v in r.items() if _number(v)}
    return sorted(names - {"step"})


def plot_run(run_dir: str | Path, out: str | Path | None = None, metrics: list[str] | None = None) -> dict:
    """Draw the run's curves to ``out`` (default ``RUN_DIR/curves.png``);
    returns ``{"png": path, "steps": n, "panels": [...]}``."""
    rows = load_metrics(run_dir)
    known = available_metrics(rows)
    unknown = [m for m in metrics or () if m not in known]
    if unknown:
        raise PlotError(
            f"--metric {', '.join(unknown)} not logged in {run_dir}; available: {', '.join(known)}"
        )
    summary = _summary(Path(run_dir) / "summary.json")
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(metrics)) if metrics else list(DEFAULT_PANELS)
    cols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.4 * nrows), sharex=True, squeeze=False)
    steps = [r["step"] for r in rows]
    draw = {"reward": _reward, "loss": _loss, "kl": _kl, "time": _time}
    for k, (ax, name) in enumerate(zip(axes.flat, panels, strict=False)):
        _shade(ax, rows, label=k == 0)  # the shades' legend once, in the first panel
        if metrics:
            _metric(ax, steps, rows, name)
        else:
            draw[name](ax, steps, rows, summary)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            where = {"loc": "upper left", "ncols": 3} if name == "time" and not metrics else {"loc": "best"}
            ax.legend(fontsize=8, **where)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"{Path(run_dir).resolve().name}: {len(rows)} steps", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"png": str(out), "steps": len(rows), "panels": panels}


def success_curve(run_dir: str | Path) -> list[tuple[float, float]]:
    """``(training wall-clock seconds, held-out success)`` per evaluation of the run: as RL starts
    (0 s), every ``eval_every`` steps and at the end."""
    rows = load_metrics(run_dir)
    summary = _summary(Path(run_dir) / "summary.json")
    points = [(r["wall_s"], r["eval_success"]) for r in rows if _number(r.get("eval_success"))]
    warm_up = [r.get("wall_s", 0.0) for r in rows if r.get("phase") != "rl"]  # SFT steps: before the curve
    start = warm_up[-1] if warm_up else 0.0
    before = summary.get("eval_before")
    if isinstance(before, dict) and _number(before.get("success_rate")):
        points.insert(0, (start, before["success_rate"]))
    return [(t - start, y) for t, y in points]


def plot_compare(run_dirs: list[str | Path], out: str | Path) -> dict:
    """Held-out success against training wall-clock hours for several runs, in one PNG."""
    runs = []
    for d in run_dirs:
        curve = success_curve(d)
        if not curve:
            raise PlotError(f"{d} has no held-out evaluations: train it with eval_episodes and eval_every")
        try:
            config = json.loads((Path(d) / "config.json").read_text())
        except (OSError, ValueError):
            raise PlotError(
                f"{d} has no readable config.json: give run directories of compactrl train"
            ) from None
        runs.append(
            (Path(d).resolve().name, config.get("mode"), config.get("strategy", {}).get("name"), curve)
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(dict.fromkeys(s for _, _, s, _ in runs))
    colors = dict(zip(strategies, plt.get_cmap("tab10").colors, strict=False))
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for name, mode, strategy, curve in runs:
        hours = [t / 3600 for t, _ in curve]
        ax.plot(hours, [y for _, y in curve], marker=MODE_MARKERS.get(mode, "x"), color=colors[strategy],
                ls="-" if mode == "stream" else "--", lw=1.2, ms=6, label=name)  # fmt: skip
    ax.set_xlabel("training wall-clock (hours, evaluations left out)")
    ax.set_ylabel("held-out success (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("success against wall-clock: circles stream, squares reprefill, diamonds full", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"png": str(out), "runs": [name for name, *_ in runs]}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _series(rows: list[dict], key: str) -> list[float]:
    """One value per row; NaN where the step did not log it (a gap in the line)."""
    return [float(r[key]) if _number(r.get(key)) else math.nan for r in rows]


def _logged(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _summary(path: Path) -> dict:
    try:  # optional: eval points only; a run still writing it must not stop the plot
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shade(ax, rows: list[dict], label: bool) -> None:
    """Shade each contiguous block of supervised steps (``label``: name them in the legend)."""
    labelled = set() if label else set(SHADES)
    i = 0
    while i < len(rows):
        phase = rows[i].get("phase")
        j = i
        while j + 1 < len(rows) and rows[j + 1].get("phase") == phase:
            j += 1
        if phase in SHADES:
            color, label = SHADES[phase]
            ax.axvspan(rows[i]["step"] - 0.5, rows[j]["step"] + 0.5, color=color, alpha=0.12,
                       label=None if phase in labelled else label)  # fmt: skip
            labelled.add(phase)
        i = j + 1


def _reward(ax, steps, rows, summary) -> None:
    ax.plot(steps, _series(rows, "reward_max"), color="tab:blue", alpha=0.35, lw=1, label="max")
    ax.plot(steps, _series(rows, "reward"), color="tab:blue", lw=1.8, label="mean")
    rl = [r["step"] for r in rows if r.get("phase") == "rl"]
    where = {"before": (rl[0] - 1 if rl else steps[0] - 1), "after": steps[-1]}
    for when, marker in (("before", "s"), ("after", "D")):
        result = summary.get(f"eval_{when}")
        if isinstance(result, dict) and _number(result.get("mean_reward")):
            ax.plot([where[when]], [result["mean_reward"]], marker, color="tab:red", ms=7,
                    label=f"held-out eval ({when})")  # fmt: skip
    ax.set_title("reward")


def _loss(ax, steps, rows, summary) -> None:
    ax.plot(steps, _series(rows, "loss"), color="tab:purple", lw=1.5, label="loss")
    ax.axhline(0, color="grey", lw=0.6)
    value = _series(rows, "value_loss")
    if any(_logged(value)):  # a critic (advantage = "gae"): its own scale, right axis
        twin = ax.twinx()
        twin.plot(steps, value, color="tab:orange", lw=1.2, label="value loss (right)")
        twin.set_ylabel("value loss", fontsize=8)
        ax.plot([], [], color="tab:orange", lw=1.2, label="value loss (right)")  # in ax's legend
    ax.set_title("loss")


def _kl(ax, steps, rows, summary) -> None:
    drawn = []
    for key, color in (("mismatch_kl", "tab:brown"), ("ref_kl", "tab:cyan")):
        values = _series(rows, key)
        if (key == "mismatch_kl" and _logged(values)) or any(_logged(values)):  # ref_kl: when used
            ax.plot(steps, values, color=color, lw=1.5, label=key)
            drawn += _logged(values)
    if drawn and min(drawn) > 0:
        ax.set_yscale("log")
    elif not drawn:
        ax.text(0.5, 0.5, "no KL logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_title("KL (nats / token)")


def _time(ax, steps, rows, summary) -> None:
    parts = [("generate_s", "generate", "tab:blue"), ("train_s", "train", "tab:orange"),
             ("sync_s", "sync", "tab:grey")]  # fmt: skip
    layers = []
    for key, label, color in parts:
        values = [0.0 if math.isnan(v) else v for v in _series(rows, key)]
        if key != "sync_s" or max(values) > 1e-3:  # sync is ~0 when engine and trainer share weights
            layers.append((values, label, color))
    ax.stackplot(steps, *[v for v, _, _ in layers], labels=[lb for _, lb, _ in layers],
                 colors=[c for _, _, c in layers], alpha=0.75, step="mid")  # fmt: skip
    total = max(map(sum, zip(*[v for v, _, _ in layers], strict=True)))
    ax.set_ylim(0, 1.25 * total if total > 0 else 1)  # headroom for the legend
    ax.set_title("time per step (s)")


def _metric(ax, steps, rows, key: str) -> None:
    values = _series(rows, key)
    ax.plot(steps, values, lw=1.5, label=key)
    logged = _logged(values)
    if logged and min(logged) > 0 and max(logged) / min(logged) > 1e3:
        ax.set_yscale("log")
    ax.set_title(key)
