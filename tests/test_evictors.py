"""Token evictors in the engine against references written from each paper's equations over dense
attention computed directly (the kept set must be equal), and engine log-probs under an evictor
against the trainer's one-pass forward over the exported trace."""

import json
import math

import pydantic
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from compactrl.compaction.evictors import H2O, RKV, TOVA, KNorm, Random, SnapKV, StreamingLLM
from compactrl.engine import Engine, EngineConfig, SamplingParams
from compactrl.engine.evicting import EvictorState
from compactrl.models.tiny import init_random, tiny_config
from compactrl.rl.forward import full_context, stream_logprobs

PROMPT, HEAD, BUDGET, WINDOW, INTERVAL, NEW = 40, 3, 24, 6, 8, 40


@pytest.fixture(scope="module")
def lm64():
    """float64, so that no two scores tie within rounding (ties would make the kept set ambiguous)."""
    cfg = tiny_config("qwen3", vocab_size=300, eos_token_id=[1])
    return init_random(cfg, seed=3).double().eval()


def run(lm, evictor, prompt=PROMPT, new=NEW, seed=0, pool=100_000):
    eng = Engine(lm, None, EngineConfig(kv_pool_tokens=pool, max_step_tokens=16))
    s = eng.session()
    s.append([(11 * seed + 7 * i) % 290 + 2 for i in range(prompt)], role="system")
    if evictor is not None:
        s.use_evictor(evictor, head=HEAD)
    s.generate(SamplingParams(max_tokens=new, seed=seed, ignore_eos=True, model_logprobs=True))
    eng.run()
    return s


@torch.no_grad()
def dense(lm, tokens, evict_at):
    """Per layer: queries and keys ``[H|Hkv, T, D]`` (RoPE'd) and the attention probabilities
    ``[H, T, T]`` each query paid under the stream mask ``j <= i < evict_at[j]``, written out."""
    T = len(tokens)
    x = lm.model.embed_tokens(torch.tensor(tokens)[None])
    cos, sin = lm.rope(torch.arange(T)[None], x.dtype)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & (i < torch.tensor(evict_at)[None, :])
    out = []
    for layer in lm.model.layers:
        a = layer.self_attn
        q, k, v = a.project(layer.input_layernorm(x), cos, sin)
        kr = k.repeat_interleave(a.n_heads // a.n_kv, 1)
        s = (q @ kr.transpose(-1, -2)) / math.sqrt(a.head_dim)
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        o = p @ v.repeat_interleave(a.n_heads // a.n_kv, 1)
        x = x + a.o_proj(o.transpose(1, 2).reshape(1, T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        out.append((q[0], k[0], p[0]))
    return out


def reference_scores(ev, layers, e, live):
    """Each method's token score at an eviction at ``e`` over the live keys (stream indices), from
    its paper's definition, per layer and head, then averaged over heads and layers."""
    W, L = ev.window, torch.tensor(live)
    per_layer = []
    for q, k, p in layers:
        H, Hkv = q.shape[0], k.shape[0]
        G = H // Hkv
        if isinstance(ev, StreamingLLM):
            s = torch.where(L < ev.sinks, math.inf, L.double()).expand(Hkv, -1)
        elif isinstance(ev, KNorm):
            s = -k[:, L].norm(dim=-1)
        elif isinstance(ev, H2O):  # attention received from every query so far, group-averaged
            s = p[:, :e][:, :, L].sum(1).view(Hkv, G, -1).mean(1)
        elif isinstance(ev, TOVA):  # the newest query's attention, averaged over all heads
            s = p[:, e - 1, L].mean(0).expand(Hkv, -1)
        elif isinstance(ev, SnapKV):  # window's attention to older keys, mean, avg-pool, group mean
            old = L < e - W
            a = p[:, e - W : e][:, :, L[old]].mean(1)
            a = F.avg_pool1d(a[:, None], ev.kernel, 1, ev.kernel // 2, count_include_pad=True)[:, 0]
            s = torch.full((Hkv, len(L)), math.inf, dtype=torch.float64)
            s[:, old] = a.view(Hkv, G, -1).mean(1)
        else:  # R-KV: group-max logits, softmax over older keys, window mean, max-pool; redundancy
            old = L < e - W
            logits = (q[:, e - W : e] @ k.repeat_interleave(G, 0)[:, L].transpose(-1, -2)) / math.sqrt(
                q.shape[-1]
            )
            imp = logits.view(Hkv, G, W, -1).amax(1)[..., old].softmax(-1).mean(1)
            imp = F.max_pool1d(imp[:, None], ev.kernel, 1, ev.kernel // 2)[:, 0]
            kn = F.normalize(k[:, L], dim=-1)
            red = torch.zeros(Hkv, len(L), dtype=torch.float64)
            for h in range(Hkv):
                c = kn[h] @ kn[h].T
                c.fill_diagonal_(0)
                for r in range(len(L)):  # each row forgets its latest similar key (key 0 if none)
                    similar = torch.nonzero(c[r] > ev.threshold).flatten()
                    c[r, similar.max() if len(similar) else 0] = 0
                red[h] = c.mean(0).softmax(0)
            s = torch.full((Hkv, len(L)), math.inf, dtype=torch.float64)
            s[:, old] = ev.mix * imp - (1 - ev.mix) * red[:, old]
        per_layer.append(s)
    return torch.stack(per_layer).mean((0, 1))


METHODS = [
    StreamingLLM(budget=BUDGET, window=WINDOW, interval=INTERVAL, sinks=2, protect_turn=False),
    KNorm(budget=BUDGET, window=WINDOW, interval=INTERVAL, protect_turn=False),
    H2O(budget=BUDGET, window=WINDOW, interval=INTERVAL, protect_turn=False),
    TOVA(budget=BUDGET, window=WINDOW, interval=INTERVAL, protect_turn=False),
    SnapKV(budget=BUDGET, window=WINDOW, interval=INTERVAL, protect_turn=False),
    RKV(budget=BUDGET, window=WINDOW, interval=INTERVAL, protect_turn=False),
]
RANDOM = Random(budget=BUDGET, window=WINDOW, interval=INTERVAL, protect_turn=False, seed=0)


@pytest.mark.parametrize("ev", METHODS, ids=lambda e: e.name)
def test_kept_set_equals_the_papers_definition(lm64, ev):
    s = run(lm64, ev)
    T = len(s.tokens)
    evict_at = [T + 1 if e is None else e for e in s.evict_at]  # T + 1: never
    events = sorted({e for e in s.evict_at if e is not None})
    # after the prompt, then every INTERVAL decoded tokens (the last one fed too) while over budget
    assert events == list(range(PROMPT, T + 1, INTERVAL)) and s.metrics.evictions == len(events)
    layers = dense(lm64, s.tokens, evict_at)
    for e in events:
        live = [j for j in range(e) if evict_at[j] >= e]
        score = reference_scores(ev, layers, e, live)
        cand = [n for n, j in enumerate(live) if HEAD <= j < e - WINDOW]
        order = sorted(cand, key=lambda n: (score[n].item(), live[n]))
        expected = {live[n] for n in order[: len(live) - BUDGET]}
        assert {j for j in live if evict_at[j] == e} == expected, e
    assert sum(e is None for e in s.evict_at) <= BUDGET + INTERVAL  # bounded live KV


@pytest.mark.parametrize("ev", [*METHODS, RANDOM], ids=lambda e: e.name)
def test_engine_under_an_evictor_matches_the_one_pass_trainer(tiny_lm, ev):
    s = run(tiny_lm, ev, seed=1)
    trace = s.trace()
    m = torch.as_tensor(trace.trainable)
    logged = torch.tensor(s.model_logprobs, dtype=torch.float64)[m]
    with torch.no_grad():
        (stream,) = stream_logprobs(tiny_lm, [trace])
        (unevicted,) = stream_logprobs(tiny_lm, [full_context(trace)])
    assert s.metrics.evicted_tokens > 0
    assert (stream.double()[m] - logged).abs().max() < 5e-5
    assert (unevicted.double()[m] - logged).abs().max() > 0.1  # the evictions are what it replays


@pytest.mark.parametrize("cls", [H2O, Random], ids=lambda c: c.__name__)
def test_protected_spans_stay(lm64, cls):
    """The head and the current turn (the whole generation here) are never evicted; the budget is
    kept as far as the unprotected tokens allow."""
    ev = cls(budget=BUDGET, window=WINDOW, interval=INTERVAL)  # protect_turn on
    s = run(lm64, ev)
    gone = [j for j, e in enumerate(s.evict_at) if e is not None]
    assert gone and all(HEAD <= j < PROMPT for j in gone)  # only the prompt's middle goes
    assert len(gone) == PROMPT - HEAD  # all of it, as the generation grows past the budget


def test_random_eviction_is_uniform_down_to_the_budget_and_seeded(lm64):
    """Random eviction runs on the others' schedule and down to the same budget, draws only among
    the unprotected tokens, uniformly, and replays given its seed (another seed draws otherwise)."""
    s = run(lm64, RANDOM)
    T = len(s.tokens)
    evict_at = [T + 1 if e is None else e for e in s.evict_at]
    events = sorted({e for e in s.evict_at if e is not None})
    assert events == list(range(PROMPT, T + 1, INTERVAL))
    for e in events:
        gone = [j for j in range(e) if evict_at[j] == e]
        assert gone and all(HEAD <= j < e - WINDOW for j in gone), e
        assert sum(evict_at[j] > e for j in range(e)) == BUDGET, e
    again, other = run(lm64, RANDOM), run(lm64, RANDOM.model_copy(update={"seed": 1}))
    assert again.evict_at == s.evict_at and again.tokens == s.tokens
    assert other.evict_at[:PROMPT] != s.evict_at[:PROMPT]
    # each of 8 live keys is drawn first about equally often over 800 streams
    k_pos = torch.arange(8)
    first = torch.tensor([int(RANDOM.draw([2, t], k_pos).argmin()) for t in range(800)])
    assert ((first.bincount(minlength=8) - 100).abs() < 40).all()


def test_sessions_without_an_evictor_are_untouched(lm64):
    """An evictor on one session changes nothing for another in the same batch."""
    alone = run(lm64, None, seed=2)
    eng = Engine(lm64, None, EngineConfig(max_step_tokens=16))
    a, b = eng.session(), eng.session()
    for s, seed in ((a, 2), (b, 0)):
        s.append([(11 * seed + 7 * i) % 290 + 2 for i in range(PROMPT)], role="system")
    b.use_evictor(H2O(budget=BUDGET, window=WINDOW, interval=INTERVAL), head=HEAD)
    for s, seed in ((a, 2), (b, 0)):
        s.generate(SamplingParams(max_tokens=NEW, seed=seed, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert a.tokens == alone.tokens
    torch.testing.assert_close(  # float64: batching changes rounding only
        torch.tensor(a.model_logprobs), torch.tensor(alone.model_logprobs), atol=1e-12, rtol=0, equal_nan=True
    )
    assert a.metrics.evicted_tokens == 0 and b.metrics.evicted_tokens > 0


@pytest.mark.parametrize("ev", [METHODS[4], RANDOM], ids=lambda e: e.name)
def test_preempted_session_keeps_evicting_identically(lm64, ev):
    """A session preempted mid-generation is recomputed under its evictions and goes on as if not."""
    roomy = run(lm64, ev)
    eng = Engine(lm64, None, EngineConfig(kv_pool_tokens=2 * (PROMPT + NEW), max_step_tokens=16))
    sessions = [eng.session() for _ in range(3)]
    for s in sessions:
        s.append([7 * i % 290 + 2 for i in range(PROMPT)], role="system")
        s.use_evictor(ev, head=HEAD)
        s.generate(SamplingParams(max_tokens=NEW, seed=0, ignore_eos=True, model_logprobs=True))
    eng.run()
    assert eng.metrics()["preemptions"] > 0
    for s in sessions:
        assert s.tokens == roomy.tokens and s.evict_at == roomy.evict_at


def test_bad_evictor_configs_are_named():
    with pytest.raises(ValueError, match="window 8 >= budget 8"):
        H2O(budget=8, window=8)
    from compactrl.agent.batch import RolloutConfig

    with pytest.raises(ValueError, match="mode = 'stream'"):
        RolloutConfig.model_validate({"mode": "reprefill", "evictor": {"name": "tova", "budget": 64}})


FACTORIES = {torch.arange, torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.rand,
             torch.randn, torch.randint, torch.randperm, torch.linspace}  # fmt: skip


class ImplicitDeviceElsewhere(TorchFunctionMode):
    """On a GPU, a tensor made without ``device=`` (or by ``.cpu()``) is not on the KV's device. The
    KV is on the CPU here, so such tensors go to ``meta`` instead: the same mixes fail. Records the
    device of every tensor made meanwhile."""

    def __init__(self):
        super().__init__()
        self.devices = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        elif func is torch.Tensor.cpu:
            func, args = torch.Tensor.to, (args[0], "meta")
        out = func(*args, **kwargs)
        self.devices |= {x.device for x in tree_leaves(out) if isinstance(x, torch.Tensor)}
        return out


@pytest.mark.parametrize("ev", [*METHODS, RANDOM], ids=lambda e: e.name)
def test_evictor_state_lives_on_the_kv_device(tiny_lm, monkeypatch, ev):
    """Every tensor an evictor makes (queries kept, H2O's sums, positions, masks, scores) is on the
    KV's device, so that the evictors run on a GPU."""
    mode = ImplicitDeviceElsewhere()
    for name in ("__init__", "observe", "after_feed"):
        method = getattr(EvictorState, name)

        def wrapped(*a, _method=method, **k):
            with mode:
                return _method(*a, **k)

        monkeypatch.setattr(EvictorState, name, wrapped)
    s = run(tiny_lm, ev)
    assert s.metrics.evicted_tokens > 0
    assert mode.devices == {s.engine.kv.device}


def test_even_kernels_are_refused_by_the_config(tmp_path, monkeypatch):
    """SnapKV's and R-KV's pooling kernel is centred: an even one is refused when the config is
    validated (not in the engine's step, where it would kill the batch)."""
    odd = r"kernel must be odd \(got 4\); use 3 or 5"
    for cls in (SnapKV, RKV):
        with pytest.raises(pydantic.ValidationError, match=r"kernel\n.*" + odd):
            cls(budget=BUDGET, kernel=4)
        assert cls(budget=BUDGET, kernel=3).kernel == 3
    from typer.testing import CliRunner

    import compactrl.agent.batch
    from compactrl.agent.batch import RolloutConfig
    from compactrl.cli import app
    from compactrl.config import ConfigError, load_config

    path = tmp_path / "snapkv.toml"
    path.write_text('mode = "stream"\n\n[evictor]\nname = "snapkv"\nbudget = 64\n')
    assert load_config(RolloutConfig, path).evictor.kernel == 5
    with pytest.raises(ConfigError, match=r"evictor\.snapkv\.kernel: " + odd):
        load_config(RolloutConfig, path, ["evictor.kernel=4"])

    def heavy(*a, **k):
        raise AssertionError("the rollout started")

    monkeypatch.setattr(compactrl.agent.batch, "rollout", heavy)
    r = CliRunner().invoke(app, ["rollout", str(path), "--set", "evictor.kernel=4"])
    assert r.exit_code != 0 and "kernel must be odd (got 4)" in " ".join(r.output.split()), r.output


def test_bench_evictors_reports_every_row(tmp_path):
    """`bench evictors --json`: the evictor rows hold less KV than full context, evict, and replay
    exactly in the trainer; bad flags are named."""
    import json

    from typer.testing import CliRunner

    from compactrl.cli import app

    runner = CliRunner()
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "evictors", "--task", "recall", "--evictor", "h2o", "--evictor", "knorm",
                            "--budget", "0.7", "--episodes", "2", "--out", str(out), "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["tasks"]["recall"]["rows"]
    assert [x["name"] for x in rows] == ["full", "evict_steps", "h2o", "knorm"]
    full = rows[0]
    for x in rows[2:]:
        assert x["budget"] == round(0.7 * full["peak_live_kv"]) and x["peak_live_kv"] < full["peak_live_kv"]
        assert x["evictions"] > 0 and x["kv_reads"] < full["kv_reads"] and x["overhead"] > 0
        assert x["max_abs_logprob_diff"] < 5e-5
    assert full["evictions"] == 0 and full["overhead"] == 0
    for x in rows:  # a 95% interval on every row; recall's reward is its accuracy (0/1)
        assert x["reward_ci"][0] <= x["reward"] <= x["reward_ci"][1] and "per_seed" not in x
        assert x["accuracy"] == x["reward"] and x["accuracy_ci"] == x["reward_ci"]
    assert full["compared_to"] is None and {x["compared_to"] for x in rows[1:]} == {"full"}
    for x in rows[1:]:  # paired with full context on the same seeds
        assert x["paired_diff"] == pytest.approx(x["reward"] - full["reward"]) and 0 <= x["mcnemar_p"] <= 1
        assert x["paired_diff_ci"][0] <= x["paired_diff"] <= x["paired_diff_ci"][1]
    assert out.with_suffix(".png").stat().st_size > 0
    bad = runner.invoke(app, ["bench", "evictors", "--evictor", "h3o"])
    assert bad.exit_code != 0 and "h3o" in bad.output
    bad = runner.invoke(app, ["bench", "evictors", "--budget", "1.5"])
    assert bad.exit_code != 0 and "fractions" in bad.output


def test_an_agent_rollout_composes_an_evictor_with_a_sliding_window(tmp_path):
    """Rooms episodes with a token evictor and a sliding window in stream mode: the window deletes
    only what the evictor left, the head and the current turn stay, the budget holds between
    turns, and the trace replays exactly in the trainer."""
    import asyncio

    from compactrl.agent.batch import run_episodes
    from compactrl.agent.chat import ChatFormat
    from compactrl.agent.rollout import RolloutSettings
    from compactrl.compaction import SlidingWindow, build_strategy
    from compactrl.envs.rooms import RoomsEnv
    from compactrl.models.tiny import write_tiny_model

    engine = Engine.from_pretrained(write_tiny_model(tmp_path / "m"))
    fmt = ChatFormat.from_tokenizer(engine.tokenizer)
    ev = SnapKV(budget=160, window=8, interval=8)
    strategy = build_strategy(SlidingWindow(max_turns=6))
    settings = RolloutSettings(max_tokens=8)
    results = asyncio.run(run_episodes(engine, fmt, lambda: RoomsEnv(n_rooms=12), strategy, "stream",
                                       settings, [1, 2], 2, evictor=ev))  # fmt: skip
    for r in results:
        assert r.error is None and r.compactions > 0
        (t,) = r.traces
        head = next(j for j, role in enumerate(t.role) if role != "system" and t.turn[j] > 0)
        gone = [j for j, e in enumerate(t.evict_at) if e < len(t)]
        assert min(gone) >= head  # the system/task head stays
        # the evictor's calls and the window's compactions both evict: more calls than compactions
        assert r.evictions > r.compactions
        for e in sorted(set(t.evict_at.tolist()) - {len(t)}):  # never the turn being read or written
            assert not any(t.evict_at[j] == e and t.turn[j] == t.turn[e - 1] for j in range(e))
        m = torch.as_tensor(t.trainable)
        (lp,) = stream_logprobs(engine.model, [t])
        assert (lp.double()[m] - torch.tensor(t.logprobs, dtype=torch.float64)[m]).abs().max() < 5e-5


def test_bench_evictors_table_shows_intervals_and_the_paired_difference(tmp_path):
    import re

    from typer.testing import CliRunner

    from compactrl.cli import app

    args = ["bench", "evictors", "--task", "recall", "--evictor", "h2o", "--evictor", "random",
            "--budget", "0.7", "--episodes", "2", "--out", str(tmp_path / "b.json")]  # fmt: skip
    r = CliRunner().invoke(app, args, env={"COLUMNS": "320"})
    assert r.exit_code == 0, r.output
    assert "vs full, paired [95% CI]" in r.output and re.search(r"\d\.\d\d \[\d\.\d\d, \d\.\d\d\]", r.output)
    # evict_steps, h2o and random against full, h2o against random: two questions cannot show one
    assert r.output.count("no difference measured") == 4 and "vs random, paired" in r.output
    rows = json.loads((tmp_path / "b.json").read_text())["tasks"]["recall"]["rows"]
    (h2o,) = [x for x in rows if x["name"] == "h2o"]
    assert h2o["vs_random"]["compared_to"] == f"random at {h2o['budget']}"
