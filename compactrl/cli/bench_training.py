"""Training benchmarks: one-pass stream training against re-prefill, against transformers + peft,
and RL steps/s across Ray layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from compactrl.cli.common import (
    JsonFlag,
    SetOption,
    check_device,
    check_model_args,
    fail,
    load_run_config,
    machine_line,
    model_label,
    out,
    print_table,
    progress_bar,
    save_result,
)


def bench_trainer(
    model_dir: Annotated[
        Path | None, typer.Option("--model", help="Checkpoint folder (default: generated).")
    ] = None,
    size: Annotated[str, typer.Option(help="Generated model size: tiny | small | base.")] = "base",
    tokens: Annotated[int, typer.Option(help="Rollout length N (the stream is also timed at 2N).")] = 4096,
    budget: Annotated[int, typer.Option(help="Live-context budget B.")] = 1024,
    turn_len: Annotated[int, typer.Option(help="Tokens per turn.")] = 128,
    strategy: Annotated[
        list[str] | None, typer.Option(help="sliding_window | markovian | summary (repeatable; default all).")
    ] = None,
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed repeats (median is reported).")] = 2,
    chunk: Annotated[int, typer.Option(help="Query chunk of the stream's chunked attention.")] = 256,
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16")] = "float32",
    backend: Annotated[
        str, typer.Option(help="Stream attention: chunked (CPU) | flex (CUDA) | dense.")
    ] = "chunked",
    output: Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Forward+backward of one-pass stream training vs re-prefill training, per compaction strategy."""
    from compactrl.bench.synthetic import STRATEGIES
    from compactrl.bench.trainer import check_params, run_trainer_bench

    strategies = tuple(strategy or STRATEGIES)
    check_model_args(model_dir, size)
    try:
        check_params(strategies, tokens, budget, turn_len, threads, repeats, device, dtype, backend)
    except ValueError as e:
        fail(str(e))
    with progress_bar("bench trainer") as progress:
        try:
            result = run_trainer_bench(
                model_dir, strategies=strategies, n_tokens=tokens, budget=budget, turn_len=turn_len,
                size=size, threads=threads, repeats=repeats, chunk=chunk, device=device, dtype=dtype,
                backend=backend, progress=progress,
            )  # fmt: skip
        except ValueError as e:
            fail(str(e))
    if not save_result(result, output, as_json):
        print_trainer(result)


def print_trainer(result: dict) -> None:
    m = result["machine"]
    out.print(
        f"{m['cpu']} · {m['threads']} threads · torch {m['torch']} · {model_label(result['model'])} "
        f"· N={result['n_tokens']} B={result['budget']}"
    )
    from compactrl.bench.trainer import COLUMNS, table

    print_table(COLUMNS, table(result))
    out.print("a = one-pass stream, b = re-prefill (one sample per segment); predicted: the cost model (N→∞)")


def bench_train_step(
    config: Annotated[Path, typer.Argument(help="Train config whose strategy and batch are used.")] = Path(
        "configs/train/rooms_window.toml"
    ),
    overrides: SetOption = None,
    repeats: Annotated[int, typer.Option(help="Timed steps per mode (median is reported).")] = 3,
    output: Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """One training step on the same rollouts: stream (one pass) vs re-prefill (one sample per segment)."""
    from compactrl.bench.train_step import run_train_step_bench
    from compactrl.rl.config import TrainConfig

    if repeats < 1:
        fail("--repeats must be at least 1")
    cfg = load_run_config(TrainConfig, config, overrides)
    with progress_bar("bench train-step") as progress:
        try:
            r = run_train_step_bench(cfg, repeats, progress)
        except ValueError as e:
            fail(str(e))
    if not save_result(r, output, as_json):
        print_train_step(r)


def print_train_step(r: dict) -> None:
    out.print(machine_line(r))
    out.print(
        f"{r['rollouts']} {r['env']} rollouts, {r['strategy']['name']}, "
        f"{r['compactions']:.1f} compactions each, {r['trained_tokens']} trained tokens"
    )
    out.print(
        f"stream: {r['stream_samples']} samples, {r['stream_tokens']} tokens, {r['stream_s']:.3f} s | "
        f"re-prefill: {r['reprefill_samples']} samples, {r['reprefill_tokens']} tokens, "
        f"{r['reprefill_s']:.3f} s"
    )
    out.print(f"re-prefill / stream: tokens {r['token_ratio']:.2f}, time {r['time_ratio']:.2f}")
    if r["aux_threads"]:
        out.print(
            f"{r['aux_threads']} auxiliary threads spliced into their main traces; fed apart: "
            f"{r['forks_apart_tokens']} tokens, {r['forks_apart_s']:.3f} s; apart / spliced: tokens "
            f"{r['forks_token_ratio']:.2f}, time {r['forks_time_ratio']:.2f}"
        )


def bench_trainer_hf(
    model_dir: Annotated[Path, typer.Option("--model", help="Checkpoint folder the traces were made with.")],
    traces: Annotated[Path, typer.Option("--traces", help="Stream traces (a run's traces.jsonl).")] = Path(
        "runs/bench_sidequest_replicate/a-sidequest-every2/traces.jsonl"
    ),
    traces_count: Annotated[int, typer.Option(help="Main traces with evictions to use (the first).")] = 8,
    lora_r: Annotated[int, typer.Option(help="LoRA rank (alpha = 2 r, all seven projections).")] = 16,
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed repeats (median is reported).")] = 3,
    chunk: Annotated[int, typer.Option(help="Query chunk of the stream's chunked attention.")] = 256,
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    backend: Annotated[
        str, typer.Option(help="Our attention: chunked (CPU) | flex (CUDA) | dense.")
    ] = "chunked",
    precision: Annotated[
        str, typer.Option(help="float32 | bfloat16 (both arms autocast; ours in float32 timed beside them).")
    ] = "float32",
    output: Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Forward+backward of our stream trainer vs transformers + peft (SDPA, 4-D eviction mask), LoRA,
    on the same traces; exits 1 if their float32 log-probs differ by more than 5e-5 (or, in
    bfloat16, if ours are further from float32 than theirs)."""
    from compactrl.bench.trainer_hf import run_trainer_hf_bench

    if not (model_dir / "config.json").exists():
        fail(f"--model {model_dir} has no config.json; point at a Hugging Face checkpoint folder")
    if not traces.is_file():
        fail(f"--traces {traces} does not exist; pass a run's traces.jsonl (rollout/eval --traces write one)")
    for name, v in (("traces-count", traces_count), ("lora-r", lora_r), ("threads", threads),
                    ("repeats", repeats), ("chunk", chunk)):  # fmt: skip
        if v < 1:
            fail(f"--{name} must be at least 1, got {v}")
    if backend not in ("chunked", "flex", "dense"):
        fail(f"--backend {backend!r} is not one of chunked, flex, dense")
    if backend == "flex" and not device.startswith("cuda"):
        fail("--backend flex needs --device cuda: flex attention has no backward on CPU")
    if precision not in ("float32", "bfloat16"):
        fail(f"--precision {precision!r} is not one of float32, bfloat16")
    check_device(device)
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        fail(f"bench trainer-hf compares against transformers + peft, and {e.name} is missing: "
             "pip install 'compactrl[test,lora]'")  # fmt: skip
    with progress_bar("bench trainer-hf") as progress:
        try:
            r = run_trainer_hf_bench(
                model_dir, traces, lora_r=lora_r, n_traces=traces_count, repeats=repeats, threads=threads,
                chunk=chunk, device=device, backend=backend, precision=precision, progress=progress,
            )  # fmt: skip
        except ValueError as e:
            fail(str(e))
    if not save_result(r, output, as_json):
        print_trainer_hf(r)
    if not r["same_values"] or not r.get("no_less_exact", True):
        raise typer.Exit(1)


def print_trainer_hf(r: dict) -> None:
    m = r["machine"]
    out.print(f"{m['cpu']} · {m['device']} · {m['threads']} threads · {model_label(r['model'])} "
              f"· LoRA r {r['lora']['r']}")  # fmt: skip
    out.print(f"{r['n_traces']} traces, {r['tokens']} tokens ({r['evicted_tokens']} evicted, "
              f"{r['trainable_tokens']} trained) from {r['traces']}")  # fmt: skip
    out.print(f"forward+backward: ours {r['ours_s']:.3f} s ({r['ours_tokens_per_s']:.0f} tok/s), "
              f"transformers+peft {r['hf_s']:.3f} s ({r['hf_tokens_per_s']:.0f} tok/s), "
              f"hf / ours {r['ours_vs_hf']:.2f}")  # fmt: skip
    out.print(f"max |log-prob diff| {r['max_abs_logprob_diff']:.1e} (tolerance {r['tolerance']:.0e}), "
              f"LoRA grads rel. diff {r['max_rel_lora_grad_diff']:.1e}, "
              f"causal-mask control {r['causal_mask_diff']:.2e} (must be > 1e-3)")  # fmt: skip
    if r["dtype"] == "bfloat16":
        d = r["bfloat16_vs_float32"]
        out.print(f"forward+backward in {r['dtype']} (the times above), ours in float32 "
                  f"{r['ours_float32_s']:.3f} s: bfloat16 {r['bfloat16_speedup']:.2f}x faster")  # fmt: skip
        for arm, name in (("ours", "ours"), ("hf", "transformers+peft")):
            out.print(f"{name} vs its float32: mean |log-prob diff| {d[arm]['mean_abs_logprob_diff']:.4f}, "
                      f"max {d[arm]['max_abs_logprob_diff']:.3f}, "
                      f"LoRA grad cosine {d[arm]['min_lora_grad_cosine']:.4f}")  # fmt: skip


def bench_scale(
    config: Annotated[Path, typer.Argument(help="Train config of the workload.")] = Path(
        "configs/train/scale.toml"
    ),
    overrides: SetOption = None,
    layout: Annotated[
        list[str] | None, typer.Option(help="Layouts to run (repeatable; default all).")
    ] = None,
    output: Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """RL steps/s: one process against rollout workers and data-parallel ranks on Ray."""
    from compactrl.bench.scale import LAYOUTS, markdown, run_scale_bench
    from compactrl.rl.config import TrainConfig

    try:
        import ray  # noqa: F401
    except ImportError:
        fail("bench scale runs Ray layouts: pip install 'compactrl[ray]'")
    cfg = load_run_config(TrainConfig, config, overrides)
    with progress_bar("bench scale") as progress:
        try:
            result = run_scale_bench(cfg, Path(cfg.out), layout or list(LAYOUTS), progress)
        except ValueError as e:
            fail(str(e))
    if not save_result(result, output, as_json):
        out.print(markdown(result))
