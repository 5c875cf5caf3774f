"""Baselines blind to what a key says: random choice and recency (StreamingLLM)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .base import Rule


class Random(Rule):
    """Keep a random choice (``keep="random"``; reproducible through ``mx.random.seed``).
    Each KV head and layer draws its own: the control every layout is judged against
    at equal bytes."""

    name = "random"
    summary = "a random choice per KV head and layer (the control at equal bytes)"

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        return mx.random.uniform(shape=keys.shape[:3], dtype=mx.float32)


class Recent(Rule):
    """With the sinks, keep the most recent tokens (``keep="recent"``, StreamingLLM)."""

    name = "recent"
    summary = "the most recent tokens (StreamingLLM)"

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        return mx.broadcast_to(-positions.astype(mx.float32), keys.shape[:3])
