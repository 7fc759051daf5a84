"""Scale-out on a real local Ray cluster (2 CPUs): data-parallel ranks take one process's update,
rollout workers give one process's rollouts token for token, a killed worker's episodes rerun,
and a killed driver resumes with --resume."""

import copy
import json
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from test_trainer import engine_traces, samples_of

from compactrl.cluster import ClusterConfig, connect, launch
from compactrl.config import load_config
from compactrl.rl.config import TrainConfig
from compactrl.rl.trainer import Sample, Trainer, token_weights
from compactrl.trace import Trace

ray = pytest.importorskip("ray")

QUICK = ["steps=12", "checkpoint_every=2", "threads=1"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_rollouts_split_whole_and_balanced_by_tokens():
    from compactrl.cluster.data_parallel import split_by_tokens

    def sample(n, seq):
        return Sample(Trace.from_tokens(np.arange(n)), np.zeros(n, np.float32), seq)

    # rollout 0 has two re-prefill segments (50 + 40 tokens): they stay together
    samples = [sample(50, 0), sample(10, 1), sample(40, 0), sample(60, 2), sample(30, 3), sample(20, 4)]
    shares = split_by_tokens(samples, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    owner = {samples[i].sequence: r for r, s in enumerate(shares) for i in s}
    assert all(owner[samples[i].sequence] == r for r, s in enumerate(shares) for i in s)
    assert [sum(len(samples[i].trace) for i in s) for s in shares] == [110, 100]  # 90|60, +30|+20, +10
    assert split_by_tokens(samples, 2) == shares and split_by_tokens(samples, 1) == [list(range(6))]


def test_inconsistent_cluster_sections_are_refused():
    with pytest.raises(ValueError, match="need cluster.backend = 'ray'"):
        ClusterConfig(rollout_workers=2)
    with pytest.raises(ValueError, match="names a Ray cluster: set cluster.backend = 'ray' or drop it"):
        ClusterConfig(address="auto")
    with pytest.raises(ValueError, match="is one process"):
        ClusterConfig(backend="ray")
    with pytest.raises(ValueError, match="objective 'sidequest' plays demonstrations"):
        load_config(TrainConfig, "configs/sidequest/train.toml",
                    ["model.path=", "cluster.backend=ray", "cluster.rollout_workers=2"])  # fmt: skip


def test_a_cluster_too_small_for_the_actors_is_refused(cluster):
    with pytest.raises(ValueError, match="has 2 CPUs but \\[cluster\\] asks for 3"):
        connect(ClusterConfig(backend="ray", rollout_workers=3))


def one_and_two_ranks(tiny_lm):
    """Samples, and a one-process trainer beside two data-parallel ranks, from the same weights."""
    from compactrl.cluster.data_parallel import DataParallelTrainer

    torch.set_num_threads(1)
    samples = samples_of(engine_traces(tiny_lm, n=6))
    # one trace per micro-batch on both sides: the forwards are the same computations, so what is
    # left to differ is the order the per-trace gradients are summed in (float32 rounding, which
    # AdamW's m / sqrt(v) scales up where a gradient is tiny: TOL; the normalisation bug gives 1e-4)
    cfg = load_config(TrainConfig, None, ["cluster.backend=ray", "cluster.trainer_workers=2",
                                          "train.lr=1e-3", "train.micro_batch_tokens=1"])  # fmt: skip
    one = Trainer(copy.deepcopy(tiny_lm), cfg.train)
    dp = DataParallelTrainer(copy.deepcopy(tiny_lm), cfg.train)
    dp.start(cfg)
    return samples, cfg, one, dp


TOL = 2e-6


def params(t):
    return torch.cat([p.detach().flatten() for p in t.params])


def test_two_trainer_ranks_take_the_one_process_update(cluster, tiny_lm):
    samples, cfg, one, dp = one_and_two_ranks(tiny_lm)

    try:
        for norm in ("token", "sequence", "constant"):  # the batch weights are rank 0's: its settings
            for t in (one, dp):
                t.settings = cfg.train.model_copy(update={"norm": norm, "norm_constant": 64.0})
            a, b = one.step(samples), dp.step(samples)
            assert float((params(one) - params(dp)).abs().max()) < TOL, norm
            assert b["trained_tokens"] == a["trained_tokens"] and abs(b["loss"] - a["loss"]) < 1e-6
            assert b["mismatch_kl"] == pytest.approx(a["mismatch_kl"], rel=1e-5)  # of weights 1e-6 apart
            rank1 = torch.cat([p.flatten() for p in dp.rank_parameters(1)])
            assert torch.equal(rank1, params(dp))  # every rank holds the same weights
        start = torch.cat([p.detach().flatten() for p in tiny_lm.parameters()])
        assert float((params(one) - start).abs().max()) > 1e-3  # the steps did move the weights

        def per_rank(samples, shares):  # the classic bug: each rank normalises over its own share
            return [token_weights([samples[i] for i in s], "token") for s in shares]

        dp.share_weights = per_rank
        for t in (one, dp):
            t.settings = cfg.train
        one.step(samples), dp.step(samples)
        assert float((params(one) - params(dp)).abs().max()) > 1e-4
    finally:
        dp.close()


def bounded(fn, seconds: float = 120.0):
    """``fn()`` in a daemon thread: its result or its exception, or a test failure after ``seconds``
    (a rank blocked in a collective then fails the test instead of hanging the suite)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still blocked after {seconds:g} s (a rank waits in a collective another never reaches)")
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_rank_that_fails_fails_the_step_on_every_rank_and_none_steps(cluster, tiny_lm, bad_rank):
    """A share that raises (a token id past the vocabulary) on rank 0 or on rank 1: the step raises,
    naming the rank and the cause, on the driver, and no rank blocks in the gradient all-reduce or
    takes the step; the next step is then one process's, on every rank."""
    from compactrl.cluster.data_parallel import split_by_tokens

    samples, cfg, one, dp = one_and_two_ranks(tiny_lm)
    bad = copy.deepcopy(samples)
    bad[split_by_tokens(samples, 2)[bad_rank][0]].trace.tokens[3] = 10**6  # past the vocabulary: a TraceError

    try:
        cause = f"failed on rank {bad_rank}: TraceError: .*>= vocab_size 300"
        with pytest.raises(RuntimeError, match=cause) as e:
            bounded(lambda: dp.step(bad))
        assert type(e.value).__name__ == "DataParallelError" and "--resume" in str(e.value)
        start = torch.cat([p.detach().flatten() for p in tiny_lm.parameters()])
        assert torch.equal(params(dp), start)  # no rank stepped
        assert torch.equal(torch.cat([p.flatten() for p in dp.rank_parameters(1)]), start)
        one.step(samples), bounded(lambda: dp.step(samples))  # the ranks go on together
        assert float((params(one) - params(dp)).abs().max()) < TOL
        assert torch.equal(torch.cat([p.flatten() for p in dp.rank_parameters(1)]), params(dp))
    finally:
        dp.close()


def _quickstart(out, *extra):
    return load_config(TrainConfig, "configs/quickstart.toml", [f"out={out}", *QUICK, *extra])


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rollout_workers_give_one_process_rollouts_token_for_token(cluster, tmp_path):
    from compactrl.agent.batch import load_engine
    from compactrl.agent.chat import ChatFormat
    from compactrl.cluster.rollout import RolloutPool
    from compactrl.compaction import build_strategy
    from compactrl.rl.sampler import sample_batch

    torch.set_num_threads(1)
    cfg = _quickstart(tmp_path, "cluster.backend=ray", "cluster.rollout_workers=2")
    engine = load_engine(cfg.model, cfg.engine, tmp_path)
    fmt, strategy = ChatFormat.from_tokenizer(engine.tokenizer), build_strategy(cfg.strategy)
    pool = RolloutPool(cfg, engine.model, engine.tokenizer, first_index=1)
    trainer = Trainer(engine.model, cfg.train)

    def same(a, b):
        assert [r.seed for r in a] == [r.seed for r in b] and len(a) == 16
        for x, y in zip(a, b):
            for s, t in zip(x.traces, y.traces, strict=True):
                assert np.array_equal(s.tokens, t.tokens) and np.array_equal(s.evict_at, t.evict_at)
                assert np.allclose(s.logprobs, t.logprobs, atol=1e-6, equal_nan=True)

    try:
        for index in (1, 2):
            batch, dropped = pool.get()
            assert (batch.index, batch.version, dropped, batch.restarts) == (index, index - 1, 0, 0)
            same(batch.results, sample_batch(cfg, engine, fmt, strategy, index))
            adv = np.array([r.reward for r in batch.results]) - np.mean([r.reward for r in batch.results])
            trainer.step([Sample(t, np.full(len(t), a, np.float32), i)
                          for i, (r, a) in enumerate(zip(batch.results, adv)) for t in r.traces])  # fmt: skip
            pool.push(engine.model)  # the workers sample the next batch on the updated weights
        pool.prefetch()  # batch 3 is on the workers; one of them is killed mid-step
        ray.kill(pool.workers[0])
        batch, _ = pool.get()
        assert (batch.index, batch.restarts, batch.rerun) == (3, 1, 8)  # its 8 episodes ran again
        same(batch.results, sample_batch(cfg, engine, fmt, strategy, 3))
    finally:
        pool.close()


def test_quickstart_on_rollout_workers_learns_as_one_process_and_resumes_after_the_driver_dies(
    cluster, tmp_path
):
    """Runs are equal token for token only while their weights are: an engine's batches depend on
    when env calls (threads) return, CPU GEMMs round differently with the batch's row count, and
    AdamW turns ~1e-7 gradient noise on near-zero-gradient weights into lr-sized steps. Two
    one-process runs of one seed already part after a few steps. So: step 1 (the same initial
    weights) equals one process's, the resumed step 5 (the step-4 checkpoint) equals the step 5
    the killed driver took, and both runs learn."""
    one = launch(_quickstart(tmp_path / "one"))
    a = _rows(tmp_path / "one")
    assert one["reward"] > a[0]["reward"] + 0.2
    ray_args = ["cluster.backend=ray", "cluster.rollout_workers=2", f"cluster.address={cluster}"]
    # the driver is killed (os._exit: no cleanup, no checkpoint) in step 5, after step 4's checkpoint
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, "tests")
        from test_cluster import _quickstart
        from compactrl.cluster import launch
        cfg = _quickstart({str(tmp_path / "two")!r}, *{ray_args!r})
        launch(cfg, on_step=lambda m: os._exit(9) if m["step"] == 5 else None)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert killed.returncode == 9, killed.stderr[-2000:]
    before = _rows(tmp_path / "two")
    assert len(before) == 5
    two = launch(_quickstart(tmp_path / "two", *ray_args), resume=True)
    b = _rows(tmp_path / "two")
    assert [r["step"] for r in b] == list(range(1, 13))  # step 5 taken again, logged once
    assert b[:4] == before[:4]  # the rows the checkpoint covers are kept as they were
    exact, close = ("reward", "tokens", "turns", "trained_tokens"), ("loss", "mismatch_kl", "grad_norm")
    for x, y in ((a[0], b[0]), (before[4], b[4])):  # the same weights, seeds and optimizer state
        assert [x[k] for k in exact] == [y[k] for k in exact]
        assert [x[k] for k in close] == pytest.approx([y[k] for k in close], rel=1e-3, abs=1e-6)
    assert two["reward"] > b[0]["reward"] + 0.2
    assert all(r["worker_restarts"] == 0 and r["rerun_episodes"] == 0 for r in b)


def test_rollout_workers_sample_ahead_within_the_lag_bound(cluster, tmp_path):
    wide = ["train.clip_low=0.99", "train.clip_high=100"]  # as the one-process test of max_lag
    cfg = _quickstart(tmp_path, "cluster.backend=ray", "cluster.rollout_workers=2", "max_lag=1", *wide)
    rows = []
    launch(cfg, on_step=rows.append)
    assert all(r["lag"] <= 1 and r["errors"] == 0 for r in rows)
    assert sum(r["lag"] == 1 for r in rows) >= len(rows) // 2  # the workers ran ahead of the trainer
    assert all(r["mismatch_kl"] < 1e-6 for r in rows if r["lag"] == 0)
    assert max(r["mismatch_kl"] for r in rows if r["lag"] == 1) > 1e-4  # stale rollouts show it
    assert all(r["sync_s"] > 0 for r in rows)  # weights went to the workers after every step


class Crash(Exception):
    pass


def test_two_trainer_ranks_train_as_one_process_and_resume_from_a_checkpoint(cluster, tmp_path):
    from compactrl.models.loading import load_model

    short = ["steps=4"]
    one = _quickstart(tmp_path / "one", *short)
    launch(one)
    dp = _quickstart(tmp_path / "dp", *short, "cluster.backend=ray", "cluster.trainer_workers=2")

    def crash(m):
        if m["step"] == 3:  # after the step-2 checkpoint
            raise Crash

    with pytest.raises(Crash):
        launch(dp, on_step=crash)
    launch(dp, resume=True)  # the second rank starts from the resumed weights and AdamW state
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "dp")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for k in ("reward", "tokens", "trained_tokens"):
        assert [r[k] for r in b] == [r[k] for r in a], k
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-3, abs=1e-6)
    x, y = (load_model(tmp_path / d / "checkpoints" / "step_00000004" / "model") for d in ("one", "dp"))
    pairs = zip(x.state_dict().values(), y.state_dict().values(), strict=True)
    assert max(float((p - q).abs().max()) for p, q in pairs) < 1e-4


def test_a_failed_data_parallel_step_stops_the_run_and_it_resumes(cluster, tmp_path, monkeypatch):
    """A share that raises on rank 0 in step 3: the run stops with the rank and the cause named,
    without blocking rank 1, and --resume continues from the step-2 checkpoint to the end."""
    from compactrl.rl import trainer

    accumulate, calls = trainer.Trainer._accumulate, []

    def flaky(self, *args, **kwargs):  # rank 0 is the driver's; rank 1, another process, is untouched
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected on rank 0")
        return accumulate(self, *args, **kwargs)

    monkeypatch.setattr(trainer.Trainer, "_accumulate", flaky)
    dp = _quickstart(tmp_path, "steps=4", "cluster.backend=ray", "cluster.trainer_workers=2")
    with pytest.raises(RuntimeError, match="failed on rank 0: MemoryError: injected on rank 0"):
        bounded(lambda: launch(dp))
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    bounded(lambda: launch(dp, resume=True))
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4]
