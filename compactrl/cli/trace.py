"""`compactrl trace`: read rollout traces as text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from compactrl.cli.common import PLAIN, fail, out

app = typer.Typer(help="Inspect rollout traces.", **PLAIN)


@app.command("show")
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
        if not traces:  # as `verify run` says of it
            raise TraceError(f"{file} holds no traces")
        tok = Tokenizer.from_dir(tokenizer) if tokenizer else None
        if tok is not None:
            for t in traces:
                t.validate(vocab_size=tok.vocab_size)
        show_traces(traces, out, tokenizer=tok, index=index, at=at, max_tokens=max_tokens)
    except (TraceError, TraceViewError, ValueError) as e:
        fail(str(e))
