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
  ``end_of_prompt``, ``logprobs``): :func:`generator_step` reads them in one place;
- the list a model's forward iterates (:func:`decoder_layers`): ``model.layers``, or for
  pipeline-parallel models the lists under the model that hold its blocks;
- each model module's module-level ``scaled_dot_product_attention``, which the probe
  rebinds to record the queries each call attends with and the cache it names, and each
  attention block's ``rope`` module for models that attend themselves (:func:`record_queries`);
- :data:`QUANTIZED_ATTENTION`: that function takes the quantized path for a cache
  with a ``bits`` attribute (``kv_bits``).
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

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
``group_size`` (and a full-precision one has neither: :func:`knorm_gen.eviction.quant.mark_for_attention`),
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
    return sorted({d for c in caches if is_full_attention(c) and c.keys is not None
                   for d in (c.keys.shape[-1], c.values.shape[-1])})


# ---- the layers the model runs, and the shared-mask trap ----------------------


class UnsupportedModelError(ValueError):
    """A model whose mlx_lm code lacks a piece eviction relies on: the message names
    its architecture, the missing piece and what still works."""


def architecture(model: Any) -> str:
    """The mlx_lm architecture (``model_type``) of ``model``, or its module's name."""
    args = getattr(model, "args", None)
    name = getattr(args, "model_type", None) or getattr(model, "model_type", None)
    return str(name) if name else type(model).__module__.rsplit(".", 1)[-1]


def _module_lists(module: Any, depth: int = 3) -> Iterator[list]:
    """Every list held by ``module`` or its submodules (``depth`` levels down)."""
    import mlx.nn as nn

    for value in module.values() if isinstance(module, dict) else ():
        if isinstance(value, list):
            yield value
        elif isinstance(value, nn.Module) and depth:
            yield from _module_lists(value, depth - 1)


def decoder_layers(model: Any) -> list[list]:
    """The list objects the model's forward pass iterates over (one for most models). Most
    mlx_lm models expose it as ``model.layers``; pipeline-parallel ones (``qwen2``,
    ``qwen3_moe``, ``deepseek_v3``, ... through ``PipelineMixin``) return a new slice of
    ``model.model.layers`` at every access, and a few join two lists, so replacing an item
    of ``model.layers`` would change nothing the model runs: there the lists are found
    under the model, as those that hold the very blocks ``model.layers`` shows.
    :class:`UnsupportedModelError` when they are not found."""
    shown = getattr(model, "layers", None)
    if not isinstance(shown, (list, tuple)) or not shown:
        raise UnsupportedModelError(f"{architecture(model)}: the model has no list of layers (model.layers), so "
                                    f"there is no attention cache to evict from")
    if isinstance(shown, list) and model.layers is shown:
        return [shown]
    wanted = {id(b) for b in shown if b is not None}
    found, covered = [], set()
    for candidate in _module_lists(model):
        ids = {id(b) for b in candidate if b is not None}
        if candidate is not shown and ids & wanted and not ids - wanted:
            found.append(candidate)
            covered |= ids
    if covered != wanted:
        raise UnsupportedModelError(f"{architecture(model)}: model.layers is a new list at every access and no "
                                    f"list under the model holds its blocks, so each layer cannot be given its own "
                                    f"mask")
    return found


_MASK_NAMES = ("mask", "attention_mask", "attn_mask")


class _OwnMaskLayer:
    """Wraps one transformer block: with a full-attention batch cache it builds the mask
    from that layer's own cache instead of the one the model shares. The block's own
    signature says which argument is the mask (``mask``, ``attention_mask``, ``attn_mask``)
    and which the cache, however the model passes them."""

    def __init__(self, block: Any):
        self._block = block

    def __call__(self, *args, **kwargs):
        try:
            bound = _signature(self._block).bind(*args, **kwargs)
        except TypeError:
            return self._block(*args, **kwargs)
        cache = bound.arguments.get("cache")
        if isinstance(cache, BatchKVCache) or getattr(cache, "per_row_mask", False):
            name = next((n for n in _MASK_NAMES if n in bound.signature.parameters), None)
            hidden = next(iter(bound.arguments.values()))
            if name is not None:
                bound.arguments[name] = cache.make_mask(hidden.shape[1], return_array=True)
        return self._block(*bound.args, **bound.kwargs)

    def __getattr__(self, name: str):
        return getattr(self._block, name)


_SIGNATURES: dict = {}


def _signature(block: Any) -> inspect.Signature:
    kind = type(block)
    if kind not in _SIGNATURES:
        _SIGNATURES[kind] = inspect.signature(block.__call__)
    return _SIGNATURES[kind]


@contextmanager
def own_layer_masks(model: Any) -> Iterator[None]:
    """While the block runs, every layer of ``model`` whose cache is a full-attention
    batch cache (mlx_lm's ``BatchKVCache``, or a cache class with ``per_row_mask``
    set, as ours) attends with a mask built from its own cache. The list the model
    iterates (:func:`decoder_layers`) is restored on exit, so outside our calls the
    model behaves exactly as before; nothing in mlx_lm is patched. Re-entrant."""
    lists = decoder_layers(model)
    if any(isinstance(block, _OwnMaskLayer) for layers in lists for block in layers):
        yield  # already inside our call
        return
    originals = [list(layers) for layers in lists]
    try:
        for layers in lists:
            layers[:] = [block if block is None else _OwnMaskLayer(block) for block in layers]
        if not any(isinstance(block, _OwnMaskLayer) for block in model.layers):
            raise UnsupportedModelError(f"{architecture(model)}: model.layers is not the list the model runs, so "
                                        f"each layer cannot build its own mask")
        yield
    finally:
        for layers, before in zip(lists, originals):
            layers[:] = before


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
    logprobs: Any = None  # the step's log-probabilities over the vocabulary


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
    decoded = [Decoded(r.uid, int(r.token), r.finish_reason, r.prompt_cache, getattr(r, "logprobs", None))
               for r in responses]
    return prefilled, decoded, StepTiming(stats.wall_time, stats.decode_time)


# ---- the probe's view into attention -------------------------------------------


class ProbeCache:
    """One layer's cache for a probe pass: a plain growing cache whose ``offset`` (the
    RoPE position) may jump over the document. It tells :func:`record_queries` which
    layer an attention call belongs to, and whether that call attends with the keys
    this cache stores (so its queries can score them)."""

    def __init__(self, layer: int):
        self.layer = layer
        self.keys = self.values = None
        self.offset = 0
        self.recording: Optional[QueryRecording] = None
        self._returned = None  # the keys the last update returned: what attention should use
        self._queries = None  # this pass's queries, once an attention call or a RoPE output shows them
        self._via_rope = False

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        if self.recording is not None:
            self.recording.update(self, keys)
        self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=2)
        self.values = values if self.values is None else mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        self._returned = self.keys
        return self.keys, self.values

    def keys_and_values(self):
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        held = 0 if self.keys is None else self.keys.shape[2]
        return create_attention_mask(N, offset=held, return_array=return_array, window_size=window_size)

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    def size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@dataclass
class QueryRecording:
    """What :func:`record_queries` saw: per layer, the query blocks of each pass that
    attended with the keys the layer's cache stores (``(B, query heads, L, D)``), and
    the layers whose attention used other keys in some pass (multi-head latent
    attention's prefill form, whose cache stores a latent the block's keys are made from)."""

    queries: dict = field(default_factory=dict)
    other: set = field(default_factory=set)
    rope_outputs: list = field(default_factory=list)
    by_rope: set = field(default_factory=set)  # layers whose queries came from a rope module, not from mlx_lm's SDPA

    def update(self, cache: ProbeCache, keys) -> None:
        self.close(cache)
        # A RoPE output of this layer's pass that is not the keys and has their shape: the queries.
        found = [x for x in self.rope_outputs if x is not keys and x.ndim == 4 and x.shape[0] == keys.shape[0]
                 and x.shape[2] == keys.shape[2] and x.shape[3] == keys.shape[3]]
        cache._queries = found[-1] if found else None
        cache._via_rope = bool(found)
        self.rope_outputs.clear()

    def attended(self, cache: ProbeCache, queries, keys) -> None:
        grouped = _in_stored_space(queries, keys, cache._returned)
        if grouped is not None:
            cache._queries, cache._via_rope = grouped, False
        else:
            cache._queries = None
            self.other.add(cache.layer)

    def close(self, cache: ProbeCache) -> None:
        """File the pass that ``cache`` has just served."""
        if cache._returned is not None and cache._queries is not None:
            self.queries.setdefault(cache.layer, []).append(cache._queries)
            if cache._via_rope:
                self.by_rope.add(cache.layer)
        cache._queries = None

    def clear(self) -> None:
        self.queries.clear()
        self.other.clear()
        self.by_rope.clear()


def _in_stored_space(queries, keys, stored):
    """``queries`` grouped by the KV head of the stored keys they attend, when the attention
    used the stored keys themselves or their heads repeated (``mx.repeat``: query head h reads
    KV head h // r) or tiled (``mx.tile``: KV head h % H, regrouped here); else None."""
    import mlx.core as mx

    if stored is None or queries.shape[-1] != stored.shape[-1]:
        return None
    if keys is stored:
        return queries
    if keys.ndim != 4 or keys.shape[2:] != stored.shape[2:] or keys.shape[1] % stored.shape[1]:
        return None
    heads, rep = stored.shape[1], keys.shape[1] // stored.shape[1]
    if rep == 1 and mx.array_equal(keys.astype(stored.dtype), stored).item():  # a copy (another dtype's, say)
        return queries
    if rep > 1 and mx.array_equal(keys[:, ::rep], stored).item():
        return queries
    if rep > 1 and mx.array_equal(keys[:, :heads], stored).item() and queries.shape[1] == keys.shape[1]:
        b, _, n, d = queries.shape
        return queries.reshape(b, rep, heads, n, d).transpose(0, 2, 1, 3, 4).reshape(b, rep * heads, n, d)
    return None


def _model_modules() -> list:
    return [m for name, m in list(sys.modules.items()) if name.startswith("mlx_lm.models.") and m is not None
            and callable(getattr(m, "scaled_dot_product_attention", None))]


def _rope_owners(model: Any) -> list:
    """The submodules of each layer with a ``rope`` module (the attention blocks)."""
    import mlx.nn as nn

    owners = []
    for block in model.layers:
        todo = [block] if isinstance(block, nn.Module) else []
        for depth in range(3):
            nxt = []
            for m in todo:
                if isinstance(m.get("rope", None), nn.Module) or callable(getattr(m, "rope", None)):
                    owners.append(m)
                    continue
                nxt += [v for v in m.values() if isinstance(v, nn.Module)]
            todo = nxt
    return owners


@contextmanager
def record_queries(model: Any, caches: Sequence[Any]) -> Iterator[QueryRecording]:
    """While the block runs, record the queries of every attention call that goes
    through one of ``caches``' :class:`ProbeCache` layers. Two ways in, both undone on
    exit: the ``scaled_dot_product_attention`` that mlx_lm's model modules call by name
    (rebound in each module that has it; the call names its cache), and, for a model
    that computes attention itself (``gemma2``), each attention block's ``rope``
    module, whose output that is not the keys a cache stores is the queries."""
    import mlx.nn as nn

    recording = QueryRecording()
    probe = [c for c in caches if isinstance(c, ProbeCache)]
    for c in probe:
        c.recording = recording

    def wrap_sdpa(original):
        def recording_sdpa(queries, keys, values, *args, **kwargs):
            cache = kwargs.get("cache", args[0] if args else None)
            if isinstance(cache, ProbeCache) and cache.recording is recording:
                recording.attended(cache, queries, keys)
            return original(queries, keys, values, *args, **kwargs)
        return recording_sdpa

    class RecordingRope(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x, *args, **kwargs):
            out = self.inner(x, *args, **kwargs)
            recording.rope_outputs.append(out)
            return out

    modules = _model_modules()
    originals = [(m, m.scaled_dot_product_attention) for m in modules]
    owners = _rope_owners(model)
    ropes = [(m, m.rope) for m in owners]
    try:
        for m, fn in originals:
            m.scaled_dot_product_attention = wrap_sdpa(fn)
        for m, rope in ropes:
            m.rope = RecordingRope(rope)
        yield recording
        for c in probe:
            recording.close(c)
    finally:
        for m, fn in originals:
            m.scaled_dot_product_attention = fn
        for m, rope in ropes:
            m.rope = rope
        for c in probe:
            c.recording = None


@contextmanager
def record_attention(model: Any, calls: list) -> Iterator[None]:
    """Record ``(queries, keys, scale)`` at every call of mlx_lm's
    ``scaled_dot_product_attention`` the model's modules make (the tuner's attention
    criterion, ``knorm-probe``). A model that computes attention itself records nothing."""
    def wrap(original):
        def recording(queries, keys, values, *args, **kwargs):
            calls.append((queries, keys, kwargs.get("scale", args[1] if len(args) > 1 else None)))
            return original(queries, keys, values, *args, **kwargs)
        return recording

    originals = [(m, m.scaled_dot_product_attention) for m in _model_modules()]
    try:
        for m, fn in originals:
            m.scaled_dot_product_attention = wrap(fn)
        yield
    finally:
        for m, fn in originals:
            m.scaled_dot_product_attention = fn


def model_context_length(model: Any) -> int | None:
    """The model's context length in tokens, or None if unknown."""
    info = getattr(model, "knorm_info", None)
    if isinstance(info, dict) and info.get("context_length"):
        return int(info["context_length"])
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    return int(value) if value else None
