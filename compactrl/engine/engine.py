"""The inference engine: many sessions, one batched forward per step, KV evicted in place.

Each :meth:`Engine.step` (1) applies evictions that are due, (2) samples the next token of
every generating session from the logits of its last fed token, (3) picks the tokens to feed
(:mod:`~compactrl.engine.scheduler`: decode tokens first, then prefill chunks, within
``max_step_tokens`` and the KV pool, preempting and restoring sessions), and (4) runs one forward
(:mod:`~compactrl.engine.runner`). Rows, holes and shared fork prefixes are the
:mod:`~compactrl.engine.kv_book`'s; a session (:mod:`~compactrl.engine.session`) is the stream
and its state, and reaches the engine only through the methods of :class:`~.session.Host`.

Weights: :meth:`update_weights` swaps weights in flight and keeps every session's KV, so tokens
fed before the update keep old-weight K/V (PipelineRL-style staleness); a session preempted
after an update is recomputed with the new weights. From another thread (a trainer),
:meth:`stage_weights` hands weights over and the engine loads the newest at its next step.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from compactrl.engine.chunk_attention import ChunkAttention
from compactrl.engine.decode_attention import AttentionMode, DecodeAttention
from compactrl.engine.decode_layers import DecodeLayers
from compactrl.engine.fused import FusedProjection
from compactrl.engine.kv_book import KVBook
from compactrl.engine.kv_cache import KVCache
from compactrl.engine.linear import Linears, MatmulMode
from compactrl.engine.runner import Feed, forward_step, thread_tokens
from compactrl.engine.sampling import Sampler, find_stop
from compactrl.engine.scheduler import Scheduler
from compactrl.engine.session import RECORD_FIELDS, Generation, Session, SessionError, SessionMetrics
from compactrl.models.decoder import CausalLM
from compactrl.models.loading import load_model
from compactrl.models.lora import adapter_mask
from compactrl.models.tokenizer import Tokenizer


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kv_pool_tokens: int = Field(65536, gt=0, description="KV pool shared by all sessions, in tokens")
    max_step_tokens: int = Field(1024, gt=0, description="tokens fed per step (decode + prefill chunks)")
    block_size: int = Field(1, gt=0, description="KV accounting granularity per row (1 = token-exact)")
    compact_holes: float = Field(0.25, gt=0, le=1, description="compact a row when this share is holes")
    idle_grace_s: float = Field(
        0.1, ge=0, description="an idle session is not displaced by admissions until idle this long"
    )
    matmul: MatmulMode = Field(
        "auto",
        description="GEMM kernels: native (torch's), onednn (a CPU: weights reordered once into oneDNN's "
        "layout, gate and up in one GEMM; float32, or bfloat16 with native bfloat16 GEMMs), float32 "
        "(bfloat16/float16 weights converted block by block, float32 GEMM, output rounded), or auto "
        "(on a CPU the engine's C kernels where they build: a matrix-vector kernel for one row, "
        "float32 or bfloat16, and panel GEMMs for 2+ rows, float32 or bfloat16 with AVX512-BF16; "
        "else onednn where it applies, float32 for steps of 2+ tokens on a CPU without native "
        "bfloat16 GEMMs, native otherwise)",
    )
    attention: AttentionMode = Field(
        "auto",
        description="attention: kernel (C kernels compiled on first use with the system C compiler, "
        "CPU, float32 or bfloat16: one for decode tokens, one query token per session over its cache "
        "row with holes skipped, and one for prompt chunks, each token over its own row up to itself "
        "with holes masked), sdpa (torch's scaled_dot_product_attention), or auto (kernel where it "
        "builds, else sdpa)",
    )


class Engine:
    Book = KVBook  # the KV bookkeeping class (a benchmark's subclass may note what it is asked)

    def __init__(
        self, model: CausalLM, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        p = next(model.parameters())
        self.kv = KVCache(model.config, p.dtype, p.device)
        self.sampler = Sampler()
        self.projections = [FusedProjection(layer.self_attn) for layer in model.model.layers]
        self.linears = Linears(model, self.config.matmul)
        self.linears.prepare(model)
        self.attention = DecodeAttention.of(model, self.config.attention)
        self.chunk_attention = ChunkAttention.of(model, self.config.attention)
        self.decode_layers = DecodeLayers(
            model, self.linears, self.projections, self.attention, self.chunk_attention
        )
        self.sessions: dict[Session, None] = {}  # open sessions (insertion-ordered set); closed ones leave
        c = self.config
        self.book = self.Book(self.kv, self.sessions, c.block_size, c.compact_holes)
        self.scheduler = Scheduler(c, self.book, model, self.linears, self.projections)
        self.active = self.scheduler.active  # insertion-ordered set of busy sessions
        self.weights_version = 0  # weight loads applied (update_weights / stage_weights)
        self._staged: tuple[dict[str, torch.Tensor], int] | None = None
        self._staged_lock = threading.Lock()
        self.totals = {"steps": 0, "forward_s": 0.0, "peak_kv_tokens": 0, "evictor_s": 0.0}
        self.closed = SessionMetrics()  # the metrics of every closed session, summed
        self.closed_sessions = 0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype="float32", device="cpu", config=None) -> Engine:
        return cls(load_model(model_dir, dtype=dtype, device=device), Tokenizer.from_dir(model_dir), config)

    # ---- facts ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def position_limit(self) -> int:
        """Tokens a session may ever feed: stream positions are never renumbered, so evicting does not
        free any; a generation reaching it ends with finish reason ``"position_limit"``."""
        return self.model.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer else list(self.model.config.eos_token_id)

    @property
    def n_layers(self) -> int:
        return self.kv.n_layers

    def kv_tokens_used(self) -> int:
        """Pool usage: every resident row (live entries + holes) and every shared prefix, once."""
        return self.book.used()

    # ---- sessions --------------------------------------------------------------------------
    def session(self, rollout_id: str | None = None) -> Session:
        s = Session(self, rollout_id)  # the session reaches the engine as its Host
        self.sessions[s] = None
        return s

    def forget(self, s: Session) -> None:
        """A closed session leaves the engine entirely (its KV, its evictor state, its place in every
        scan); its metrics stay only as sums, so a server's engine does not grow with the sessions it
        has seen."""
        self.release(s)
        if s in self.sessions:
            del self.sessions[s]
            for k, v in asdict(s.metrics).items():
                if k != "peak_live_kv":
                    setattr(self.closed, k, getattr(self.closed, k) + v)
            self.closed_sessions += 1
            if s.evictor is not None:
                self.totals["evictor_s"] += s.evictor.seconds
        s.evictor = None

    def wake(self, s: Session) -> None:
        self.scheduler.wake(s)

    def check_fits(self, s: Session, more: int) -> None:
        need = self.book.blocks(s.live + more)
        if need > self.config.kv_pool_tokens:
            raise SessionError(
                f"session {s.id} would need {need} KV tokens (live {s.live} + {more}) but the pool holds "
                f"{self.config.kv_pool_tokens}; raise kv_pool_tokens or evict/compact first"
            )

    def fork(self, parent: Session, rollout_id: str | None) -> Session:
        while parent.unfed:  # feed the parent first, so that everything it holds is shared
            self.step()
        child = self.session(rollout_id)
        for name in RECORD_FIELDS:
            setattr(child, name, list(getattr(parent, name)))
        child.fed, child.live, child._seg, child._new_segment = (
            parent.fed,
            parent.live,
            parent._seg,
            parent._new_segment,
        )
        child.footprint, child.keys = parent.footprint, list(parent.keys)
        parent.footprint.share(parent._live_keys())
        child.drops = type(parent.drops)((e, list(idx)) for e, idx in parent.drops)
        child.pending_logits = None if parent.pending_logits is None else parent.pending_logits.clone()
        child.evictor = copy.deepcopy(parent.evictor)
        self.book.share(parent, child, self.scheduler.tick)  # the parent's row: a prefix both read
        for s in (parent, child):
            if s.busy:
                self.wake(s)
        return child

    def release(self, s: Session) -> None:
        """Drop a session's KV (close or preemption); shared prefixes go when their last reader does."""
        self.scheduler.release(s)

    def truncate(self, s: Session, n: int) -> None:
        """Cut a session's KV back to its first ``n - 1`` stream tokens (token ``n - 1`` is fed
        again, so the next generation has its logits; it gets the same K/V, at the same position)."""
        keep = max(n - 1, 0)
        self.book.truncate(s, keep)
        s.fed = min(s.fed, keep)
        s.pending_logits = None
        if s.busy:
            self.wake(s)

    # ---- one step ----------------------------------------------------------------------------
    def _sample(self, ready: list[Session]) -> None:
        gens: list[Generation] = [s.generation for s in ready]
        logits = torch.stack([s.pending_logits for s in ready])
        forced = [g.params.forced[len(g.tokens)] if g.params.forced else None for g in gens]
        out = self.sampler.sample(logits, [g.params for g in gens], [g.generator for g in gens], forced)
        toks, lps = out.tokens.tolist(), out.logprobs.tolist()
        mlps = out.model_logprobs.tolist() if out.model_logprobs is not None else [None] * len(ready)
        for i, (s, g, tok, lp, mlp) in enumerate(zip(ready, gens, toks, lps, mlps, strict=True)):
            if g.params.top_logprobs:
                g.top_logprobs.append(out.top[i])
            s._extend([tok], role=g.role, turn=g.turn, lp=lp, model_lp=mlp)
            s.pending_logits = None
            g.tokens.append(tok)
            g.logprobs.append(lp)
            s.metrics.decode_tokens += 1
            if tok in g.stop_ids or len(g.tokens) == len(g.params.forced):
                g._finish("stop")
            elif g.params.stop and find_stop(self._tail_text(g), g.params.stop) is not None:
                g._finish("stop")
            elif len(g.tokens) >= g.params.max_tokens:
                g._finish("length")
            elif len(s.tokens) >= self.position_limit:
                g._finish("position_limit")

    def _tail_text(self, g: Generation) -> str:
        width = max(len(x) for x in g.params.stop) + 8
        return self.tokenizer.decode(g.tokens[-width:])

    def step(self) -> int:
        """One batched forward over the active sessions; returns the number of tokens fed."""
        self.scheduler.tick += 1
        self.load_staged()
        for s in list(self.active):
            self.book.apply_drops(s)
            self.book.unchain(s)
        ready = [s for s in self.active if s.generating and s.unfed == 0 and s.pending_logits is not None]
        if ready:
            self._sample(ready)
        feeds, pool_used = self.scheduler.schedule()
        if feeds:
            t0 = time.perf_counter()
            with adapter_mask(self.model, lambda: thread_tokens(feeds, self.kv.device)):
                logits = forward_step(
                    self.model,
                    self.kv,
                    feeds,
                    self.projections,
                    self.linears,
                    self.attention,
                    self.decode_layers,
                    self.chunk_attention,
                )
            self.totals["forward_s"] += time.perf_counter() - t0
            for i, f in enumerate(feeds):
                self._fed(f, logits.get(i))
        self.totals["steps"] += 1
        self.totals["peak_kv_tokens"] = max(self.totals["peak_kv_tokens"], pool_used)
        for s in list(self.active):
            if not s.busy:
                del self.active[s]
        if not feeds and not ready and self.active and not self.scheduler.idle_residents():
            stuck = ", ".join(s.id for s in self.active)
            raise RuntimeError(f"no progress possible for sessions {stuck}: the KV pool cannot hold them")
        return sum(f.n for f in feeds)

    def _fed(self, f: Feed, logits: torch.Tensor | None) -> None:
        s = f.session
        s.last_active = time.monotonic()
        sampled = sum(s.trainable[f.start : f.start + f.n])
        s.metrics.prefill_tokens += f.n - sampled
        if sampled and f.n == 1:  # a decode step reads the whole live KV
            s.metrics.kv_reads += s.live
        s.fed += f.n
        if logits is not None:
            s.pending_logits = logits
        if s.evictor:  # before this step's due drops: H2O sums attention over the keys it was paid to
            s.evictor.observe(self.book, s, f)
        self.book.apply_drops(s)
        if s.evictor:
            s.evictor.after_feed(self.book, s, decoded=sampled if f.n == 1 else 0)
            self.book.apply_drops(s)

    def run(self, until: list[Generation] | None = None) -> None:
        """Step until every session is idle (or the given generations are done)."""
        while self.active and not (until is not None and all(g.done for g in until)):
            self.step()

    async def serve(self, idle_sleep: float = 0.001) -> None:
        """Drive the engine from an asyncio loop: agents ``await session.agenerate(...)`` meanwhile."""
        while True:
            if self.active:
                fed = self.step()
                await asyncio.sleep(0 if fed else idle_sleep)  # nothing fed: waiting for room
            else:
                await asyncio.sleep(idle_sleep)

    # ---- weights and metrics -----------------------------------------------------------------
    @torch.no_grad()
    def _check_weights(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
        params = {  # HF names, also under a loaded (gated) thread adapter's peft wrappers
            k.replace(".base_layer.", "."): p
            for k, p in self.model.named_parameters(remove_duplicate=False)
            if "lora_" not in k
        }
        unknown = sorted(set(state_dict) - set(params))
        if unknown:
            raise ValueError(f"update_weights got unknown tensors {unknown[:5]}; expected HF parameter names")
        for name, t in state_dict.items():
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != the model's {tuple(params[name].shape)}")
        return params

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Load new weights in flight (all or a subset, HF names); live sessions keep their old-weight
        KV. Everything is checked before anything is copied. Returns the number of tensors loaded."""
        params = self._check_weights(state_dict)
        with torch.no_grad():
            for name, t in state_dict.items():
                params[name].copy_(t)
        self.weights_version += 1
        return len(state_dict)

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Hand over weights ``version`` from another thread (a trainer); the engine loads the newest
        before its next step, between two forwards, so sessions continue on them with their KV."""
        self._check_weights(state_dict)
        with self._staged_lock:
            self._staged = (state_dict, version)

    def load_staged(self) -> bool:
        """Load weights handed over by :meth:`stage_weights`, if any (the engine's own thread)."""
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.update_weights(staged[0])
            self.weights_version = staged[1]
        return staged is not None

    def metrics(self) -> dict:
        total = asdict(self.closed)
        for s in self.sessions:
            for k, v in asdict(s.metrics).items():
                total[k] += v
        total.pop("peak_live_kv")
        fed = total["prefill_tokens"] + total["decode_tokens"]
        return {
            **total,
            "sessions": len(self.sessions),
            "sessions_closed": self.closed_sessions,
            "evictor_s": self.totals["evictor_s"]
            + sum(s.evictor.seconds for s in self.sessions if s.evictor),
            "live_kv_tokens": sum(s.live for s in self.sessions),
            "kv_tokens_used": self.kv_tokens_used(),
            "peak_kv_tokens": self.totals["peak_kv_tokens"],
            "kv_bytes_allocated": self.kv.nbytes(),
            "steps": self.totals["steps"],
            "tokens_per_s": fed / self.totals["forward_s"] if self.totals["forward_s"] else 0.0,
        }
