"""kvpress's per-KV-head token scores at prefill, for compactrl's evictor parity check.

Standalone: needs only the stdlib, torch, transformers and kvpress, and runs in kvpress's own
virtualenv (kvpress 0.5.5 pins ``transformers<5.3``, compactrl runs 5.x), e.g.

  $KVPRESS_PYTHON compactrl/bench/kvpress_scores.py --model DIR --tokens FILE.json --out FILE.pt
  $KVPRESS_PYTHON compactrl/bench/kvpress_scores.py --probe     (versions only: is kvpress there?)

It loads the Hugging Face model folder with transformers in float32 and, for each press, runs one
prefill forward over the token ids (a JSON list of ints) inside ``with press(model):``, so that
kvpress's own forward hook hands its own ``score(module, hidden_states, keys, values, attentions,
kwargs)`` the post-RoPE keys from the cache, the attention module's input and kwargs, exactly as in
its compression; each layer's scores ``[Hkv, N]`` are recorded as ``score`` returns them.  The
press prunes the cache after each layer (``--compression-ratio`` > 0, or ``score`` is never called),
which changes nothing in the same forward: every layer's attention has run before its hook.

ObservedAttentionPress needs the attention weights, so it runs on an ``eager`` model; the others
on ``sdpa``, where SnapKV and TOVA recompute their window's attention themselves (their path in
ordinary use).  The kept set of each layer and KV head is the one kvpress's ScorerPress.compress
keeps: ``scores.topk(n_kept)`` with ``n_kept = compute_n_kept(N, compression_ratio)``.

``--out`` gets (torch.save) ``{"scores": {method: [layers, Hkv, N] float32}, "kept": {method:
[layers, Hkv, N] bool}, "n_kept": int, "info": <the JSON below>}``.  Stdout gets ONE JSON object
(methods, press classes and parameters, shapes, versions); everything else goes to stderr.
"""

import argparse
import contextlib
import json
import os
import sys
import time

# our method name -> (kvpress class, attn_implementation it runs under)
METHODS = {
    "snapkv": ("SnapKVPress", "sdpa"),
    "streamingllm": ("StreamingLLMPress", "sdpa"),
    "tova": ("TOVAPress", "sdpa"),
    "knorm": ("KnormPress", "sdpa"),
    "observed_attention": ("ObservedAttentionPress", "eager"),
}
NO_KVPRESS = 3  # exit status when kvpress (or transformers) is not importable


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", action="store_true", help="print the versions and exit (checks the imports)")
    p.add_argument("--model", help="Hugging Face-format model folder")
    p.add_argument("--tokens", help="JSON file: one list of token ids (the prefill)")
    p.add_argument("--out", help="where to torch.save the scores")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--window", type=int, default=8, help="SnapKVPress window_size")
    p.add_argument("--kernel", type=int, default=5, help="SnapKVPress kernel_size")
    p.add_argument("--sinks", type=int, default=4, help="StreamingLLMPress n_sink")
    p.add_argument("--compression-ratio", type=float, default=0.5, help="for the kept set (and StreamingLLM)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args(argv)
    if not a.probe:
        missing = [f"--{n}" for n in ("model", "tokens", "out") if getattr(a, n) is None]
        if missing:
            p.error(f"{', '.join(missing)} required (or --probe)")
    unknown = sorted(set(a.methods.split(",")) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if not 0 < a.compression_ratio < 1:
        p.error("--compression-ratio must be in (0, 1): at 0 kvpress never calls score()")
    return a


def versions():
    import kvpress
    import torch
    import transformers

    try:
        from importlib.metadata import version

        kv = version("kvpress")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        kv = getattr(kvpress, "__version__", "unknown")
    return {"kvpress": kv, "transformers": transformers.__version__, "torch": str(torch.__version__)}


def make_press(method, args):
    import kvpress

    r = args.compression_ratio
    if method == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=r, window_size=args.window, kernel_size=args.kernel)
    if method == "streamingllm":
        return kvpress.StreamingLLMPress(compression_ratio=r, n_sink=args.sinks)
    return getattr(kvpress, METHODS[method][0])(compression_ratio=r)


def press_params(press):
    import dataclasses

    return {f.name: getattr(press, f.name) for f in dataclasses.fields(press)}


def recorded_scores(model, press, ids):
    """Run one prefill under ``press`` and return each layer's ``score(...)`` output ``[Hkv, N]``."""
    import torch
    from transformers import DynamicCache

    seen = {}
    original = press.score  # ScorerPress.compress calls self.score(...): shadow it on the instance

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = original(module, hidden_states, keys, values, attentions, kwargs)
        seen[module.layer_idx] = s.detach()
        return s

    press.score = score
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    n_layers = model.config.num_hidden_layers
    if sorted(seen) != list(range(n_layers)):
        raise RuntimeError(f"{type(press).__name__}.score ran for layers {sorted(seen)}, not all {n_layers}")
    return torch.stack([seen[i][0].float() for i in range(n_layers)])  # batch 1


def run(args):
    import torch
    from kvpress.utils import compute_n_kept
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    with open(args.tokens) as f:
        tokens = json.load(f)
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)):
        raise SystemExit(f"{args.tokens}: expected one JSON list of token ids")
    ids = torch.tensor([tokens])
    n = len(tokens)
    n_kept = compute_n_kept(n, args.compression_ratio)
    methods = args.methods.split(",")
    scores, kept, info = {}, {}, {}
    for impl in ("sdpa", "eager"):
        todo = [m for m in methods if METHODS[m][1] == impl]
        if not todo:
            continue
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation=impl
        )
        model.eval()
        for m in todo:
            press = make_press(m, args)
            t0 = time.perf_counter()
            s = recorded_scores(model, press, ids)
            keep = torch.zeros(s.shape, dtype=torch.bool)
            keep.scatter_(-1, s.topk(n_kept, dim=-1).indices, True)  # as ScorerPress.compress
            scores[m], kept[m] = s, keep
            info[m] = {
                "press": type(press).__name__,
                "params": press_params(press),
                "attn_implementation": impl,
                "shape": list(s.shape),
                "seconds": time.perf_counter() - t0,
            }
        del model
    res = {
        **versions(),
        "model": args.model,
        "n_tokens": n,
        "compression_ratio": args.compression_ratio,
        "n_kept": n_kept,
        "threads": args.threads,
        "methods": info,
        "out": args.out,
    }
    torch.save({"scores": scores, "kept": kept, "n_kept": n_kept, "info": res}, args.out)
    return res


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no load reports or progress bars
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import kvpress  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"{sys.executable} cannot import kvpress ({e})", file=sys.stderr)  # the first line: the cause
        print(
            "make a virtualenv for it: python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 "
            "kvpress==0.5.5, then run this with VENV/bin/python",
            file=sys.stderr,
        )
        raise SystemExit(NO_KVPRESS) from None
    with contextlib.redirect_stdout(sys.stderr):  # anything a library prints stays off the JSON
        res = {"probe": True, **versions()} if args.probe else run(args)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
