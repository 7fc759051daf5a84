"""The inference engine: many sessions, one batched forward per step, KV evicted in place.

Each :meth:`Engine.step` (1) applies evictions that are due, (2) samples the next token of
every generating session from the logits of its last fed token, (3) picks the tokens to feed
(decode tokens first, then prefill chunks, within ``max_step_tokens`` and the KV pool), and
(4) runs one forward. When the pool is full, admitting a session displaces only idle residents;
a running session that must grow may also displace the most recently admitted busy ones.

Preemption drops a session's KV; it resumes by recomputing its whole stream under its eviction
mask (:func:`~compactrl.engine.runner.prefill_stream`), which reproduces the dropped K/V exactly.

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

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from compactrl.engine.fused import FusedProjection
from compactrl.engine.kv_cache import KVCache, Segment
from compactrl.engine.linear import Linears, MatmulMode
from compactrl.engine.runner import Feed, forward_step, prefill_stream, thread_tokens
from compactrl.engine.sampling import Sampler, find_stop
from compactrl.engine.session import RECORD_FIELDS, Generation, Session, SessionError, SessionMetrics
from compactrl.models.decoder import CausalLM
from compactrl.models.loading import load_model
from compactrl.models.lora import adapter_mask
from compactrl.models.tokenizer import Tokenizer


def _locate(sorted_idx: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of ``idx`` in the sorted array, and which of them are present."""
    pos = np.searchsorted(sorted_idx, idx)
    if not len(sorted_idx):
        return pos, np.zeros(len(idx), dtype=bool)
    return pos, (pos < len(sorted_idx)) & (sorted_idx[np.minimum(pos, len(sorted_idx) - 1)] == idx)


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
        "(onednn where it applies, else float32 for steps of 2+ tokens on a CPU without native "
        "bfloat16 GEMMs, else native)",
    )


class Engine:
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
        self.sessions: dict[Session, None] = {}  # open sessions (insertion-ordered set); closed ones leave
        self.active: dict[Session, None] = {}  # insertion-ordered set of busy sessions
        self.segments: set[Segment] = set()
        self.tick = 0
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

    def _blocks(self, n: int) -> int:
        b = self.config.block_size
        return -(-n // b) * b

    def kv_tokens_used(self) -> int:
        """Pool usage: every resident row (live entries + holes) and every shared prefix, once."""
        rows = sum(self._blocks(self.kv.used[s.row]) for s in self.sessions if s.row is not None)
        return rows + sum(self._blocks(seg.n) for seg in self.segments)

    # ---- sessions --------------------------------------------------------------------------
    def session(self, rollout_id: str | None = None) -> Session:
        s = Session(self, rollout_id)
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
        self.active[s] = None
        s.last_active = time.monotonic()

    def check_fits(self, s: Session, more: int) -> None:
        need = self._blocks(s.live + more)
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
        if parent.row is not None:  # freeze the parent's row into a prefix both of them read
            seg = Segment(parent.row, self.kv.stream_index(parent.row).cpu().numpy().copy(), refs=2)
            self.segments.add(seg)
            mask = self.kv.valid[parent.row, : seg.n].clone()
            for g, _ in parent.chain:
                g.refs += 1  # the child's reference to the parent's older prefixes
            child.chain = [(g, m.clone()) for g, m in parent.chain] + [(seg, mask.clone())]
            parent.chain = parent.chain + [(seg, mask)]
            for s in (parent, child):
                s.row = self.kv.alloc()
                s.admitted_at = self.tick
        for s in (parent, child):
            if s.busy:
                self.wake(s)
        return child

    def release(self, s: Session) -> None:
        """Drop a session's KV (close or preemption); shared prefixes go when their last reader does."""
        if s.row is not None:
            self.kv.release(s.row)
            s.row = None
        for seg, _ in s.chain:
            seg.refs -= 1
            if seg.refs == 0:
                self.kv.release(seg.row)
                self.segments.discard(seg)
        s.chain = []
        self.active.pop(s, None)

    def truncate(self, s: Session, n: int) -> None:
        """Cut a session's KV back to its first ``n - 1`` stream tokens (token ``n - 1`` is fed
        again, so the next generation has its logits; it gets the same K/V, at the same position)."""
        keep = max(n - 1, 0)
        if s.row is not None:
            self.kv.cut(s.row, keep)
        for seg, mask in s.chain:
            mask[torch.as_tensor(seg.stream_index >= keep, device=mask.device)] = False
        s.fed = min(s.fed, keep)
        s.pending_logits = None
        if s.busy:
            self.wake(s)

    # ---- KV bookkeeping --------------------------------------------------------------------
    def live_parts(self, s: Session, chain=None) -> list[tuple[int, torch.Tensor]]:
        """A resident session's live KV entries in stream order, as ``(row, entries)``: those of its
        shared prefixes (``chain``, default all of them) first, then its own row's."""
        parts = [
            (seg.row, torch.nonzero(mask).squeeze(1)) for seg, mask in (s.chain if chain is None else chain)
        ]
        return parts + [(s.row, torch.nonzero(self.kv.valid[s.row, : self.kv.used[s.row]]).squeeze(1))]

    def _unchain(self, s: Session) -> None:
        """Fold the shared prefixes at the end of a session's chain that no other session reads any
        more (their forks closed) back into one row of its own: a chained session attends segment
        by segment, an unchained one decodes in the batched path."""
        k = len(s.chain)
        while k and s.chain[k - 1][0].refs == 1:
            k -= 1
        if s.row is None or k == len(s.chain):
            return
        row = self.kv.gather(self.live_parts(s, s.chain[k:]))
        self.kv.release(s.row)
        for seg, _ in s.chain[k:]:
            self.kv.release(seg.row)
            self.segments.discard(seg)
        s.row, s.chain = row, s.chain[:k]

    def _apply_drops(self, s: Session) -> None:
        """Clear the KV of evictions that are due (fed == e); a non-resident session keeps them
        pending until its recompute has put those tokens back."""
        while s.row is not None and s.drops and s.drops[0][0] == s.fed:
            _, idx = s.drops.popleft()
            idx = np.asarray(idx)
            pos, mine = _locate(self.kv.stream_index(s.row).cpu().numpy(), idx)
            if mine.any():
                self.kv.invalidate(s.row, torch.as_tensor(pos[mine], device=self.kv.device))
            for j in idx[~mine]:
                for seg, mask in s.chain:
                    p, found = _locate(seg.stream_index, np.array([j]))
                    if found[0]:
                        mask[int(p[0])] = False
                        break
                else:
                    raise AssertionError(f"session {s.id}: token {j} is live but not in its KV")

    def _idle_residents(self) -> bool:
        """Idle sessions hold KV: waiting out their grace period (or displacing them) makes room."""
        return any(not s.busy and s.row is not None for s in self.sessions)

    def _displaceable(self, s: Session, now: float) -> bool:
        """An idle resident that has been idle past the grace period (an agent between turns
        comes back soon: displacing it would only make it recompute)."""
        return not s.busy and now - s.last_active >= self.config.idle_grace_s

    def _preempt_one(self, keep: set[Session], idle_only: bool) -> bool:
        now = time.monotonic()
        victims = [
            s for s in self.sessions
            if s.row is not None and s not in keep
            and (self._displaceable(s, now) if idle_only else True)
        ]  # fmt: skip
        if not victims:
            return False
        idle = [s for s in victims if not s.busy]
        # idle ones first, least recently active; then busy ones, most recently admitted (LIFO)
        v = min(idle, key=lambda s: s.last_active) if idle else max(victims, key=lambda s: s.admitted_at)
        self.release(v)
        v.metrics.preemptions += 1
        if v.busy:
            self.wake(v)
        return True

    def _make_room(self, need: int, keep: set[Session], used: int, idle_only: bool = False) -> int | None:
        """Preempt until ``need`` more tokens fit; returns the pool usage then, or None if they can't.
        Admissions only displace idle sessions (so busy ones are not thrashed); growth may displace
        busy ones too."""
        while used + need > self.config.kv_pool_tokens:
            if not self._preempt_one(keep, idle_only):
                return None
            used = self.kv_tokens_used()
        return used

    def _restore(self, s: Session) -> None:
        """Give a non-resident session a row: empty if nothing was fed, else recompute its stream."""
        s.row = self.kv.alloc()
        s.admitted_at = self.tick
        if s.fed == 0:
            return
        T = s.fed
        ev = torch.tensor([T if e is None or e >= T else e for e in s.evict_at[:T]])
        own = s.adapter_from if s.adapter_from is not None else T
        with adapter_mask(self.model, lambda: torch.arange(T, device=self.kv.device) >= own):
            ks, vs, logits = prefill_stream(
                self.model, s.tokens[:T], ev, linears=self.linears, projections=self.projections
            )
        # live now: never evicted or evicted later than T. Drops due at T were requested while the
        # session was out: they are done here, so the row holds exactly the `live` it asked room for
        while s.drops and s.drops[0][0] == T:
            s.drops.popleft()
        alive = [j for j, e in enumerate(s.evict_at[:T]) if e is None or e > T]
        keep = torch.tensor(alive, dtype=torch.long, device=self.kv.device)
        start = self.kv.append(s.row, len(keep))
        for li in range(self.kv.n_layers):
            self.kv.k[li][s.row, :, start : start + len(keep)] = ks[li].index_select(1, keep)
            self.kv.v[li][s.row, :, start : start + len(keep)] = vs[li].index_select(1, keep)
        self.kv.pos[s.row, start : start + len(keep)] = keep
        self.kv.valid[s.row, start : start + len(keep)] = True
        s.pending_logits = logits
        s.metrics.reprefilled_tokens += T

    def _claim(self, s: Session, n: int) -> int:
        if self.kv.dead[s.row] > max(32, self.config.compact_holes * self.kv.used[s.row]):
            self.kv.compact(s.row)
        return self.kv.append(s.row, n)

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
        self.tick += 1
        self.load_staged()
        for s in list(self.active):
            self._apply_drops(s)
            self._unchain(s)
        ready = [s for s in self.active if s.generating and s.unfed == 0 and s.pending_logits is not None]
        if ready:
            self._sample(ready)
        feeds, pool_used = self._schedule()
        if feeds:
            t0 = time.perf_counter()
            with adapter_mask(self.model, lambda: thread_tokens(feeds, self.kv.device)):
                logits = forward_step(self.model, self.kv, feeds, self.projections, self.linears)
            self.totals["forward_s"] += time.perf_counter() - t0
            for i, f in enumerate(feeds):
                self._fed(f, logits.get(i))
        self.totals["steps"] += 1
        self.totals["peak_kv_tokens"] = max(self.totals["peak_kv_tokens"], pool_used)
        for s in list(self.active):
            if not s.busy:
                del self.active[s]
        if not feeds and not ready and self.active and not self._idle_residents():
            stuck = ", ".join(s.id for s in self.active)
            raise RuntimeError(f"no progress possible for sessions {stuck}: the KV pool cannot hold them")
        return sum(f.n for f in feeds)

    def _schedule(self) -> tuple[list[Feed], int]:
        """Pick this step's tokens: decode tokens first, then prefill chunks in arrival order, within
        ``max_step_tokens``; admit (or resume) sessions and preempt others to fit the KV pool."""
        feeds: list[Feed] = []
        picked: set[Session] = set()
        budget = self.config.max_step_tokens
        pool_used = self.kv_tokens_used()
        for s in sorted(self.active, key=lambda s: not s.generating):
            if budget <= 0:
                break
            if s.unfed == 0:
                continue
            if s.row is None:  # new or preempted: (re)admit it, recomputing what it had fed
                room = self._make_room(self._blocks(s.live), picked | {s}, pool_used, idle_only=True)
                if room is None:
                    pool_used = self.kv_tokens_used()
                    continue
                self._restore(s)
                self._apply_drops(s)
                pool_used = room + self._blocks(self.kv.used[s.row])
            limit = s.drops[0][0] - s.fed if s.drops else s.unfed  # an eviction splits the chunk
            n = min(s.unfed, limit, budget)
            before = self._blocks(self.kv.used[s.row])
            room = self._make_room(self._blocks(self.kv.used[s.row] + n) - before, picked | {s}, pool_used)
            if room is None:
                pool_used = self.kv_tokens_used()
                continue
            entry = self._claim(s, n)
            pool_used = room - before + self._blocks(self.kv.used[s.row])
            done = s.fed + n == len(s.tokens)
            keep_q = s.evictor.keep(n) if s.evictor else 0
            feeds.append(Feed(s, s.tokens[s.fed : s.fed + n], s.fed, entry, s.row, s.chain, done, keep_q))
            picked.add(s)
            budget -= n
        return feeds, pool_used

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
            s.evictor.observe(self, s, f)
        self._apply_drops(s)
        if s.evictor:
            s.evictor.after_feed(self, s, decoded=sampled if f.n == 1 else 0)
            self._apply_drops(s)

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
