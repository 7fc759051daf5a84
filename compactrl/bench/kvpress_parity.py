"""`compactrl verify kvpress`: our evictors' per-KV-head scores against kvpress 0.5.5's presses.

Both sides score one prefill of the same token ids on the same model folder in float32. Ours: our
decoder (:func:`compactrl.models.loading.load_model`) gives each layer's post-RoPE queries and keys,
the very tensors the engine hands its evictors (tests/test_kvpress_parity.py pins this to the
engine's :class:`~compactrl.engine.evicting.EvictorState` after a prefill), and each method's
``layer_scores`` turns them into ``[Hkv, N]``, before any averaging over heads or layers. Theirs:
:mod:`compactrl.bench.kvpress_scores`, run by subprocess in kvpress's own virtualenv (kvpress pins
``transformers<5.3``), records what each press's ``score(...)`` returns inside kvpress's own
forward hook. The gate is max |difference| <= 1e-4 over the tokens where both define a score, and
the same kept set per layer and KV head at one budget.

Where the two definitions differ, and what is compared:

* **SnapKV(window=W, kernel=K)** vs ``SnapKVPress(window_size=W, kernel_size=K)``. Both: the
  softmax of the last W queries over all N keys (causal), averaged over the window, average-pooled
  (zero padding counted) along the N - W keys before the window, averaged over the query heads of
  each KV head. The window's own tokens get ``max + 1`` of the layer in kvpress and ``+inf`` in
  ours (both: never pruned); compared: the N - W tokens before the window.
* **TOVA** vs ``TOVAPress``. Both: the last query's attention (softmax over all N keys) averaged
  over all query heads, the same score for every KV head. The last token itself gets ``max + 1``
  in kvpress; ours scores it with the attention it pays itself (the engine's ``window`` protects
  it); compared: the N - 1 tokens before it.
* **KNorm** vs ``KnormPress``: ``-||k||`` of the cached (post-RoPE) keys; compared: all N tokens.
* **H2O(average=True)** vs ``ObservedAttentionPress``: the attention each key received, summed over
  the queries that see it and divided by their number (N - j at a prefill), averaged over the query
  heads of each KV head; compared: all N tokens. Our default ``H2O`` (``average=False``) is the
  paper's plain sum, which kvpress has no press for (nor H2O's decode-time accumulation); at a
  prefill it only rescales each key by N - j, which favours early tokens.
* **StreamingLLM(sinks=S)** vs ``StreamingLLMPress(n_sink=S)``: kept set only. kvpress's score is
  a mask built from the compression ratio (0 for the n_pruned tokens right after the sinks, 1
  elsewhere); ours is the token's position (``+inf`` for sinks), so the oldest non-sink tokens go
  first at any budget. Raw numbers are not comparable; the kept sets must be equal.
* **R-KV**: kvpress 0.5.5 has no R-KV press; not compared.

Kept set: kvpress prunes each layer's KV heads independently, keeping ``topk(n_kept)`` of each
head's scores (:func:`ScorerPress.compress`). That rule is applied to both sides' per-head scores,
with the tokens kvpress always keeps (SnapKV's window, TOVA's last token: its ``max + 1``) set to
``+inf`` on ours. A difference counts only if some token in it scores farther than the tolerance
from kvpress's n_kept-th score on that head (else it is a tie within rounding, reported as such).
Negative controls: our H2O's plain sum against ObservedAttentionPress, and our SnapKV with a
kernel two wider against SnapKVPress, must each differ by more than 10x the tolerance (the check
resolves a wrong definition). Our engine's own eviction is a different rule by design (one
decision per token: the per-head scores averaged over heads and layers, plus its head/turn/window
protection); it is not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from compactrl.compaction.evictors import H2O, TOVA, KNorm, SnapKV, StreamingLLM
from compactrl.models.decoder import CausalLM

SCRIPT = Path(__file__).with_name("kvpress_scores.py")
NO_KVPRESS = 3  # kvpress_scores.py's exit status when kvpress is not importable
TOLERANCE = 1e-4
FIX = (
    "make a virtualenv for kvpress outside the repo: python3 -m venv VENV && "
    "VENV/bin/pip install torch==2.13.0 kvpress==0.5.5 (the exact torch pin is the CPU wheel), "
    "then pass --kvpress-python VENV/bin/python"
)
# our method -> (kvpress method in kvpress_scores.py, kvpress press, what is compared)
PAIRS = {
    "snapkv": ("snapkv", "SnapKVPress", "tokens before the window"),
    "tova": ("tova", "TOVAPress", "tokens before the last"),
    "knorm": ("knorm", "KnormPress", "all tokens"),
    "h2o": ("observed_attention", "ObservedAttentionPress", "all tokens (average=True)"),
    "streamingllm": ("streamingllm", "StreamingLLMPress", "kept set only"),
}


class KvpressError(ValueError):
    """Bad --kvpress-python, or the kvpress side failed."""


def check_kvpress_python(python: str | Path) -> dict:
    """Versions from ``python`` (``kvpress_scores.py --probe``); a clear error naming the fix otherwise."""
    p = Path(python)
    if not p.exists():
        raise KvpressError(f"--kvpress-python {p} does not exist; {FIX}")
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise KvpressError(f"--kvpress-python {p} is not an executable file (a python interpreter); {FIX}")
    try:
        r = subprocess.run(
            [str(p), str(SCRIPT), "--probe"], capture_output=True, text=True, timeout=300, env=_env()
        )
    except OSError as e:
        raise KvpressError(f"--kvpress-python {p} could not run ({e}); {FIX}") from None
    if r.returncode == NO_KVPRESS:
        cause = r.stderr.strip().splitlines()[0].split(" cannot import ", 1)[-1]
        raise KvpressError(f"--kvpress-python {p} cannot import {cause}; {FIX}")
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise KvpressError(f"--kvpress-python {p} failed to run {SCRIPT.name} --probe: {tail[0]}; {FIX}")
    return json.loads(r.stdout)


def _env() -> dict:
    """The caller's environment without what would point kvpress's python at our packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def evictors(n: int, window: int = 8, kernel: int = 5, sinks: int = 4) -> dict:
    """Our side of each pair, configured as kvpress is (``budget`` does not enter the scores)."""
    common = {"budget": n, "window": window, "protect_turn": False}
    return {
        "snapkv": SnapKV(**common, kernel=kernel),
        "tova": TOVA(**common),
        "knorm": KNorm(**common),
        "h2o": H2O(**common, average=True),
        "streamingllm": StreamingLLM(**common, sinks=sinks),
    }


@torch.no_grad()
def prefill_qk(lm: CausalLM, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the post-RoPE queries ``[N, H, D]`` and keys ``[Hkv, N, D]`` of a causal prefill,
    taken from the model's own forward (each layer's :meth:`Attention.project`)."""
    out = []
    for layer in lm.model.layers:
        attn = layer.self_attn

        def project(x, cos, sin, _own=attn.project):
            q, k, v = _own(x, cos, sin)
            out.append((q[0].transpose(0, 1), k[0]))
            return q, k, v

        attn.project = project  # an instance attribute over the method, removed below
    try:
        lm.hidden_states(torch.tensor(tokens), torch.arange(len(tokens)))
    finally:
        for layer in lm.model.layers:
            del layer.self_attn.project
    return out


@torch.no_grad()
def our_scores(lm: CausalLM, tokens: list[int], evs: dict) -> dict[str, torch.Tensor]:
    """Each evictor's per-head scores ``[layers, Hkv, N]`` after a prefill of ``tokens``, from the
    queries it keeps (its last ``queries``; every query for H2O's sums, divided by the number of
    queries that saw each key when ``average``, as :class:`EvictorState` does)."""
    layers = prefill_qk(lm, tokens)
    pos = torch.arange(len(tokens))
    seen = (len(tokens) - pos).float()  # EvictorState.observe for one feed: key j seen by N - j queries
    res = {}
    for name, ev in evs.items():
        per_layer = []
        for q, k in layers:
            acc = None
            if ev.accumulates:
                acc = ev.received(q, pos, k, pos)
                acc = acc / seen if ev.average else acc
            w = ev.queries
            qs, qp = (q[-w:], pos[-w:]) if w else (None, None)
            per_layer.append(ev.layer_scores(qs, qp, k, pos, acc))
        res[name] = torch.stack(per_layer)
    return res


def run_kvpress(
    python: str | Path,
    model_dir: Path,
    tokens: list[int],
    window: int,
    kernel: int,
    sinks: int,
    compression_ratio: float,
    threads: int = 1,
) -> dict:
    """Run kvpress_scores.py in kvpress's interpreter: ``{"scores", "kept", "n_kept", "info"}``."""
    with tempfile.TemporaryDirectory() as tmp:
        tok_file, out_file = Path(tmp) / "tokens.json", Path(tmp) / "scores.pt"
        tok_file.write_text(json.dumps(tokens))
        cmd = [str(python), str(SCRIPT), "--model", str(model_dir), "--tokens", str(tok_file),
               "--out", str(out_file), "--window", str(window), "--kernel", str(kernel),
               "--sinks", str(sinks), "--compression-ratio", str(compression_ratio),
               "--threads", str(threads)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=_env())
        if r.returncode != 0:
            raise KvpressError(f"kvpress_scores.py failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        data = torch.load(out_file, weights_only=True)
    data["info"] = json.loads(r.stdout)
    return data


def compare(
    ours: torch.Tensor,
    theirs: torch.Tensor,
    kept: torch.Tensor,
    n_kept: int,
    forced: slice | None,
    region: slice | None,
    tol: float = TOLERANCE,
) -> dict:
    """One pair: max |ours - theirs| over the token ``region`` (None: not comparable), and our
    kept set per layer and KV head (kvpress's rule, ``forced`` tokens kept) against kvpress's ``kept``."""
    res = {"max_abs_diff": None, "score_scale": None}
    if region is not None:
        a, b = ours[..., region], theirs[..., region]
        res["max_abs_diff"] = float((a - b).abs().max())
        res["score_scale"] = float(b.abs().max())
    s = ours.clone()
    if forced is not None:
        s[..., forced] = float("inf")
    mine = torch.zeros(s.shape, dtype=torch.bool)
    mine.scatter_(-1, s.topk(n_kept, dim=-1).indices, True)
    differ = mine != kept  # [L, Hkv, N]
    threshold = theirs.topk(n_kept, dim=-1).values[..., -1:]  # kvpress's n_kept-th score per head
    tie = (theirs - threshold).abs() <= tol
    res["kept_heads_differ"] = int(differ.any(-1).sum())
    res["kept_heads"] = int(differ[..., 0].numel())
    res["kept_ties"] = int((differ & tie).any(-1).sum())  # heads whose difference is a tie within tol
    res["kept_equal"] = not bool((differ & ~tie).any())
    res["ok"] = res["kept_equal"] and (res["max_abs_diff"] is None or res["max_abs_diff"] <= tol)
    return res


def random_tokens(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


def parity(
    model_dir: str | Path,
    kvpress_python: str | Path,
    tokens: list[int] | None = None,
    n_tokens: int = 64,
    seed: int = 0,
    window: int = 8,
    kernel: int = 5,
    sinks: int = 4,
    compression_ratio: float = 0.5,
    tol: float = TOLERANCE,
) -> dict:
    """Both sides on one model folder and prefill; per method the comparison of :func:`compare`."""
    from compactrl.models.loading import load_model

    model_dir = Path(model_dir)
    lm = load_model(model_dir, dtype="float32").eval()
    if tokens is None:
        tokens = random_tokens(lm.config.vocab_size, n_tokens, seed)
    n = len(tokens)
    check_params(n, window, kernel, sinks, compression_ratio)
    evs = evictors(n, window, kernel, sinks)
    ours = our_scores(lm, tokens, evs)
    kv = run_kvpress(kvpress_python, model_dir, tokens, window, kernel, sinks, compression_ratio)
    n_kept = kv["n_kept"]
    layout = {  # (tokens kvpress always keeps, tokens both score)
        "snapkv": (slice(n - window, n), slice(0, n - window)),
        "tova": (slice(n - 1, n), slice(0, n - 1)),
        "knorm": (None, slice(0, n)),
        "h2o": (None, slice(0, n)),
        "streamingllm": (None, None),
    }
    methods = {}
    for name, (theirs_name, press, what) in PAIRS.items():
        forced, region = layout[name]
        theirs, kept = kv["scores"][theirs_name], kv["kept"][theirs_name]
        r = compare(ours[name], theirs, kept, n_kept, forced, region, tol)
        methods[name] = {"kvpress": press, "compared": what, **r}
    methods["rkv"] = {"kvpress": None, "compared": "none (no R-KV in kvpress)", "ok": True}
    # negative controls: a different definition must miss by far more than the tolerance
    wrong = {"h2o": evs["h2o"].model_copy(update={"average": False}),
             "snapkv": evs["snapkv"].model_copy(update={"kernel": kernel + 2})}  # fmt: skip
    wrong = our_scores(lm, tokens, wrong)
    controls = {
        "h2o_sum_vs_observed_attention": (wrong["h2o"], "observed_attention", layout["h2o"][1]),
        f"snapkv_kernel_{kernel + 2}_vs_{kernel}": (wrong["snapkv"], "snapkv", layout["snapkv"][1]),
    }
    negative = {
        k: float((a[..., r] - kv["scores"][m][..., r]).abs().max()) for k, (a, m, r) in controls.items()
    }
    info = kv["info"]
    return {
        "model": str(model_dir),
        "family": lm.config.model_type,
        "layers": lm.config.num_hidden_layers,
        "heads": lm.config.num_attention_heads,
        "kv_heads": lm.config.num_key_value_heads,
        "n_tokens": n,
        "n_kept": n_kept,
        "compression_ratio": compression_ratio,
        "window": window,
        "kernel": kernel,
        "sinks": sinks,
        "versions": {k: info[k] for k in ("kvpress", "transformers", "torch")},
        "methods": methods,
        "negative_controls": negative,  # each must exceed 10 x the tolerance
        "ok": all(m["ok"] for m in methods.values()) and all(d > 10 * tol for d in negative.values()),
    }


def check_params(n_tokens: int, window: int, kernel: int, sinks: int, compression_ratio: float) -> int:
    """Raise ValueError on parameters either side would reject or where a comparison is empty;
    returns kvpress's n_kept."""
    if not 0 < compression_ratio < 1:
        raise ValueError("--compression-ratio must be in (0, 1) (kvpress never scores at 0)")
    if window < 1 or kernel < 1 or kernel % 2 == 0 or sinks < 0:
        raise ValueError("--window must be >= 1, --kernel odd and >= 1, --sinks >= 0")
    n_kept = max(1, int(n_tokens * (1 - compression_ratio)))
    if n_tokens <= window + kernel or n_kept <= max(window, sinks):
        raise ValueError(
            f"{n_tokens} tokens keep {n_kept} at compression ratio {compression_ratio}: need more tokens "
            f"than window + kernel ({window + kernel}) and a kept count above window and sinks "
            f"({max(window, sinks)}); raise --tokens or lower --compression-ratio"
        )
    return n_kept


def verify_kvpress(
    kvpress_python: str | Path,
    model_dir: str | Path | None = None,
    n_tokens: int = 64,
    seed: int = 0,
    window: int = 8,
    kernel: int = 5,
    sinks: int = 4,
    compression_ratio: float = 0.5,
    tol: float = TOLERANCE,
) -> dict:
    """Check the interpreter first, then :func:`parity` on one folder or on freshly built tiny
    Llama, Qwen2 and Qwen3 checkpoints."""
    from compactrl.models.tiny import write_tiny_model
    from compactrl.verify import FAMILIES

    check_params(n_tokens, window, kernel, sinks, compression_ratio)
    versions = check_kvpress_python(kvpress_python)
    kw = dict(n_tokens=n_tokens, seed=seed, window=window, kernel=kernel, sinks=sinks,
              compression_ratio=compression_ratio, tol=tol)  # fmt: skip
    models = {}
    if model_dir is not None:
        models[str(model_dir)] = parity(model_dir, kvpress_python, **kw)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for fam in FAMILIES:
                folder = write_tiny_model(Path(tmp) / fam, family=fam)
                r = parity(folder, kvpress_python, **kw)
                models[f"tiny {fam}"] = r | {"model": f"tiny {fam} (generated)"}
    diffs = [m.get("max_abs_diff") for r in models.values() for m in r["methods"].values()]
    worst = max((d for d in diffs if d is not None), default=0.0)
    return {
        "kvpress_python": str(kvpress_python),
        "versions": {k: versions[k] for k in ("kvpress", "transformers", "torch")},
        "tolerance": tol,
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "models": models,
        "max_abs_diff": worst,
        "ok": all(r["ok"] for r in models.values()),
    }
