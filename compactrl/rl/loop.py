"""`compactrl train CONFIG`: sample with the engine, train, repeat — on one shared model.

The loop itself: each step runs the run's objective (:mod:`compactrl.rl.objectives`; the first
``sft_steps`` are SFT on demonstrations), then logs, checkpoints and evaluates. The engine and the
trainer share the model object, so an update reaches the engine in place with nothing to copy (the
engine's fused projection reads views of the same parameters); by default sampling is synchronous,
so rollouts are never stale (``max_lag`` samples ahead: ``rl/sampler.py``). Metrics go to
``metrics.jsonl`` (and TensorBoard when installed); checkpoints go to ``checkpoints/`` and
``--resume`` continues from the newest exactly: the data of step N depends only on N and the seed.
Where trainer ranks and rollout engines live is a :class:`Placement`: one process here;
:func:`compactrl.cluster.launch` runs the same loop with Ray actors (``[cluster] backend = "ray"``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from compactrl.agent.batch import load_engine
from compactrl.agent.chat import ChatFormat
from compactrl.compaction import build_strategy
from compactrl.models.loading import load_model, save_model
from compactrl.models.lora import Adapters, gate_adapters, load_thread_adapter
from compactrl.provenance import provenance
from compactrl.rl.checkpoint import latest_checkpoint, load_checkpoint, remove_partial_writes, save_checkpoint
from compactrl.rl.config import TrainConfig
from compactrl.rl.critic import ValueHead
from compactrl.rl.evaluate import record_eval
from compactrl.rl.monitor import Monitor, check_log_settings, note
from compactrl.rl.objectives import SFT, Objective, Run
from compactrl.rl.sampler import BackgroundSampler
from compactrl.rl.trainer import Trainer
from compactrl.run_dir import RunDirError, open_run_dir


class Placement:
    """Where a run's trainer ranks and rollout engines live: here, in one process (the default).
    :class:`compactrl.cluster.RayPlacement` puts them on Ray actors; the loop is the same."""

    def trainer(self, cfg: TrainConfig, model, head) -> Trainer:
        return Trainer(model, cfg.train, head, temperature=cfg.rollout.temperature)  # LoRA too

    def start(self, trainer: Trainer, cfg: TrainConfig) -> None:
        """After any resume: other ranks would copy the (resumed) weights and optimizer here."""

    def sampler(self, cfg: TrainConfig, model, tokenizer, fmt, strategy, first: int):
        """Where RL batches come from when not sampled in the loop (None: in the loop)."""
        return BackgroundSampler(cfg, model, tokenizer, fmt, strategy, first) if cfg.max_lag else None


def _reference(cfg: TrainConfig, model, run_dir: Path, fresh: bool):
    """The frozen reference of ``train.kl_ref`` and the distillation teacher: the policy as RL begins,
    kept in ``run_dir/reference`` so that a resumed run penalises the distance to the same model."""
    folder = run_dir / "reference"
    if fresh:
        tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=".reference-"))
        save_model(model, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    elif not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--resume past the start of RL needs the reference model in {folder}")
    return load_model(folder, dtype=cfg.model.dtype).eval().requires_grad_(False)


class Interrupted(Exception):
    """Ctrl-C stopped training after a whole step; a checkpoint of that step was saved."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted after step {step}: saved {checkpoint}; continue with --resume")
        self.step, self.checkpoint = step, checkpoint


@contextmanager
def _finish_step_on_interrupt():
    """The first Ctrl-C sets a flag the loop checks after each step (which then checkpoints and
    stops); a second one stops at once, without a checkpoint. Main thread only (signals)."""
    flag = threading.Event()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    ):
        yield flag  # a thread cannot take signals; an ignored SIGINT (nohup, a background job) stays so
        return

    def first(signum, frame):
        note("Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again stops now, unsaved)")
        flag.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _resume_point(run_dir: Path, model, trainer: Trainer, modules: dict) -> dict:
    """Load the newest complete checkpoint (saying which, and what it fell back from); none: step 0."""
    remove = remove_partial_writes(run_dir)
    if remove:
        note(f"removed {len(remove)} unfinished checkpoint write(s) in {run_dir / 'checkpoints'}")
    skipped: list[str] = []
    ckpt = latest_checkpoint(run_dir, skipped)
    for reason in skipped:
        note(f"skipping a checkpoint: {reason}")
    if ckpt is None:
        note(f"no complete checkpoint in {run_dir / 'checkpoints'}: the run starts again from step 0")
        return {"step": 0, "state": {}}
    loaded = load_checkpoint(ckpt, model, trainer.optimizer, modules, checked=True)  # latest_checkpoint did
    return loaded | {"checkpoint": ckpt}


def train(
    cfg: TrainConfig,
    resume: bool = False,
    progress=None,
    on_step=None,
    overwrite: bool = False,
    placement: Placement | None = None,
) -> dict:
    """Run (or resume) training; returns the last step's metrics. A folder that already holds a
    run needs ``resume`` (continue it) or ``overwrite`` (delete it first): two runs never mix."""
    if placement is None and cfg.cluster.backend != "local":
        raise ValueError(
            f"cluster.backend = {cfg.cluster.backend!r} places the run on actors: start it with "
            "compactrl.cluster.launch(cfg) (what `compactrl train` does), not rl.loop.train"
        )
    placement = placement or Placement()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # initialises what the run creates (critic, LoRA adapters) reproducibly
    run_dir = Path(cfg.out)
    check_log_settings(cfg.log)
    keep = [Path(cfg.model.path)] if cfg.model.path else []
    open_run_dir(run_dir, cfg, resume, overwrite, keep)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
    engine = load_engine(cfg.model, cfg.engine, run_dir)
    source = cfg.model.folder(run_dir)  # the tokenizer files checkpoints carry
    model = engine.model
    if getattr(cfg.strategy, "thread_adapter", None):  # frozen, on the threads' tokens; before the run's LoRA
        load_thread_adapter(model, cfg.strategy.thread_adapter)
    fmt = ChatFormat.from_tokenizer(
        engine.tokenizer, cfg.rollout.chat_rewrites, cfg.rollout.chat_template_kwargs
    )
    strategy = build_strategy(cfg.strategy)
    objective: Objective = cfg.objective
    critic = getattr(objective, "advantage", None) == "gae"
    head = ValueHead(model.config.hidden_size) if critic else None
    trainer = placement.trainer(cfg, model, head)
    modules = {"value_head": head} if head is not None else {}
    if cfg.train.lora:  # the base stays the initial model; checkpoints carry the adapters
        modules["lora"] = Adapters(model, cfg.train.lora)
        if getattr(objective, "adapter", None) == "thread":
            gate_adapters(model)  # on the auxiliary threads' tokens only, in the engine and the trainer
    loaded = _resume_point(run_dir, model, trainer, modules) if resume else {"step": 0, "state": {}}
    placement.start(trainer, cfg)
    run = Run(cfg, engine, fmt, strategy, trainer)
    warmup, sampling = SFT(), False  # the first sft_steps; whether the sampler is set up
    start = loaded["step"]
    weights = {"model": source, "thread_adapter": getattr(cfg.strategy, "thread_adapter", None)}
    with open(run_dir / "provenance.jsonl", "a") as f:  # one line each time the run starts or resumes
        f.write(json.dumps({"from_step": start} | provenance(weights)) + "\n")
    data_position = loaded["state"].get("data_position", start)  # the last batch of env seeds trained on
    earlier = loaded["state"]  # the run's time up to that checkpoint (wall_s leaves evaluations out)
    if start > cfg.steps:
        raise RunDirError(
            f"steps = {cfg.steps} but the run's checkpoint is at step {start}: resume with steps >= {start}"
        )
    if resume and start == cfg.steps:
        note(f"the run is already at step {start} = steps; --set steps=N (N > {start}) extends it")
    elif start:
        note(f"resuming from step {start} of {cfg.steps} ({loaded['checkpoint']})")
    monitor = Monitor(run_dir, cfg.log, start, json.loads(cfg.model_dump_json()))
    advance = progress(cfg.steps - start) if progress else (lambda info=None: None)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if resume and summary_path.exists() else {}
    last: dict = summary.get("last_step", {}) if start == cfg.steps else {}
    clock = (time.perf_counter(), time.process_time())
    evaluating = [0.0]  # seconds of this part spent in evaluations

    def times() -> dict:
        eval_s = earlier.get("eval_s", 0.0) + evaluating[0]
        wall = earlier.get("wall_s", 0.0) + time.perf_counter() - clock[0] - evaluating[0]
        return {
            "wall_s": wall,
            "eval_s": eval_s,
            "cpu_s": earlier.get("cpu_s", 0.0) + time.process_time() - clock[1],
        }

    def evaluate(when: str) -> dict:  # evaluations are left out of the run's wall_s
        t = time.perf_counter()
        stats = record_eval(cfg, engine, summary, when)
        evaluating[0] += time.perf_counter() - t
        return stats

    def checkpoint(step: int) -> Path:
        state = {"data_position": data_position, **times()}
        return save_checkpoint(run_dir, step, model, trainer.optimizer, state, modules,
                               keep=cfg.checkpoint_keep, tokenizer_dir=source)  # fmt: skip

    try:
        with _finish_step_on_interrupt() as interrupted:
            for step in range(start + 1, cfg.steps + 1):
                if step == cfg.sft_steps + 1 and cfg.eval_episodes:
                    evaluate("before")
                for group in trainer.optimizer.param_groups:  # the warm-up may have its own learning rate
                    group["lr"] = cfg.sft_lr if step <= cfg.sft_steps and cfg.sft_lr else cfg.train.lr
                now: Objective = warmup if step <= cfg.sft_steps else objective  # the same optimizer
                if (now.anchored or cfg.train.kl_ref and now.rollouts) and trainer.reference is None:
                    trainer.reference = _reference(cfg, model, run_dir, fresh=step == cfg.sft_steps + 1)
                if now.rollouts and not sampling:  # sampled ahead, or on rollout workers, from here on
                    run.sampler = placement.sampler(cfg, model, engine.tokenizer, fmt, strategy,
                                                    data_position + 1)  # fmt: skip
                    sampling = True
                last = now.step(run, step)
                data_position = run.sampler.next_index - 1 if run.sampler is not None else step
                last["wall_s"] = times()["wall_s"]
                rl_step, stats = step - cfg.sft_steps, None
                if cfg.eval_episodes and step == cfg.steps:
                    stats = evaluate("after")
                elif cfg.eval_every and rl_step > 0 and rl_step % cfg.eval_every == 0:
                    stats = evaluate("during")
                if stats is not None and cfg.eval_every:
                    last |= {"eval_success": stats["success_rate"], "eval_reward": stats["mean_reward"]}
                monitor.log(last)
                saved = checkpoint(step) if step % cfg.checkpoint_every == 0 or step == cfg.steps else None
                if on_step is not None:
                    on_step(last)
                advance(f"reward {last['reward']:.3f}" if "reward" in last else f"loss {last['loss']:.2e}")
                if interrupted.is_set():
                    raise Interrupted(step, saved or checkpoint(step))
    finally:
        if run.sampler is not None:
            run.sampler.close()
        monitor.close()
    summary |= times()  # the whole run, all resumed parts (to the last checkpoint), evaluations apart
    summary["wall_s_this_part"] = time.perf_counter() - clock[0]
    summary["last_step"] = last
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return last
