"""Inference engine with in-place KV eviction (KV-streams) and continuous batching."""

from compactrl.engine.engine import Engine, EngineConfig
from compactrl.engine.sampling import SamplingParams
from compactrl.engine.session import Generation, Session, SessionError

__all__ = ["Engine", "EngineConfig", "Generation", "SamplingParams", "Session", "SessionError"]
