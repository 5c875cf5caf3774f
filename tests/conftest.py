"""Shared fixtures: tiny random mlx_lm llama models (no weights needed)."""

import knorm_gen  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama


def tiny_llama(layers: int = 3, seed: int = 0, layer_types=None, sliding_window=None, vocab: int = 97):
    """A small random llama in float32; outputs are deterministic for a seed."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def random_tokens(n: int, seed: int = 0, vocab: int = 97, repeat: bool = True) -> mx.array:
    """Token ids; with ``repeat`` a small alphabet so equal keys (exact norm ties) occur."""
    rng = np.random.default_rng(seed)
    high = 12 if repeat else vocab
    return mx.array(rng.integers(0, high, size=n), dtype=mx.int32)


@pytest.fixture
def tiny_model():
    return tiny_llama()
