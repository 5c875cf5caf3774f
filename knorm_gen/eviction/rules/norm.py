"""The paper's rule and its ablation (Devoto et al., "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression", arXiv:2406.11430): a low key norm predicts high
attention, so the lowest norms are kept."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .base import Rule, squared_norm


class Low(Rule):
    """Keep the lowest key norms (``keep="low"``, the L2Norm rule)."""

    name = "low"
    summary = "the lowest key norms (the paper's L2Norm rule)"

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        return squared_norm(keys)


class High(Rule):
    """Keep the highest key norms (``keep="high"``): the paper's ablation."""

    name = "high"
    summary = "the highest key norms (the paper's ablation)"

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        return -squared_norm(keys)
