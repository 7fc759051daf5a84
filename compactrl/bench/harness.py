"""What every benchmark shares: the machine it ran on, timing one call, arms that take turns in
rounds (so drift on a shared machine hits them alike), and the median with its spread."""

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from compactrl.models.decoder import CausalLM
from compactrl.provenance import cpu_features, cpu_name

R = TypeVar("R")


def machine_info(threads: int, device: str = "cpu") -> dict:
    """The facts a reader needs to weigh a timing: CPU and its features, cores, threads, versions."""
    return {
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
    }


def timed(fn: Callable[[], int], model: CausalLM) -> tuple[float, int]:
    """Seconds of one ``fn()`` on ``model`` (its gradients cleared first; CUDA synchronised), and
    what ``fn`` returned (tokens fed)."""
    model.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    n = fn()
    sync()
    return time.perf_counter() - t0, n


def interleaved(
    arms: dict[str, Callable[[], R]],
    repeats: int,
    *,
    warmup: bool = True,
    alternate: bool = False,
    advance: Callable[[], None] = lambda: None,
) -> dict[str, list[R]]:
    """Every arm once per round, in turn (A B C, A B C, ...; ``alternate``: C B A every other round,
    so no arm always goes first), ``repeats`` rounds; ``warmup`` runs one untimed round before them
    (allocator, first-call overheads, compiles), so no kept run starts cold. Returns each arm's
    results in order; ``advance`` is called after every run (a progress bar)."""
    out: dict[str, list[R]] = {name: [] for name in arms}
    for rnd in range(repeats + warmup):
        order = list(arms)[:: -1 if alternate and (rnd - warmup) % 2 else 1]
        for name in order:
            result = arms[name]()
            if rnd >= warmup:
                out[name].append(result)
            advance()
    return out


def in_ms(fn: Callable[[], object], per: int = 1) -> Callable[[], float]:
    """``fn`` as an arm of :func:`interleaved` that returns its wall milliseconds (over ``per``)."""

    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3 / per

    return run


def decoding_engine(model: str, batch: int, context: int, rounds: int, block: int = 4, dtype="float32"):
    """An engine on the checkpoint ``model`` (in ``dtype``) with ``batch`` sessions of ``context``
    prompt tokens, prefilled and each set to decode enough tokens (EOS ignored) for
    :func:`toggled_steps` over ``rounds`` rounds of ``block`` steps per arm."""
    from compactrl.engine import Engine, EngineConfig
    from compactrl.engine.sampling import SamplingParams
    from compactrl.models.loading import load_model

    lm = load_model(model, dtype=dtype)
    steps = (2 * rounds + 2) * block + 2  # two arms, a warm-up round, two spare
    eng = Engine(lm, None, EngineConfig(kv_pool_tokens=batch * (context + steps + 8), max_step_tokens=2048))
    sessions = [eng.session() for _ in range(batch)]
    for k, s in enumerate(sessions):
        s.append([(7 * k + 13 * i) % (lm.config.vocab_size - 10) + 5 for i in range(context)])
    eng.run()
    for k, s in enumerate(sessions):
        s.generate(SamplingParams(max_tokens=steps, seed=k, ignore_eos=True))
    return eng


def toggled_steps(eng, use: Callable[[bool], None], on: str, off: str, rounds: int, block: int = 4) -> dict:
    """Decode steps of ``eng`` (from :func:`decoding_engine`) with a kernel in use (arm ``on``,
    ``use(True)``) and not (arm ``off``, ``use(False)``), blocks of ``block`` steps taking turns
    (:func:`interleaved`); the kernel is left in use. Toggling inside one engine keeps the cache, the
    process and the minute the same for both arms, as runs in separate processes cannot. Returns
    the median milliseconds per step of each arm, ``on``'s speed-up and every round's times."""

    def run(flag: bool) -> None:
        use(flag)
        for _ in range(block):
            eng.step()

    step, speed_up, ms = toggled(run, use, on, off, rounds, per=block)
    return {"ms_per_step": step, "speed_up": speed_up, "rounds_ms": ms}


def toggled_prefills(
    eng, use: Callable[[bool], None], on: str, off: str, sessions: int, tokens: int, rounds: int
) -> dict:
    """Prefills of ``sessions`` fresh prompts of ``tokens`` in ``eng`` with a kernel in use (arm
    ``on``) and not (arm ``off``), taking turns (:func:`toggled`); each prefill's sessions are
    closed after it, so the engine needs room for one prefill only. Median ms, ``on``'s speed-up
    and every round's times."""
    prompt, vocab = 0, eng.model.config.vocab_size

    def prefill(flag: bool) -> None:
        nonlocal prompt
        use(flag)
        prompt += 1
        batch = [eng.session() for _ in range(sessions)]
        for k, s in enumerate(batch):
            s.append([(7 * (prompt + k) + 13 * i) % (vocab - 10) + 5 for i in range(tokens)])
        eng.run()
        for s in batch:
            s.close()

    step, speed_up, ms = toggled(prefill, use, on, off, rounds)
    return {"sessions": sessions, "tokens": tokens, "ms": step, "speed_up": speed_up, "rounds_ms": ms}


def toggled(
    run: Callable[[bool], None], use: Callable[[bool], None], on: str, off: str, rounds: int, per: int = 1
):
    """``run(True)`` (arm ``on``) and ``run(False)`` (arm ``off``) taking turns (:func:`interleaved`),
    then ``use(True)``: each arm's median milliseconds (over ``per``), ``on``'s speed-up and every
    round's times."""
    arms = {on: in_ms(lambda: run(True), per=per), off: in_ms(lambda: run(False), per=per)}
    ms = interleaved(arms, rounds, alternate=True)
    use(True)
    step = medians(ms)
    return step, step[off] / step[on], ms


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(v) for name, v in times.items()}


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A bench's table as markdown: the documentation renders the same columns the CLI prints."""
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)
