"""The documentation's result tables, rendered from the JSON the benches and studies wrote, so a
page and its data cannot drift: a page marks a table with

    <!-- table: memory docs/bench_x.json configs/bench/x.toml [rows=a,b] -->
    ...the rendered table...
    <!-- end table -->

and `python scripts/docs_tables.py` rewrites every marked block from its JSON (a test fails when a
page differs from what its JSON renders). Renderers: ``memory`` (a `compactrl bench memory` result,
with the pooled or contrasted table its bench config asks for), ``throughput`` (its rows served
under one pool), ``engine`` (`compactrl bench engine` against transformers and vLLM),
``engine_floor`` (its decode steps against the step's GEMMs alone), ``profile``
(`scripts/profile_engine.py`), ``decode_ab`` (`scripts/decode_ab.py` runs, one per setting),
``attention`` (`scripts/attention_ab.py`), ``chunk_attention`` (`scripts/chunk_attention_ab.py`),
``gemv``, ``sampling`` and ``kernel_steps``
(`scripts/gemv_sampling_ab.py`; ``kernel_steps`` also `scripts/panel_gemm_ab.py` and
`scripts/decode_layers_ab.py`), ``panel_gemm`` (`scripts/panel_gemm_ab.py`), ``prefills`` (whole
prefills toggled in one engine by those A/B scripts),
``vllm_gemm`` (`scripts/vllm_gemm_check.py`), ``trainer_hf``, ``evictors``, ``modes``, ``trainer``, ``scale``,
``serve``, ``serve_episodes`` (those benches' own tables), ``study`` and ``study_modes`` (a
`compactrl study` result; its re-prefill / stream time ratios)."""

from __future__ import annotations

import json
import re
from pathlib import Path

BLOCK = re.compile(r"(<!-- table: (.+?) -->\n)(.*?)(<!-- end table -->)", re.S)


def _memory(result: str, bench: str | None = None, rows: str | None = None) -> str:
    """``rows=a,b,c``: only those rows, in that order (the first is the reference of the ratios of
    rows without a paired baseline)."""
    from compactrl.bench.memory import contrasted, load_bench, markdown, pooled, pooled_markdown

    table = json.loads(Path(result).read_text())
    if rows is not None:
        by_name = {r["row"]: r for r in table}
        missing = [n for n in rows.split(",") if n not in by_name]
        if missing:
            raise ValueError(f"{result} has no rows {missing}")
        table = [by_name[n] for n in rows.split(",")]
    parts = [markdown(table)]
    if bench is not None:
        b = load_bench(bench)
        if b.pool_sets:
            parts.append(pooled_markdown(pooled(table, b.contrasts)))
        elif b.contrasts:
            parts.append(pooled_markdown(contrasted(table, b.contrasts)))
    return "\n\n".join(p.strip() for p in parts)


def _profile(result: str) -> str:
    """`scripts/profile_engine.py`: each step kind's share of the wall time, per setting and phase."""
    from compactrl.bench.harness import markdown_table

    kinds = ["one call", "gemm", "attention", "elementwise", "copy/index", "sampling", "other"]
    kinds.append("python/dispatch")
    rows = []
    for s in json.loads(Path(result).read_text())["settings"]:
        for phase in ("prefill", "decode"):
            p = s[phase]
            rows.append([s["batch"], s["context"], phase, f"{p['tokens'] / p['wall_s']:.0f}",
                         *(f"{p['share'].get(k, 0.0):.2f}" for k in kinds)])  # fmt: skip
    return markdown_table(["batch", "context", "phase", "tokens/s", *kinds], rows)


def _decode_ab(result: str) -> str:
    """`scripts/decode_ab.py` results (a list, one per setting): each tree's median tokens/s, the
    ratio, and the spread of its rounds; for the ``sessions`` workload, what both trees did in it
    (preemptions, tokens re-prefilled and evicted: the same work, or the ratio would mean nothing)."""
    from compactrl.bench.harness import markdown_table

    results = json.loads(Path(result).read_text())
    sessions = any(r.get("workload") == "sessions" for r in results)
    rows = []
    for r in results:
        d, spread = r["decode_tokens_per_s"], {k: [x[1] for x in v] for k, v in r["runs"].items()}
        row = [r.get("dtype", "float32"), r["batch"], r["context"],
               *(f"{d[k]:.1f} ({min(spread[k]):.1f}-{max(spread[k]):.1f})" for k in ("before", "now")),
               f"{r['decode_now_vs_before']:.2f}", f"{r['prefill_now_vs_before']:.2f}"]  # fmt: skip
        if sessions:
            work = {json.dumps(x[2], sort_keys=True) for v in r["runs"].values() for x in v}
            w = json.loads(work.pop()) if len(work) == 1 else None
            done = ("preemptions", "reprefilled_tokens", "evicted_tokens")
            row.append(", ".join(str(w[k]) for k in done) if w else "differ")
        rows.append(row)
    heads = ["dtype", "batch", "context", "decode before tok/s (rounds)", "decode now tok/s (rounds)"]
    heads += ["decode now / before", "prefill now / before"]
    if sessions:
        heads.append("preemptions, re-prefilled, evicted tokens (both trees)")
    return markdown_table(heads, rows)


def _attention(result: str) -> str:
    """`scripts/attention_ab.py`: decode attention over 30 layers, the kernel against SDPA."""
    from compactrl.bench.harness import markdown_table

    r = json.loads(Path(result).read_text())
    before = [f"kernel@{r['before']}"] if r["before"] else []
    kernels = ["kernel", *before]
    rows = [[s["dtype"], s["batch"], s["context"], *(f"{s['ms'][k]:.1f}" for k in ["sdpa", *kernels]),
             *(f"{s['vs_sdpa'][k]:.2f}" for k in kernels), f"{s['kernel_kv_gb_per_s']:.1f}"]
            for s in r["settings"]]  # fmt: skip
    heads = ["SDPA ms", "kernel ms", *(f"{k} ms" for k in before), "kernel speed-up"]
    heads += [f"{k} speed-up" for k in before] + ["kernel reads K/V at GB/s"]
    return markdown_table(["dtype", "batch", "context", *heads], rows)


def _chunk_attention(result: str) -> str:
    """`scripts/chunk_attention_ab.py`: prompt chunks' attention over 30 layers, the kernel against
    SDPA (and against an earlier revision's kernel, where the run had ``--before``)."""
    from compactrl.bench.harness import markdown_table

    r = json.loads(Path(result).read_text())
    before = r.get("before")
    rows = [[r["dtype"], s["sessions"], s["first"], f"{s['holes']:.0%}", s["tokens"],
             *(f"{s['ms'][k]:.1f}" for k in ("sdpa", "kernel")), f"{s['speed_up']:.2f}",
             f"{s['kernel_gflop_per_s']:.0f}",
             *([f"{s['ms']['before']:.1f}", f"{s['speed_up_vs_before']:.2f}"] if before else [])]
            for s in r["settings"]]  # fmt: skip
    heads = ["dtype", "sessions", "entries before", "of them evicted", "chunk tokens", "SDPA ms", "kernel ms"]
    heads += ["kernel speed-up", "kernel GFLOP/s"]
    heads += [f"{before} ms", f"speed-up over {before}"] if before else []
    return markdown_table(heads, rows)


def _gemv(result: str) -> str:
    """`scripts/gemv_sampling_ab.py`: one-row products over SmolLM2's weights, gemv.c against torch
    and oneDNN."""
    from compactrl.bench.harness import markdown_table

    r = json.loads(Path(result).read_text())
    names = ["gemv", "torch", "onednn"]
    rows = [[s["dtype"], f"{s['weight_bytes'] / 1e6:.0f}",
             *(f"{s['ms'][k]:.1f}" if k in s["ms"] else "-" for k in names),
             *(f"{s['gb_per_s'][k]:.1f}" if k in s["ms"] else "-" for k in names),
             f"{r['read_gb_per_s']:.1f}", f"{s['vs_torch']['gemv']:.2f}"]
            for s in r["settings"]]  # fmt: skip
    heads = ["dtype", "weights MB", "gemv.c ms", "torch ms", "oneDNN ms", "gemv.c GB/s", "torch GB/s"]
    return markdown_table([*heads, "oneDNN GB/s", "summing pass GB/s", "gemv.c speed-up over torch"], rows)


def _sampling(result: str) -> str:
    """`scripts/gemv_sampling_ab.py`: sampling rows of logits, sampling.c against the torch path."""
    from compactrl.bench.harness import markdown_table

    rows = [[s["batch"], s["vocab"], f"{s['ms']['kernel']:.2f}", f"{s['ms']['torch']:.2f}",
             f"{s['kernel_speed_up']:.2f}", "yes" if s["same_tokens"] else "no"]
            for s in json.loads(Path(result).read_text())["sampling"]]  # fmt: skip
    heads = ["rows", "vocabulary", "sampling.c ms", "torch path ms", "sampling.c speed-up", "same tokens"]
    return markdown_table(heads, rows)


def _panel_gemm(result: str) -> str:
    """`scripts/panel_gemm_ab.py`: SmolLM2's products at 2 to 2,048 rows, the panel kernel against
    oneDNN, and its GFLOP/s as a share of the core's peak (``scripts/fma_peak.c``: float32 FMAs, or
    bfloat16 dot products for ``--dtype bfloat16``)."""
    from compactrl.bench.harness import markdown_table

    r = json.loads(Path(result).read_text())
    bf16 = r.get("dtype") == "bfloat16"
    kernel, peak_name = ("panel_gemm_bf16.c", "dot peak") if bf16 else ("panel_gemm.c", "FMA peak")
    names, peak = ["panel_gemm", "onednn"], r["dot_peak_gflop_per_s" if bf16 else "fma_peak_gflop_per_s"]
    rows = [[f"{s['rows']}{'' if s['head'] else ' (no head)'}", *(f"{s['ms'][k]:.1f}" for k in names),
             *(f"{s['gb_per_s'][k]:.1f}" for k in names), *(f"{s['gflop_per_s'][k]:.1f}" for k in names),
             f"{s['gflop_per_s']['panel_gemm'] / peak:.2f}", f"{s['speed_up']:.2f}"]
            for s in r["settings"]]  # fmt: skip
    heads = ["rows", f"{kernel} ms", "oneDNN ms", f"{kernel} GB/s", "oneDNN GB/s", f"{kernel} GFLOP/s"]
    heads += ["oneDNN GFLOP/s", f"{kernel} / {peak_name}", f"{kernel} speed-up"]
    return markdown_table(heads, rows)


def _prefills(result: str, arms: str, key: str = "prefills") -> str:
    """Whole prefills toggled inside one engine (`toggled_prefills`: `scripts/panel_gemm_ab.py`,
    `chunk_attention_ab.py`, `decode_layers_ab.py`), ``arms`` naming the arm without the change
    and the arm with it, ``key`` the JSON's list."""
    from compactrl.bench.harness import markdown_table

    r = json.loads(Path(result).read_text())
    off, on = arms.split(",")
    rows = [[r.get("dtype", "float32"), s["sessions"], s["tokens"], *(f"{s['ms'][k]:.0f}" for k in (off, on)),
             f"{s['speed_up']:.2f}"] for s in r[key]]  # fmt: skip
    return markdown_table(["dtype", "sessions", "prompt tokens", f"{off} ms", f"{on} ms", "speed-up"], rows)


def _vllm_gemm(result: str) -> str:
    """`scripts/vllm_gemm_check.py`: vLLM's onednn_mm against torch's oneDNN product."""
    from compactrl.bench.harness import markdown_table

    rows = [[s["rows"], f"{s['ms']['vllm']:.1f}", f"{s['ms']['torch_onednn']:.1f}",
             f"{s['vllm_over_ours']:.2f}", "yes" if s["same_output"] else "no"]
            for s in json.loads(Path(result).read_text())["settings"]]  # fmt: skip
    heads = ["rows", "vLLM onednn_mm ms", "torch oneDNN ms", "vLLM / torch time", "same output"]
    return markdown_table(heads, rows)


def _kernel_steps(result: str, arms: str = "torch,kernels") -> str:
    """`scripts/gemv_sampling_ab.py --model` (or `panel_gemm_ab.py --model`, ``arms=onednn,panel_gemm``):
    whole decode steps without and with the kernels, ``arms`` naming the two."""
    from compactrl.bench.harness import markdown_table

    without, with_ = arms.split(",")
    rows = [[s["batch"], s["context"], *(f"{s['ms_per_step'][k]:.1f}" for k in (without, with_)),
             f"{s['speed_up']:.2f}"] for s in json.loads(Path(result).read_text())["steps"]]  # fmt: skip
    return markdown_table(["batch", "context", "step without ms", "step with ms", "speed-up"], rows)


def _of(module: str, function: str = "markdown"):
    """A module that renders its result as markdown (``markdown(result)``)."""

    def render(result: str) -> str:
        from importlib import import_module

        to_markdown = getattr(import_module(f"compactrl.{module}"), function)
        return to_markdown(json.loads(Path(result).read_text()))

    return render


RENDERERS = {
    "memory": _memory,
    "engine": _of("bench.engine"),
    "engine_floor": _of("bench.engine", "floor_markdown"),
    "throughput": _of("bench.memory", "throughput_markdown"),
    "profile": _profile,
    "decode_ab": _decode_ab,
    "attention": _attention,
    "chunk_attention": _chunk_attention,
    "gemv": _gemv,
    "sampling": _sampling,
    "kernel_steps": _kernel_steps,
    "panel_gemm": _panel_gemm,
    "prefills": _prefills,
    "vllm_gemm": _vllm_gemm,
    "trainer_hf": _of("bench.trainer_hf"),
    "scale": _of("bench.scale"),
    "serve": _of("bench.serve"),
    "serve_episodes": _of("bench.serve_episodes"),
    "evictors": _of("bench.evictors"),
    "modes": _of("bench.modes"),
    "trainer": _of("bench.trainer"),
    "study": _of("study"),
    "study_modes": _of("study", "modes_markdown"),
}


def render(spec: str, root: Path = Path(".")) -> str:
    """The table a block's spec (``RENDERER PATH ...``, paths from the repository root) renders."""
    name, *args = spec.split()
    if name not in RENDERERS:
        raise ValueError(f"unknown table renderer {name!r}; one of {sorted(RENDERERS)}")
    options = dict(a.split("=", 1) for a in args if "=" in a)
    paths = [str(root / a) for a in args if "=" not in a]
    return RENDERERS[name](*paths, **options).strip() + "\n"


def sync(page: Path, root: Path = Path("."), write: bool = False) -> list[str]:
    """The specs of ``page``'s blocks that differ from their JSON's rendering; ``write`` rewrites them."""
    text = page.read_text()
    stale = []

    def fresh(m: re.Match) -> str:
        table = render(m.group(2), root)
        if table != m.group(3):
            stale.append(m.group(2))
        return m.group(1) + table + m.group(4)

    new = BLOCK.sub(fresh, text)
    if write and new != text:
        page.write_text(new)
    return stale
