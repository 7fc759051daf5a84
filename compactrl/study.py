"""A study: a grid of training runs, each evaluated several ways, as one config and one command.

``compactrl study configs/studies/recall_grid.toml`` expands each ``[[run]]`` (a train config,
``--set`` overrides, and a grid of values: the cartesian product) into named runs, trains them
(``parallel`` at a time, each its own process with its own threads; a later ``stage`` waits for the
earlier ones), then evaluates every run's final checkpoint with each ``[[eval]]`` (overrides such
as another env variant or mode, on held-out episodes) and writes one row per run and eval (or per
run) to ``results``. It resumes: a finished run is not trained again, a
run with a checkpoint continues from it (``--resume``), and an evaluation already in the run's
``eval/`` folder is read back, so a killed study loses at most the steps since each checkpoint.
Each row's accuracy and mean reward carry 95% intervals (``accuracy_ci``, Wilson; ``mean_reward_ci``)
over the evaluation's episodes. A run's held-out episodes follow its ``seed`` (a shifted set for
another seed), so only rows of the same seed and env are on the same questions: ``compare`` names
such pairs ([run, baseline run]), and each of the run's rows then carries its paired difference
from the baseline's on the same episodes (``compactrl.stats``: bootstrap interval, McNemar's p).
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compactrl.config import ConfigError, load_config, read_toml
from compactrl.plot import load_metrics
from compactrl.rl.checkpoint import CheckpointError, resolve_checkpoint
from compactrl.stats import compare, mean_ci


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    config: str = Field(description="a train config (TOML)")
    name: str = Field(description="the run's folder name; {field} is replaced by that grid value")
    set: list[str] = Field([], description="--set overrides for every run of this block")
    grid: dict[str, list] = Field({}, description="field -> values; one run per combination")
    stage: int = Field(
        0, ge=0, description="runs of a stage start once every run of the stages before it is done "
        "(e.g. an SFT run whose checkpoint the RL runs start from)"
    )  # fmt: skip


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    set: list[str] = Field([], description="--set overrides of the run's config for this evaluation")
    episodes: int = Field(128, ge=1)
    greedy: bool = True
    traces: bool = Field(False, description="keep the episodes' traces beside the result (eval --traces)")


class StudyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    out: str = Field(description="the runs' folders go under this folder")
    results: str = Field(description="JSON file of the rows (one per run and eval)")
    parallel: int = Field(1, ge=1, description="runs trained at once (one thread each by default)")
    columns: dict[str, str] = Field({}, description="row column -> dotted config field, e.g. k = 'env.k'")
    rows: Literal["per_eval", "per_run"] = Field(
        "per_eval", description="per_eval: a row per run and eval; per_run: a row per run, each eval's "
        "accuracy and stderr as <eval>_success and <eval>_stderr"
    )  # fmt: skip
    run: list[RunSpec] = Field(min_length=1)
    eval: list[EvalSpec] = Field(min_length=1)
    compare: list[tuple[str, str]] = Field(
        [], description="[run, baseline run] pairs of the same seed and env: the run's rows carry their "
        "paired difference in success from the baseline's on the same episodes (vs_<baseline>, or "
        "<eval>_vs_<baseline> per run)"
    )  # fmt: skip

    @model_validator(mode="after")
    def _unique(self):
        names = [e.name for e in self.eval]
        if len(set(names)) < len(names):
            raise ValueError(f"eval names must be unique, got {names}")
        return self


def _field(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


def expand(study: StudyConfig) -> list[tuple[str, str, list[str], int]]:
    """``(name, config path, overrides, stage)`` per run; every run's config is validated here, before
    any training starts, and names must be unique."""
    runs = []
    for spec in study.run:
        keys = list(spec.grid)
        for values in itertools.product(*(spec.grid[k] for k in keys)) if keys else [()]:
            point = dict(zip(keys, values, strict=True))
            name = spec.name.format_map({k.replace(".", "_"): v for k, v in point.items()})
            sets = [*spec.set, *(f"{k}={json.dumps(v)}" for k, v in point.items())]
            sets.append(f"out={Path(study.out) / name}")
            runs.append((name, spec.config, sets, spec.stage))
    names = [r[0] for r in runs]
    if len(set(names)) < len(names):
        raise ConfigError(
            f"run names repeat ({names}): put each grid field in the name, e.g. 'rl_k{{env_k}}'"
        )
    from compactrl.rl.config import TrainConfig

    for name, config, sets, stage in runs:
        for ev in [None, *study.eval]:
            try:
                load_config(TrainConfig, config, [*sets, *(ev.set if ev else [])])
            except ConfigError as e:
                if stage and _made_by_the_study(study, config, sets):
                    continue  # checked again when its stage starts
                raise ConfigError(f"run {name}{f', eval {ev.name}' if ev else ''}: {e}") from e
    return runs


def _made_by_the_study(study: StudyConfig, config: str, sets: list[str]) -> bool:
    """Whether the run starts from a model folder (in the study's ``out``) that is not there yet:
    an earlier stage writes it, so the run's config can be checked only once that stage is done."""
    paths = [s.split("=", 1)[1] for s in sets if s.startswith("model.path=")]
    path = paths[-1] if paths else read_toml(config).get("model", {}).get("path")
    out = Path(study.out).resolve()
    return bool(path) and not Path(path).exists() and out in Path(path).resolve().parents


def _finished(run_dir: Path, steps: int) -> bool:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return summary.get("last_step", {}).get("step") == steps


def _cli(args: list[str], log: Path) -> int:
    """Run ``compactrl ARGS`` in its own process (its own torch threads), appending to ``log``."""
    cmd = [sys.executable, "-m", "compactrl.cli", *args]
    with open(log, "a") as f:
        f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def _train(config: str, sets: list[str], run_dir: Path, steps: int, log: Path) -> int:
    if _finished(run_dir, steps):
        return 0
    resume = ["--resume"] if (run_dir / "config.json").is_file() else []
    return _cli(["train", config, *(x for s in sets for x in ("--set", s)), *resume], log)


def _step_totals(run_dir: Path) -> dict:
    """The run's generation and training seconds summed over its steps, and the mean tokens per
    rollout of its RL steps: distinct (``tokens``, what one stream holds) and fed again
    (``reprefilled_tokens``), whose ratio is the cost model's re-prefill overhead."""
    rows = load_metrics(run_dir)
    rl = [r for r in rows if r.get("phase") == "rl"]
    total = {
        k: sum(r.get(key, 0.0) for r in rows) for k, key in (("gen_s", "generate_s"), ("train_s", "train_s"))
    }
    return total | {
        k: sum(r[k] for r in rl) / len(rl) if rl else None for k in ("tokens", "reprefilled_tokens")
    }


def _stderr(stats: dict) -> float:
    """Standard error of the mean reward over the evaluation's episodes (from their rewards)."""
    rewards = [e["reward"] for e in stats["episode_metrics"]]
    if len(rewards) < 2:
        return math.nan
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1) / len(rewards))


def _eval_file(out: str, ckpt: Path, ev: EvalSpec) -> Path:
    return Path(out) / "eval" / f"{ckpt.name}{'-greedy' if ev.greedy else ''}-study-{ev.name}.json"


def _successes(config: str, sets: list[str], ev: EvalSpec) -> dict[int, float] | None:
    """Episode seed -> success (reward >= 1) of the run's evaluation ``ev``; None if not evaluated."""
    from compactrl.rl.config import TrainConfig

    try:
        ckpt = resolve_checkpoint(load_config(TrainConfig, config, sets).out)
    except CheckpointError:
        return None
    path = _eval_file(load_config(TrainConfig, config, [*sets, *ev.set]).out, ckpt, ev)
    if not path.is_file():
        return None
    return {e["seed"]: float(e["reward"] >= 1.0) for e in json.loads(path.read_text())["episode_metrics"]}


def _compared(study: StudyConfig, by_name: dict, rows: list[dict]) -> list[dict]:
    """``rows`` with each compared run's paired difference from its baseline, per evaluation (where
    both are evaluated: a study run with --only may not have its baseline yet)."""
    for a, b in study.compare:
        for ev in study.eval:
            runs = [by_name[n] for n in (a, b)]
            xs = [_successes(config, sets, ev) for _, config, sets, _ in runs]
            if None in xs:
                continue
            d = compare(*xs, f"{a} / {ev.name}", f"{b} / {ev.name}")
            for row in rows:
                if row["run"] == a and study.rows == "per_run":
                    row[f"{ev.name}_vs_{b}"] = d
                elif row["run"] == a and row["eval"] == ev.name:
                    row[f"vs_{b}"] = d
    return rows


def _evaluate(study: StudyConfig, name: str, config: str, sets: list[str], ev: EvalSpec, ckpt: Path,
              summary: dict, totals: dict, log: Path) -> dict:  # fmt: skip
    """The row of one evaluation of the run's checkpoint ``ckpt`` (read back if done before)."""
    from compactrl.rl.config import TrainConfig

    cfg = load_config(TrainConfig, config, [*sets, *ev.set])
    path = _eval_file(cfg.out, ckpt, ev)
    if not path.is_file():
        args = ["eval", config, *(x for s in [*sets, *ev.set] for x in ("--set", s)), "--checkpoint",
                str(ckpt), "--episodes", str(ev.episodes), "--name", f"study-{ev.name}"]  # fmt: skip
        flags = [*(["--greedy"] if ev.greedy else []), *(["--traces"] if ev.traces else [])]
        if _cli([*args, *flags], log) != 0 or not path.is_file():
            raise RuntimeError(f"run {name}: evaluation {ev.name} failed; see {log}")
    stats = json.loads(path.read_text())
    data = json.loads(load_config(TrainConfig, config, sets).model_dump_json())  # the run's, not the eval's
    row = {"run": name, **{c: _field(data, f) for c, f in study.columns.items()}, "eval": ev.name}
    rewards = [e["reward"] for e in stats["episode_metrics"]]  # success, as eval counts it: reward >= 1
    row |= {"accuracy": stats["success_rate"], "accuracy_ci": mean_ci([float(r >= 1.0) for r in rewards]),
            "mean_reward": stats["mean_reward"], "mean_reward_ci": mean_ci(rewards), "stderr": _stderr(stats),
            "episodes": stats["episodes"], "errors": stats["errors"], "checkpoint": stats["checkpoint"],
            "cpu_s": summary.get("cpu_s"), "wall_s": summary.get("wall_s"), **totals,
            "seeds": 1, "seed": cfg.seed, "steps": cfg.steps, "config": config,
            "set": sets[:-1] + ev.set}  # fmt: skip
    return row


def _per_run(rows: list[dict]) -> dict:
    """One row for a run's evaluations: each eval's accuracy, its interval and stderr under its name."""
    per_eval = ("eval", "accuracy", "accuracy_ci", "mean_reward", "mean_reward_ci", "stderr", "set")
    row = {k: v for k, v in rows[0].items() if k not in per_eval}
    for r in rows:
        row |= {f"{r['eval']}_success": r["accuracy"], f"{r['eval']}_success_ci": r["accuracy_ci"],
                f"{r['eval']}_stderr": r["stderr"]}  # fmt: skip
    return row


def run_study(path: str | Path, only: list[str] | None = None, echo=print) -> list[dict]:
    """Train what is not trained yet and evaluate it, ``parallel`` runs at a time; the rows are
    written to ``results`` as each run finishes, in the study's order (rows of other runs kept)."""
    data = read_toml(path)
    try:
        study = StudyConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e
    every = expand(study)
    by_name = {r[0]: r for r in every}
    if only and set(only) - set(by_name):
        raise ConfigError(f"--only {sorted(set(only) - set(by_name))}: no such run in {path}")
    unknown = sorted({n for pair in study.compare for n in pair} - set(by_name))
    if unknown:
        raise ConfigError(f"{path}: compare names {unknown}, which are not runs of the study: name its runs")
    runs = [by_name[n] for n in dict.fromkeys(only)] if only else every  # --only's order: longest first
    from compactrl.rl.config import TrainConfig

    Path(study.out).mkdir(parents=True, exist_ok=True)
    results = Path(study.results)
    lock = threading.Lock()

    def one(run) -> list[dict] | None:
        name, config, sets, _ = run
        log = Path(study.out) / f"{name}.log"
        echo(f"{name}: training")
        cfg = load_config(TrainConfig, config, sets)
        rc = _train(config, sets, Path(cfg.out), cfg.steps, log)
        if rc != 0:
            echo(f"{name}: failed (exit {rc}); see {log}")
            return None
        ckpt = resolve_checkpoint(cfg.out)  # checked once; each evaluation loads it
        summary = json.loads((Path(cfg.out) / "summary.json").read_text())
        totals = _step_totals(Path(cfg.out))  # read once, for every evaluation's row
        rows = []
        for ev in study.eval:
            rows.append(_evaluate(study, name, config, sets, ev, ckpt, summary, totals, log))
            acc, (lo, hi) = rows[-1]["accuracy"], rows[-1]["accuracy_ci"]
            echo(f"{name} / {ev.name}: accuracy {acc:.3f} [95% interval {lo:.3f}, {hi:.3f}]")
        if study.rows == "per_run":
            rows = [_per_run(rows)]
        with lock:  # re-read: rows another study process wrote meanwhile are kept
            table: dict[str, list[dict]] = {}
            if results.is_file():
                for row in json.loads(results.read_text())["rows"]:
                    table.setdefault(row["run"], []).append(row)
            table[name] = rows
            order = [r[0] for r in every]
            ordered = [row for n in sorted(table, key=lambda n: order.index(n) if n in order else len(order))
                       for row in table[n]]  # fmt: skip
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps({"study": str(path), "rows": ordered}, indent=1) + "\n")
        return rows

    done = []
    for stage in sorted({r[3] for r in runs}):
        batch = [r for r in runs if r[3] == stage]
        with ThreadPoolExecutor(study.parallel) as pool:
            done += list(zip(batch, pool.map(one, batch), strict=True))
        failed = [r[0] for r, rows in done if rows is None]
        if failed:
            raise RuntimeError(
                f"runs {failed} failed; their logs are in {study.out}/; rerun the study to resume them"
            )
    table = _compared(study, by_name, json.loads(results.read_text())["rows"])  # every run evaluated now
    results.write_text(json.dumps({"study": str(path), "rows": table}, indent=1) + "\n")
    return [row for r, _ in done for row in table if row["run"] == r[0]]


def _row_columns(row: dict) -> list[str]:
    """The study's ``columns`` in a written row: ``_evaluate`` puts them between ``run`` and ``eval``
    (a per-run row: before ``episodes``)."""
    keys = list(row)
    end = keys.index("eval") if "eval" in keys else keys.index("episodes")
    return keys[1:end]


def markdown(result: dict) -> str:
    """A study's rows as one table, a line per run: its columns, each evaluation's success with its
    95% interval (Wilson's from the count where a row predates intervals), each paired comparison
    written into the rows with what may be said of it, steps, wall-clock and, for RL runs, the
    loop's generation / training seconds."""
    from compactrl.bench.harness import markdown_table
    from compactrl.stats import fmt_ci, fmt_paired, wilson

    runs: dict[str, dict] = {}
    for r in result["rows"]:  # per-eval rows folded into the per-run form
        row = runs.setdefault(r["run"], dict(r))
        if "eval" in r:
            e = r["eval"]
            row |= {f"{e}_success": r["accuracy"], f"{e}_success_ci": r.get("accuracy_ci")}
            row |= {f"{e}_{k}": v for k, v in r.items() if k.startswith("vs_")}
    columns = _row_columns(result["rows"][0])
    keys = [k for r in runs.values() for k in r]
    evals = list(dict.fromkeys(k.removesuffix("_success") for k in keys if k.endswith("_success")))
    pairs = list(dict.fromkeys(k for k in keys if "_vs_" in k))
    timed = any(r.get("gen_s") for r in runs.values())

    def success(r: dict, e: str) -> str:
        v, n = r.get(f"{e}_success"), r["episodes"]
        return "-" if v is None else fmt_ci(v, r.get(f"{e}_success_ci") or wilson(round(v * n), n))

    head = ["run", *columns, *(f"{e} [95% CI]" for e in evals),
            *(f"{k.replace('_vs_', ' vs ')}, paired" for k in pairs), "steps", "wall-clock"]  # fmt: skip
    rows = []
    for name, r in runs.items():
        rows.append(
            [
                name,
                *(r[c] for c in columns),
                *(success(r, e) for e in evals),
                *(fmt_paired(r.get(k), name) for k in pairs),
                r["steps"],
                f"{r['wall_s'] / 60:.1f} min",
            ]
        )
        if timed:
            rows[-1].append(f"{r['gen_s']:.0f} / {r['train_s']:.0f}" if r.get("gen_s") else "-")
    return markdown_table(head + ["generation / training s"] * timed, rows)


def modes_markdown(result: dict) -> str:
    """Re-prefill against stream per strategy, from the loop's own timers summed over each run
    (``gen_s``, ``train_s``): the time ratios of twin runs that differ only in ``mode``."""
    from compactrl.bench.harness import markdown_table

    by = {(r.get("strategy"), r["mode"]): r for r in result["rows"] if r.get("gen_s")}
    rows = []
    for (strategy, mode), s in by.items():
        p = by.get((strategy, "reprefill"))
        if mode == "stream" and p is not None:
            ratios = [(p["gen_s"] + p["train_s"]) / (s["gen_s"] + s["train_s"]), p["gen_s"] / s["gen_s"],
                      p["train_s"] / s["train_s"]]  # fmt: skip
            rows.append([strategy, *(f"{x:.2f}" for x in ratios)])
    return markdown_table(["strategy", "time per step, reprefill / stream", "generation", "training"], rows)
