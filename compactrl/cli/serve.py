"""`compactrl serve`: the OpenAI-compatible server, its arguments checked before any model loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from compactrl.cli.common import check_device, fail


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
