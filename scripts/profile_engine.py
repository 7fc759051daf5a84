"""Where the engine's time goes: torch.profiler over its prefill and decode steps, by kind of work.

    python scripts/profile_engine.py [--model runs/smollm2] [--batch 1 8 32] [--context 128 1024]
                                     [--new-tokens 32] [--threads 1] [--dtype float32] [--matmul auto]
                                     [--attention auto] [--torch-path] [--out FILE]

For each (batch, context): ``batch`` sessions of ``context`` prompt tokens are prefilled (profiled),
then decode ``new-tokens`` tokens each (profiled). Each op's own CPU time is put in a kind (GEMMs,
attention, elementwise, copies and indexing, sampling, other, and "one call": a step's layers in
``decode_layers.c``, products and attention inside; ``--torch-path`` runs every step without it,
so the trace shows each op); what the ops do not account for of the steps' wall time is Python
and dispatch overhead. Without --model, a generated model of
SmolLM2-135M's shape (random weights) is used, so the script runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from compactrl.bench.harness import machine_info
from compactrl.engine import Engine, EngineConfig, SamplingParams

KINDS = {  # aten op -> kind (ops not named here count as "other")
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
             "mkldnn::_linear_pointwise", "compactrl::gemv", "compactrl::panel_gemm",
             "compactrl::panel_gemm_bf16"),
    "attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math", "aten::logsumexp", "aten::masked_fill",
                  "aten::masked_fill_", "aten::_softmax", "aten::softmax", "compactrl::decode_attention",
                  "compactrl::chunk_attention"),
    "elementwise": ("aten::mul", "aten::add", "aten::add_", "aten::silu", "aten::rsqrt", "aten::pow",
                    "aten::mean", "aten::neg", "aten::cat", "aten::sub", "aten::exp", "aten::div",
                    "aten::mul_", "aten::sigmoid", "aten::nan_to_num", "aten::where", "aten::rms_norm",
                    "aten::_fused_rms_norm"),
    "copy/index": ("aten::copy_", "aten::index", "aten::index_select", "aten::index_put_", "aten::gather",
                   "aten::scatter_", "aten::clone", "aten::contiguous", "aten::to", "aten::_to_copy",
                   "aten::embedding", "aten::fill_", "aten::zero_", "aten::empty", "aten::arange"),
    "one call": ("compactrl::decode_layers",),  # every layer of a decode step: products, attention, the rest
    "sampling": ("aten::topk", "aten::multinomial", "aten::log_softmax", "aten::_log_softmax", "aten::sort",
                 "aten::argmax", "aten::cumsum", "compactrl::sample_rows"),
}  # fmt: skip
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}


def engine(model: str | None, dtype: str, matmul: str, attention: str) -> Engine:
    config = EngineConfig(kv_pool_tokens=1 << 17, matmul=matmul, attention=attention)
    if model:
        return Engine.from_pretrained(model, dtype=dtype, config=config)
    from compactrl.models.tiny import init_random, tiny_config

    cfg = tiny_config("llama", vocab_size=49152, size="base", eos_token_id=[0])
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 576, 1536, 30  # SmolLM2-135M's shape
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 9, 3, 64
    return Engine(init_random(cfg, seed=0).to(getattr(torch, dtype)), None, config)


def breakdown(prof, wall: float) -> dict:
    """Self CPU seconds per kind, the top ops, and the part of ``wall`` no op accounts for."""
    kinds, ops = defaultdict(float), []
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        kinds[KIND_OF.get(e.key, "other")] += s
        ops.append((e.key, s, e.count))
    ops.sort(key=lambda x: -x[1])
    accounted = sum(kinds.values())
    share = {k: round(v / wall, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    return {
        "wall_s": round(wall, 4),
        "share": share | {"python/dispatch": round(max(0.0, wall - accounted) / wall, 3)},
        "top_ops": [{"op": k, "self_s": round(s, 4), "calls": n} for k, s, n in ops[:12]],
    }


def run(eng: Engine, batch: int, context: int, new_tokens: int) -> dict:
    eng.kv.preallocate(batch, context + new_tokens)  # as a running engine's cache already is
    sessions = [eng.session() for _ in range(batch)]
    vocab = eng.vocab_size
    for k, s in enumerate(sessions):
        s.append([(7 * k + 13 * i) % (vocab - 10) + 5 for i in range(context)])
    out = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        eng.run()
        wall = time.perf_counter() - t
    out["prefill"] = breakdown(prof, wall) | {"tokens": batch * context}
    gens = [
        s.generate(SamplingParams(max_tokens=new_tokens, seed=k, ignore_eos=True))
        for k, s in enumerate(sessions)
    ]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        eng.run(until=gens)
        wall = time.perf_counter() - t
    out["decode"] = breakdown(prof, wall) | {"tokens": batch * new_tokens, "steps": new_tokens}
    for s in sessions:
        s.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M's shape, random)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--matmul", default="auto", help="EngineConfig.matmul: auto, native, onednn, float32")
    p.add_argument("--attention", default="auto", help="EngineConfig.attention: auto, kernel, sdpa")
    p.add_argument("--torch-path", action="store_true", help="no step in one call: each op in the trace")
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    eng = engine(a.model, a.dtype, a.matmul, a.attention)
    if a.torch_path:
        eng.decode_layers = None
    run(eng, 1, 16, 2)  # warm-up
    params = sum(x.numel() for x in eng.model.parameters())
    machine = machine_info(a.threads) | {"capability": torch.backends.cpu.get_cpu_capability()}
    result = {"machine": machine,
              "model": a.model or "SmolLM2-135M shape (random)", "parameters": params, "dtype": a.dtype,
              "matmul": eng.linears.kind, "attention": eng.attention.kind, "torch_path": a.torch_path,
              "settings": []}  # fmt: skip
    for b in a.batch:
        for c in a.context:
            r = run(eng, b, c, a.new_tokens)
            result["settings"].append({"batch": b, "context": c, **r})
            for phase in ("prefill", "decode"):
                print(f"batch {b:3d} context {c:5d} {phase:8s} {r[phase]['share']}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
