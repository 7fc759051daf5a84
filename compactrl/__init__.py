"""compactrl: long-horizon LLM agents with context compaction via KV-streams."""

__version__ = "0.1.0"
