"""`compactrl verify`: our numbers against an independent oracle; every check exits 1 on a mismatch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from compactrl.cli.common import PLAIN, JsonFlag, check_device, emit_json, fail, out

app = typer.Typer(help="Numerical checks against an independent oracle.", **PLAIN)


def report(result: dict, as_json: bool, show: Callable[[dict], None]) -> None:
    """The JSON with --json, else ``show``'s rendering; a failed check exits 1 either way."""
    if as_json:
        emit_json(result)
    else:
        show(result)
    if not result["ok"]:
        raise typer.Exit(1)


@app.command("model")
def verify_model_cmd(
    model_dir: Annotated[
        Path | None, typer.Argument(help="A HF checkpoint folder; default: build tiny Llama, Qwen2, Qwen3.")
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16")] = "float32",
    tolerance: Annotated[
        float | None, typer.Option(help="Max |logit diff| (default 1e-4 in float32).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Compare our logits with transformers' on the same checkpoint; exit 1 on a mismatch."""
    import torch

    from compactrl.verify import verify_model

    torch.set_num_threads(1)
    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"{model_dir} has no config.json; point at a HF checkpoint folder or omit it")
    try:
        result = verify_model(model_dir, dtype=dtype, tolerance=tolerance)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        fail(str(e))
    report(result, as_json, print_model)


def print_model(result: dict) -> None:
    table = Table("family", "parameters", "max |logit diff| causal", "with eviction mask")
    for fam, r in result["families"].items():
        table.add_row(
            fam,
            f"{r['parameters']:,}",
            f"{r['max_abs_logit_diff']:.2e}",
            f"{r['max_abs_logit_diff_evict_mask']:.2e}",
        )
    out.print(table)
    out.print(
        ("[green]OK" if result["ok"] else "[red]MISMATCH") + f"[/] (tolerance {result['tolerance']:.0e})"
    )


@app.command("trainer")
def verify_trainer_cmd(
    device: Annotated[
        str, typer.Option(help="cpu | cuda (flex attention is checked with backward on CUDA).")
    ] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32 | float64 | bfloat16")] = "float32",
    streams: Annotated[int, typer.Option(help="Randomised streams with several evictions each.")] = 8,
    length: Annotated[int, typer.Option(help="Tokens per stream.")] = 160,
    as_json: JsonFlag = False,
) -> None:
    """One-pass masked forward (every attention backend) vs a token-by-token evicting KV cache."""
    import torch

    from compactrl.models.loading import DTYPES
    from compactrl.verify import verify_trainer

    if dtype not in DTYPES:
        fail(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda but torch sees no CUDA device (is this a CPU build of torch?)")
    if streams < 1 or length < 16:
        fail("--streams must be >= 1 and --length >= 16")
    torch.set_num_threads(1)
    result = verify_trainer(device, dtype, n_streams=streams, length=length)
    report(result, as_json, print_trainer)


def print_trainer(result: dict) -> None:
    table = Table("backend", "max |logprob diff|", "max rel grad diff vs dense")
    for b, d in result["max_abs_logprob_diff"].items():
        g = result["max_rel_grad_diff_vs_dense"].get(b)
        table.add_row(b, f"{d:.2e}", "-" if g is None else f"{g:.2e}")
    out.print(table)
    nc = result["negative_control"]
    out.print(
        f"negative controls (must be >= 0.1): causal {nc['causal_diff']:.2f}, "
        f"re-prefill {nc['reprefill_diff']:.2f}"
    )
    out.print("[green]OK" if result["ok"] else "[red]MISMATCH")


@app.command("engine")
def verify_engine_cmd(
    sessions: Annotated[int, typer.Option(help="Randomised multi-turn sessions (forks are added).")] = 32,
    seed: int = 0,
    pool: Annotated[
        int | None, typer.Option(help="KV pool in tokens (default: small enough to preempt).")
    ] = None,
    model_dir: Annotated[
        Path | None, typer.Option("--model", help="Checkpoint folder (default: a tiny random Qwen3).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16 | float64")] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    as_json: JsonFlag = False,
) -> None:
    """Engine log-probs vs the trainer's one-pass forward over the exported traces; exit 1 on failure.
    float32/float64 are gated on max |logprob diff|; bfloat16/float16 on the mean KL per sampled token."""
    import torch

    from compactrl.models.loading import DTYPES
    from compactrl.verify import verify_engine

    if sessions < 1:
        fail("--sessions must be >= 1")
    if pool is not None and pool < 64:
        fail("--pool must be >= 64 tokens")
    if dtype not in DTYPES:
        fail(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_device(device)
    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"--model {model_dir} has no config.json")
    torch.set_num_threads(1)
    try:
        result = verify_engine(sessions, seed, pool, model_dir, dtype, device)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    report(result, as_json, print_engine)


def print_engine(result: dict) -> None:
    out.print(
        f"{result['model']} · {result['dtype']} · {result['device']} · GEMMs {result['matmul']}: "
        f"{result['sessions']} sessions ({result['forks']} forks), "
        f"{result['sampled_tokens']} sampled tokens, {result['evictions']} evictions, "
        f"{result['preemptions']} preemptions, {result['one_call_steps']} decode steps with every layer in "
        "one call"
    )
    tol, kl_tol = result["tolerance"], result["kl_tolerance"]
    out.print(
        f"max |logprob diff| engine vs trainer: {result['max_abs_logprob_diff']:.2e}"
        + (f" (<= {tol:g})" if tol is not None else " (reported)")
    )
    out.print(
        f"KL(engine || trainer) per sampled token: mean {result['mean_kl']:.2e}"
        + (f" (<= {kl_tol:g})" if kl_tol is not None else "")
        + f", max {result['max_kl']:.2e}"
    )
    out.print(f"negative control, re-prefill: {result['reprefill_diff']:.2f} nats (>= 0.1)")
    out.print("[green]OK" if result["ok"] else "[red]MISMATCH")


@app.command("run")
def verify_run_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `compactrl rollout`.")],
    model_dir: Annotated[Path | None, typer.Option("--model", help="Default: the run's model.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """A rollout run's logged log-probs vs the trainer's one-pass forward; exit 1 above 5e-5."""
    import torch

    from compactrl.verify import verify_run

    torch.set_num_threads(1)
    try:
        result = verify_run(run_dir, model_dir)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    report(result, as_json, print_run)


def print_run(result: dict) -> None:
    out.print(
        f"{result['traces']} traces ({result['mode']}), {result['sampled_tokens']} sampled tokens, "
        f"{result['evicted_tokens']} evicted tokens"
    )
    out.print(f"max |logprob diff| engine vs trainer: {result['max_abs_logprob_diff']:.2e} (<= 5e-5)")
    out.print("[green]OK" if result["ok"] else "[red]MISMATCH")


@app.command("kvpress")
def verify_kvpress_cmd(
    kvpress_python: Annotated[
        Path,
        typer.Option(
            "--kvpress-python",
            help="python of a virtualenv with kvpress 0.5.5 (its own: kvpress pins transformers<5.3).",
        ),
    ],
    model_dir: Annotated[
        Path | None,
        typer.Option("--model", help="A HF checkpoint folder; default: tiny Llama, Qwen2, Qwen3."),
    ] = None,
    tokens: Annotated[int, typer.Option(help="Prefill length (seeded random token ids).")] = 64,
    seed: int = 0,
    window: Annotated[int, typer.Option(help="SnapKV's observation window (window_size).")] = 8,
    kernel: Annotated[int, typer.Option(help="SnapKV's pooling kernel (kernel_size, odd).")] = 5,
    sinks: Annotated[int, typer.Option(help="StreamingLLM's sink tokens (n_sink).")] = 4,
    compression_ratio: Annotated[
        float, typer.Option(help="kvpress's pruned share, for the kept-set check.")
    ] = 0.5,
    tolerance: Annotated[float, typer.Option(help="Max |score diff| (float32).")] = 1e-4,
    as_json: JsonFlag = False,
) -> None:
    """Our evictors' per-KV-head scores vs kvpress's presses on one prefill; exit 1 above 1e-4.
    What is compared for each method (and why not more) is in compactrl/bench/kvpress_parity.py."""
    import torch

    from compactrl.bench.kvpress_parity import KvpressError, check_params, verify_kvpress

    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"--model {model_dir} has no config.json; point at a HF checkpoint folder or omit it")
    try:
        check_params(tokens, window, kernel, sinks, compression_ratio)
    except ValueError as e:
        fail(str(e))
    torch.set_num_threads(1)
    try:  # checks the interpreter (kvpress importable) before loading any model
        result = verify_kvpress(
            kvpress_python, model_dir, tokens, seed, window, kernel, sinks, compression_ratio, tolerance
        )
    except (KvpressError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    report(result, as_json, print_kvpress)


def print_kvpress(result: dict) -> None:
    v = result["versions"]
    out.print(f"kvpress {v['kvpress']} · transformers {v['transformers']} · torch {v['torch']} (theirs)")
    for name, r in result["models"].items():
        table = Table("method", "kvpress press", "scores compared", "max |diff|", "kept set per head")
        table.title = f"{name}: {r['n_tokens']} tokens, {r['n_kept']} kept per head"
        for m, c in r["methods"].items():
            diff = "-" if c.get("max_abs_diff") is None else f"{c['max_abs_diff']:.2e}"
            table.add_row(m, c["kvpress"] or "-", c["compared"], diff, kept_set(c))
        out.print(table)
        nc = ", ".join(f"{k} {d:.2e}" for k, d in r["negative_controls"].items())
        out.print(f"negative controls (must be > {10 * result['tolerance']:.0e}): {nc}")
    out.print(
        ("[green]OK" if result["ok"] else "[red]MISMATCH") + f"[/] (tolerance {result['tolerance']:.0e})"
    )


def kept_set(c: dict) -> str:
    """Whether the two sides keep the same KV entries per head (ties can make them differ)."""
    if c.get("kept_equal") is None:
        return "-"
    differ = f"{c['kept_heads_differ']}/{c['kept_heads']} differ"
    kept = "equal" if c["kept_equal"] else differ
    return kept + (f" ({c['kept_ties']} ties)" if c["kept_ties"] else "")
