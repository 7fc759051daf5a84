"""The run commands: rollout, train, eval, study, and the cost model and plots around them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from compactrl.cli.common import (
    JsonFlag,
    SetOption,
    command_line,
    emit_json,
    fail,
    load_run_config,
    os_error,
    out,
    progress_bar,
    stopped,
)

Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Delete what `out` holds and start a new run there.")
]


def rollout_cmd(
    config: Annotated[Path | None, typer.Argument(help="TOML config (default: built-in defaults).")] = None,
    overrides: SetOption = None,
    overwrite: Overwrite = False,
    as_json: JsonFlag = False,
) -> None:
    """Run episodes through the engine with a compaction strategy; write traces and metrics."""
    from compactrl.agent.batch import RolloutConfig, rollout

    cfg = load_run_config(RolloutConfig, config, overrides)
    try:
        with progress_bar("episodes") as progress:
            summary = rollout(cfg, progress, overwrite=overwrite)
    except KeyboardInterrupt:
        again = command_line("rollout", config, overrides)
        stopped(f"stopped before the episodes were saved; run them again with: {again}")
    except (FileNotFoundError, ImportError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(os_error(e))
    if as_json:
        emit_json(summary)
    else:
        print_rollout(summary)


# what each number of a rollout's summary counts (the rest: totals over the episodes)
_UNITS = {"episodes": "episodes", "errors": "episodes", "truncated": "episodes",
          "at_position_limit": "episodes", "longest_stream": "tokens, largest",
          "peak_live_kv": "KV entries, largest",
          "mean_reward": "mean, 95% CI", "accuracy": "share, 95% CI", "mean_turns": "per episode",
          "mean_peak_live_kv": "KV entries, mean", "mean_peak_kv_with_threads": "KV entries, mean",
          "deletion_precision": "share", "deletion_recall": "share", "wall_s": "seconds",
          "position_limit": "tokens", "episodes_per_s": "per second", "generated_tokens_per_s": "per second",
          "peak_pool_kv_tokens": "KV entries, largest"}  # fmt: skip
_AUX = {"aux_calls", "deleted_cursors", "aux_offered_cursors", "aux_parse_failures", "aux_no_room",
        "aux_unknown_cursors", "aux_unseen_cursors", "aux_unfinished", "aux_tokens", "aux_kv_reads",
        "aux_kept_unread", "deletion_precision", "deletion_recall"}  # fmt: skip


def print_rollout(summary: dict) -> None:
    """The summary as a table whose every row says what it counts; provenance in one line."""
    from compactrl.provenance import provenance_line

    title = " / ".join(summary[k] for k in ("env", "strategy", "mode"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title=title)
    for column in ("metric", "value", "unit"):
        table.add_column(column, justify="right" if column == "value" else "left")
    skip = {
        "env",
        "strategy",
        "mode",
        "non_completion",
        "run_dir",
        "provenance",
        "mean_reward_ci",
        "accuracy_ci",
    }
    if not summary["aux_calls"]:  # SideQuest's counters only when an auxiliary thread ran
        skip |= _AUX
    for k, v in summary.items():
        if k in skip:
            continue
        shown = "-" if v is None else f"{v:.4g}" if isinstance(v, float) and abs(v) < 1e4 else f"{v:.0f}"
        if (ci := summary.get(f"{k}_ci")) is not None:
            shown += f" [{ci[0]:.2f}, {ci[1]:.2f}]"
        table.add_row(k, shown, _UNITS.get(k, "total"))
    for cause, rate in summary["non_completion"].items():
        table.add_row(f"non_completion.{cause}", f"{rate:.3g}", "share of episodes")
    out.print(table)
    out.print(f"run directory: {summary['run_dir']}", highlight=False)
    out.print(f"provenance: {provenance_line(summary['provenance'])}", highlight=False, soft_wrap=True)


def train_cmd(
    config: Annotated[Path | None, typer.Argument(help="TOML config (default: built-in defaults).")] = None,
    overrides: SetOption = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in `out` from its newest checkpoint.")
    ] = False,
    overwrite: Overwrite = False,
    as_json: JsonFlag = False,
) -> None:
    """Train a policy on multi-turn episodes with compaction (sample -> train -> repeat)."""
    from compactrl.cluster import launch
    from compactrl.rl.config import TrainConfig
    from compactrl.rl.loop import Interrupted
    from compactrl.rl.trainer import DataParallelError
    from compactrl.run_dir import saved_steps

    cfg = load_run_config(TrainConfig, config, overrides)
    if resume and not any(o.partition("=")[0].strip() == "steps" for o in overrides or []):
        cfg = cfg.model_copy(update={"steps": saved_steps(Path(cfg.out), cfg.steps)})  # the run's own
    again = command_line("train", config, overrides, "--resume")

    def show(m: dict) -> None:
        if as_json:
            return
        if m["phase"] != "rl":  # supervised steps on demonstrations
            out.print(
                f"step {m['step']:>4}  {m['phase']}  loss {m['loss']:.3e}  grad {m['grad_norm']:.2e}  "
                f"train {m['train_s']:.1f}s"
            )
            return
        out.print(
            f"step {m['step']:>4}  reward {m['reward']:.3f}  loss {m['loss']:+.3e}  "
            f"grad {m['grad_norm']:.2e}  mismatch_kl {m['mismatch_kl']:.1e}  "
            f"gen {m['generate_s']:.1f}s  train {m['train_s']:.1f}s"
        )

    try:
        with progress_bar("train") as progress:
            last = launch(cfg, resume=resume, overwrite=overwrite, progress=progress, on_step=show)
    except Interrupted as e:
        stopped(f"stopped after step {e.step}, saved {e.checkpoint}; continue with: {again}")
    except DataParallelError as e:  # a rank failed: no rank stepped; the message says how to resume
        fail(str(e))
    except KeyboardInterrupt:
        stopped(f"stopped without saving this step; continue from its newest checkpoint: {again}")
    except (FileNotFoundError, ImportError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(os_error(e))
    if as_json:
        emit_json(last)
    else:
        out.print(
            f"run directory: {cfg.out} (metrics.jsonl, checkpoints/, summary.json); "
            f"curves: compactrl plot {cfg.out}"
        )


def eval_cmd(
    config: Annotated[Path | None, typer.Argument(help="The run's TOML config.")] = None,
    overrides: SetOption = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="A checkpoints/step_* folder, or a run folder (its newest checkpoint); "
            "default: the run's initial model."
        ),
    ] = None,
    episodes: Annotated[int, typer.Option(help="Held-out episodes (seeds disjoint from training).")] = 32,
    greedy: Annotated[bool, typer.Option("--greedy", help="Decode greedily instead of sampling.")] = False,
    name: Annotated[
        str | None, typer.Option(help="Name this evaluation (e.g. another env variant): its own result file.")
    ] = None,
    traces: Annotated[
        bool,
        typer.Option("--traces", help="Also keep the episodes' traces (.traces.jsonl beside the result)."),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Evaluate a policy on held-out episodes without training; one result file per checkpoint."""
    from compactrl.rl.config import TrainConfig
    from compactrl.rl.evaluate import evaluate
    from compactrl.stats import fmt_ci

    cfg = load_run_config(TrainConfig, config, overrides)
    if episodes < 1:
        fail("--episodes must be >= 1")
    if name is not None and not name.replace("-", "").replace("_", "").isalnum():
        fail(f"--name {name!r}: use letters, digits, - and _ (it names a file)")
    if checkpoint is not None and not checkpoint.exists():
        fail(f"--checkpoint {checkpoint} does not exist")
    try:
        result = evaluate(cfg, checkpoint, episodes, greedy, name, traces)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(os_error(e))
    if as_json:
        emit_json(result)
    else:
        out.print(
            f"{result['checkpoint'] or 'initial model'}: {result['episodes']} episodes, mean reward "
            f"{fmt_ci(result['mean_reward'], result['mean_reward_ci'])}, success "
            f"{fmt_ci(result['success_rate'], result['success_rate_ci'])} (95% intervals), "
            f"errors {result['errors']}; wrote {result['path']}"
        )


def cost_cmd(
    n: Annotated[int, typer.Option("--n", help="Tokens in the rollout (N).")] = 32768,
    budget: Annotated[list[int] | None, typer.Option(help="Context budget B (repeatable).")] = None,
    kept: Annotated[list[int] | None, typer.Option(help="Kept tokens per compaction r (repeatable).")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write the figure (extra prefill vs r per B) here.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Extra prefill of re-prefill compaction, N r / (B - r), and the paper-style figure."""
    from compactrl.bench.cost import cost_table, plot_cost

    budgets, rs = budget or [1024, 2048, 4096, 8192], kept or [128, 256, 512, 1024]
    if n < 1 or min(budgets) < 1 or min(rs) < 0:
        fail("--n and --budget must be >= 1 and --kept >= 0")
    rows = cost_table(n, budgets, rs)
    if not rows:
        fail("every --kept is >= every --budget: a compaction must keep fewer tokens than the budget")
    figure = str(plot_cost(plot, n, budgets)) if plot else None
    if as_json:
        emit_json({"rows": rows, "plot": figure})
        return
    title = f"re-prefill compaction over N = {n} tokens (stream: 0 extra)"
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title=title)
    for col in ("B", "r", "extra prefill tokens", "extra / N"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["B"]), str(row["r"]), f"{row['extra_prefill_tokens']:.0f}", f"{row['extra_over_N']:.3f}"
        )
    out.print(table)
    if figure:
        out.print(f"figure: {figure}")


def plot_cmd(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="A run directory written by compactrl train; several: compare them.", metavar="RUN_DIR..."
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--out", help="PNG path (default: RUN_DIR/curves.png; comparing runs: compare.png here)."
        ),
    ] = None,
    metric: Annotated[
        list[str] | None,
        typer.Option("--metric", help="Draw this metrics.jsonl field, one panel each (repeatable)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Draw a run's training curves (reward, loss, KL, time per step; SFT steps shaded) to PNG;
    several runs: their held-out success against training wall-clock (circles stream, squares
    reprefill, diamonds full)."""
    from compactrl.plot import PlotError, plot_compare, plot_run

    if len(run_dirs) > 1 and metric:
        fail("--metric draws one run's curves; give one RUN_DIR, or drop --metric to compare runs")
    try:
        if len(run_dirs) > 1:
            result = plot_compare(run_dirs, output or Path("compare.png"))
        else:
            result = plot_run(run_dirs[0], output, metric)
    except PlotError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {e.filename or output}: {e.strerror or e}")
    if as_json:
        emit_json(result)
    elif len(run_dirs) > 1:
        out.print(f"{result['png']} ({len(result['runs'])} runs: success against wall-clock)", soft_wrap=True)
    else:
        out.print(f"{result['png']} ({result['steps']} steps: {', '.join(result['panels'])})", soft_wrap=True)


def study_cmd(
    config: Annotated[Path, typer.Argument(help="A study config (TOML): [[run]] grids and [[eval]]s.")],
    only: Annotated[
        list[str] | None, typer.Option(help="Only these runs, in the order given (repeatable).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Train a grid of runs (resumably, several at once) and evaluate each several ways; one JSON of rows."""
    from compactrl.config import ConfigError
    from compactrl.study import run_study

    if not config.is_file():
        fail(f"study config {config} does not exist")
    try:
        rows = run_study(config, only, echo=(lambda m: None) if as_json else out.print)
    except (ConfigError, RuntimeError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(os_error(e))
    if as_json:
        emit_json({"rows": rows})
