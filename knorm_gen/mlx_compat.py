"""Every piece of mlx_lm that is not its public generation API and that we rely on.

When mlx_lm changes, this module says what broke (:func:`missing_mlx_lm_protocol`,
checked by the test suite; pyproject.toml pins the range the suite ran on):

- the cache protocol's private base class ``_BaseCache`` (our caches subclass it)
  and ``create_attention_mask`` (our masks are built with it);
- ``load_prompt_cache`` rebuilding caches by class name from
  ``mlx_lm.models.cache``: :func:`register_cache_class` puts ours there;
- "a plain full-attention layer is a ``KVCache``" (:func:`is_full_attention`):
  the only layers eviction replaces;
- the Llama-family models build one full-attention mask per forward and hand it
  to every layer: :func:`own_layer_masks` wraps ``model.layers`` so that each layer
  builds its own, for the duration of our batched calls;
- ``BatchGenerator``'s ``stats()`` counters and response fields (``uid``,
  ``token``, ``finish_reason``, ``prompt_cache``, ``progress``,
  ``end_of_prompt``): :func:`generator_step` reads them in one place;
- each model module's module-level ``scaled_dot_product_attention``, which the
  probe rebinds to record queries and keys (:func:`record_attention`);
- :data:`QUANTIZED_ATTENTION`: that function takes the quantized path for a cache
  with a ``bits`` attribute (``kv_bits``).
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from mlx_lm.models import base as _base
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.cache import (  # noqa: F401  (re-exported for the caches)
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    _BaseCache,
    create_attention_mask,
    make_prompt_cache,
)


QUANTIZED_ATTENTION = (
    "mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values, cache, ...) calls "
    "quantized_scaled_dot_product_attention when hasattr(cache, 'bits'), with cache.bits and cache.group_size; "
    "keys and values are then mx.quantize triples (packed, scales, biases)")
"""The contract a cache that stores ``kv_bits`` relies on: it has ``bits`` and
``group_size`` (and a full-precision one has neither: :func:`knorm_gen.quant.mark_for_attention`),
and returns its keys and values as ``mx.quantize`` triples. Every mlx_lm model
that attends through ``base.scaled_dot_product_attention`` then runs
``mx.quantized_matmul`` on them. Checked by :func:`missing_mlx_lm_protocol`."""


def missing_mlx_lm_protocol() -> list[str]:
    """The pieces of mlx_lm this package relies on that the installed mlx_lm
    lacks; empty when all are there."""
    import importlib

    _generate = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function
    missing = []
    for name in ("_BaseCache", "KVCache", "BatchKVCache", "RotatingKVCache", "make_prompt_cache",
                 "load_prompt_cache", "save_prompt_cache", "create_attention_mask"):
        if not hasattr(_mlx_cache, name):
            missing.append(f"mlx_lm.models.cache.{name}")
    if not callable(getattr(getattr(_mlx_cache, "_BaseCache", None), "from_state", None)):
        missing.append("mlx_lm.models.cache._BaseCache.from_state (load_prompt_cache rebuilds caches with it)")
    try:
        if "globals()" not in inspect.getsource(_mlx_cache.load_prompt_cache):
            missing.append("load_prompt_cache looking cache classes up by name in mlx_lm.models.cache")
    except (OSError, TypeError, AttributeError):
        missing.append("the source of mlx_lm.models.cache.load_prompt_cache")
    try:
        source = inspect.getsource(_base.scaled_dot_product_attention)
        if 'hasattr(cache, "bits")' not in source or "cache.group_size" not in source:
            missing.append(f"mlx_lm.models.base.scaled_dot_product_attention dispatching on the cache's bits "
                           f"({QUANTIZED_ATTENTION})")
    except (OSError, TypeError, AttributeError):
        missing.append("the source of mlx_lm.models.base.scaled_dot_product_attention")
    wanted = {
        (_base, "create_attention_mask"): ("h", "cache", "window_size", "return_array"),
        (_base, "create_causal_mask"): ("N", "offset", "window_size"),
        (_mlx_cache, "create_attention_mask"): ("N", "offset", "return_array", "window_size"),
    }
    for (module, name), params in wanted.items():
        fn = getattr(module, name, None)
        have = set(inspect.signature(fn).parameters) if callable(fn) else set()
        for p in params:
            if p not in have:
                missing.append(f"{module.__name__}.{name}(..., {p}=...)")
    gen = getattr(_generate, "BatchGenerator", None)
    for name in ("insert", "next", "stats", "close"):
        if not callable(getattr(gen, name, None)):
            missing.append(f"mlx_lm.generate.BatchGenerator.{name}")
    if gen is not None:
        params = set(inspect.signature(gen.insert).parameters)
        for p in ("max_tokens", "caches", "samplers"):
            if p not in params:
                missing.append(f"mlx_lm.generate.BatchGenerator.insert(..., {p}=...)")
    return missing


def register_cache_class(cls: type, *aliases: str) -> type:
    """Make ``load_prompt_cache`` find ``cls``: it rebuilds caches by class name
    from mlx_lm's cache module (``aliases``: earlier names of the class, which
    saved caches still carry)."""
    for name in (cls.__name__, *aliases):
        setattr(_mlx_cache, name, cls)
    return cls


def is_full_attention(cache: Any) -> bool:
    """A plain full-attention layer: the only kind eviction replaces (sliding-window
    and SSM caches stay as the model made them)."""
    return type(cache) is KVCache


def full_attention_layers(model: Any) -> list[int]:
    """The layers whose mlx_lm cache is a plain ``KVCache``."""
    return [i for i, c in enumerate(make_prompt_cache(model)) if is_full_attention(c)]


def kv_head_dims(model: Any) -> list[int]:
    """The key and value head sizes of ``model``'s full-attention layers, read from
    one token through fresh caches (models name them differently in their args)."""
    import mlx.core as mx

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    return sorted({d for c in caches if is_full_attention(c) for d in (c.keys.shape[-1], c.values.shape[-1])})


# ---- the shared-mask trap ----------------------------------------------------


class _OwnMaskLayer:
    """Wraps one transformer block: with a full-attention batch cache it builds the
    mask from that layer's own cache instead of the one the model shares."""

    def __init__(self, block: Any):
        self._block = block

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        if isinstance(cache, BatchKVCache) or getattr(cache, "per_row_mask", False):
            mask = cache.make_mask(x.shape[1], return_array=True)
        return self._block(x, mask, cache, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._block, name)


@contextmanager
def own_layer_masks(model: Any) -> Iterator[None]:
    """While the block runs, every layer of ``model`` whose cache is a full-attention
    batch cache (mlx_lm's ``BatchKVCache``, or a cache class with ``per_row_mask``
    set, as ours) attends with a mask built from its own cache. The model's layer list is restored on exit,
    so outside our calls the model behaves exactly as before; nothing in mlx_lm is
    patched. Re-entrant."""
    layers = model.layers
    if any(isinstance(block, _OwnMaskLayer) for block in layers):
        yield  # already inside our call
        return
    originals = list(layers)
    try:
        for i, block in enumerate(originals):
            layers[i] = _OwnMaskLayer(block)
        if not isinstance(model.layers[0], _OwnMaskLayer):
            raise TypeError(f"{type(model).__name__}.layers is not the list the model runs, so each layer cannot "
                            "build its own mask; batched eviction does not support this model")
        yield
    finally:
        layers[:] = originals


# ---- BatchGenerator ------------------------------------------------------------


@dataclass
class Prefilled:
    """A row's prompt progress in one generator step."""

    uid: int
    done: int  # prompt tokens processed so far
    entered_decode: bool  # its last prompt token went through (the first decode forward)


@dataclass
class Decoded:
    """One token a row decoded in one generator step."""

    uid: int
    token: int
    finish_reason: Any  # None while the row goes on; then "stop" or "length"
    caches: Any  # the row's caches once it finished


@dataclass
class StepTiming:
    wall_s: float
    decode_s: float


def generator_step(gen: Any) -> tuple[list[Prefilled], list[Decoded], StepTiming]:
    """One ``BatchGenerator.next()``, in our own terms."""
    with gen.stats() as stats:
        prompt_responses, responses = gen.next()
    prefilled = []
    for p in prompt_responses:
        done = p.progress[0] if isinstance(p.progress, tuple) else p.progress
        prefilled.append(Prefilled(p.uid, done, bool(p.end_of_prompt)))
    decoded = [Decoded(r.uid, int(r.token), r.finish_reason, r.prompt_cache) for r in responses]
    return prefilled, decoded, StepTiming(stats.wall_time, stats.decode_time)


# ---- the probe's view into attention -------------------------------------------


@contextmanager
def record_attention(model: Any, calls: list) -> Iterator[None]:
    """Record ``(queries, keys, scale)`` at every attention call of the model's module."""
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    original = module.scaled_dot_product_attention

    def recording(queries, keys, values, cache, scale, mask, **kwargs):
        calls.append((queries, keys, scale))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    module.scaled_dot_product_attention = recording
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original
