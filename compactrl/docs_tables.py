"""The documentation's result tables, rendered from the JSON the benches and studies wrote, so a
page and its data cannot drift: a page marks a table with

    <!-- table: memory docs/bench_x.json configs/bench/x.toml -->
    ...the rendered table...
    <!-- end table -->

and `python scripts/docs_tables.py` rewrites every marked block from its JSON (a test fails when a
page differs from what its JSON renders). Renderers: ``memory`` (a `compactrl bench memory`
result, with the pooled or contrasted table its bench config asks for), ``engine`` (`compactrl bench
engine` against transformers and vLLM), ``scale``, ``serve`` and ``serve_episodes`` (those
benches' own markdown)."""

from __future__ import annotations

import json
import re
from pathlib import Path

BLOCK = re.compile(r"(<!-- table: (.+?) -->\n)(.*?)(<!-- end table -->)", re.S)


def _memory(result: str, bench: str | None = None) -> str:
    from compactrl.bench.memory import contrasted, load_bench, markdown, pooled, pooled_markdown

    table = json.loads(Path(result).read_text())
    parts = [markdown(table)]
    if bench is not None:
        b = load_bench(bench)
        if b.pool_sets:
            parts.append(pooled_markdown(pooled(table, b.contrasts)))
        elif b.contrasts:
            parts.append(pooled_markdown(contrasted(table, b.contrasts)))
    return "\n\n".join(p.strip() for p in parts)


def _engine(result: str) -> str:
    """`compactrl bench engine` against transformers and vLLM: tokens/s and the ratios, per setting."""
    r = json.loads(Path(result).read_text())
    lines = ["| batch | context | decode: ours tok/s | / transformers | / vLLM | prefill: ours tok/s "
             "| / transformers | / vLLM |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in r["settings"]:
        dec, pre = s["decode_tokens_per_s"], s["prefill_tokens_per_s"]
        ratios = [dec / s["transformers_decode_tokens_per_s"], dec / s["vllm_decode_tokens_per_s"]]
        ratios += [pre / s["transformers_prefill_tokens_per_s"], pre / s["vllm_prefill_tokens_per_s"]]
        cells = [s["batch"], s["context"], f"{dec:.1f}", *(f"{x:.2f}" for x in ratios[:2]), f"{pre:.0f}",
                 *(f"{x:.2f}" for x in ratios[2:])]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _of(module: str):
    """A bench whose module renders its result as markdown (``markdown(result)``)."""

    def render(result: str) -> str:
        from importlib import import_module

        return import_module(f"compactrl.bench.{module}").markdown(json.loads(Path(result).read_text()))

    return render


RENDERERS = {
    "memory": _memory,
    "engine": _engine,
    "scale": _of("scale"),
    "serve": _of("serve"),
    "serve_episodes": _of("serve_episodes"),
}


def render(spec: str, root: Path = Path(".")) -> str:
    """The table a block's spec (``RENDERER PATH ...``, paths from the repository root) renders."""
    name, *args = spec.split()
    if name not in RENDERERS:
        raise ValueError(f"unknown table renderer {name!r}; one of {sorted(RENDERERS)}")
    return RENDERERS[name](*(str(root / a) for a in args)).strip() + "\n"


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
