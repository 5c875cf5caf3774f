"""What a loaded model supports, found once when it is first used, so a job fails at its
start with a message that names the architecture and the missing piece, not in the
middle of a run.

Three things are checked on the model itself, in a few tokens:

- **layers**: which of mlx_lm's caches the model makes per layer; eviction replaces only
  plain full-attention ``KVCache`` layers (sliding-window, state-space, chunked and
  multi-part caches stay as the model made them);
- **probe**: whether the question rule can read each full-attention layer's queries in the
  space of the keys that layer's cache stores (:func:`knorm_gen.eviction.rules.question.probe_queries`);
- **batching**: whether rows of different lengths decoded together give each row's own
  logits: the model's caches merge (mlx_lm's ``merge``) and every layer attends with the
  per-row mask of its own cache (:func:`knorm_gen.platform.mlx_compat.own_layer_masks`). Where they
  do not (``gemma2``'s five-dimensional attention scores, a cache kind mlx_lm cannot batch),
  every row runs alone, as it would at ``--batch-size 1``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..eviction.cache import make_eviction_cache
from ..eviction.config import EvictionConfig
from ..platform.mlx_compat import (
    UnsupportedModelError,
    architecture,
    decoder_layers,
    generator_step,
    is_full_attention,
    make_prompt_cache,
    own_layer_masks,
)


@dataclass(frozen=True)
class ModelSupport:
    """What eviction can do on one model (:func:`model_support`)."""

    architecture: str
    kinds: tuple[str, ...]  # mlx_lm's cache class of each layer
    full_layers: tuple[int, ...]  # the plain full-attention layers: the ones eviction may compress
    probe: Optional[str] = None  # None: the question rule can probe this model; else why not
    batching: Optional[str] = None  # None: rows decode together; else why each runs alone
    quantized: Optional[str] = None  # None: kv_bits works; else why not
    eviction: Optional[str] = None  # None: eviction caches stand in for the model's own; else why not

    @property
    def n_layers(self) -> int:
        return len(self.kinds)

    def check(self, eviction: Any) -> None:
        """Raise :class:`UnsupportedModelError` when the resolved layout ``eviction`` needs what
        this model lacks: a layer to compress, or (the question rule) a probe."""
        if (eviction.budget is not None or getattr(eviction, "kv_bits", None)) and self.eviction:
            raise UnsupportedModelError(f"{self.architecture}: {self.eviction}; run it with --budget none "
                                        f"(budget=None)")
        if eviction.budget is not None and not self.full_layers:
            raise UnsupportedModelError(
                f"{self.architecture}: no layer has a plain key/value cache (its caches: {self.describe_kinds()}), "
                f"so there is nothing eviction can bound; run it with --budget none (budget=None)")
        if eviction.budget is not None and self.probe and "question" in eviction.rules():
            raise UnsupportedModelError(f"{self.architecture}: {self.probe}")
        if getattr(eviction, "kv_bits", None) and self.quantized:
            raise UnsupportedModelError(f"{self.architecture}: kv_bits: {self.quantized}; leave kv_bits off")

    def describe_kinds(self) -> str:
        counts: dict[str, int] = {}
        for k in self.kinds:
            counts[k] = counts.get(k, 0) + 1
        return ", ".join(f"{k} x{n}" for k, n in counts.items())


def model_support(model: Any) -> ModelSupport:
    """What eviction can do on ``model``, found on its first use (a few tokens through it)
    and kept on the model object for its life. A model loaded by :func:`~knorm_gen.models.load.load_model`
    is examined once per machine: the finding is saved under the cache root, named by the model's
    content fingerprint and this package's code, and read back by later processes."""
    found = getattr(model, "_knorm_support", None)
    if not isinstance(found, ModelSupport):
        saved = _saved_path(model)
        found = _read_saved(saved) if saved else None
        if found is None:
            found = _examine(model)
            if saved:
                _save(saved, found)
        try:
            object.__setattr__(model, "_knorm_support", found)
        except (AttributeError, TypeError):  # an object that takes no attributes: examined at each use
            pass
    return found


@functools.cache
def _code_digest() -> str:
    """A digest of this package's source and the mlx and mlx_lm versions (once per process): a
    saved finding is read back only by the code that made it."""
    import hashlib
    from importlib.metadata import version
    from pathlib import Path

    digest = hashlib.sha256(f"mlx {version('mlx')} mlx_lm {version('mlx_lm')}".encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _saved_path(model: Any) -> Optional[Any]:
    """Where the finding for ``model`` is saved; None for a model built in memory (no
    ``knorm_info``: tests' random models, a caller's own), which is examined in each process."""
    if not isinstance(getattr(model, "knorm_info", None), dict):
        return None
    from ..platform.runtime import cache_root
    from .load import model_fingerprint

    return cache_root() / "support" / f"{model_fingerprint(model)}-{_code_digest()}.json"


def _read_saved(path: Any) -> Optional[ModelSupport]:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ModelSupport(**{**data, "kinds": tuple(data["kinds"]), "full_layers": tuple(data["full_layers"])})
    except (OSError, ValueError, TypeError, KeyError):  # none saved, or unreadable: examine again
        return None


def _save(path: Any, found: ModelSupport) -> None:
    import dataclasses
    import json

    from ..platform.files import rewrite_atomically

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        rewrite_atomically(path, [json.dumps(dataclasses.asdict(found)).encode()])
    except OSError:  # a read-only or full cache folder: the next process examines again
        pass


def _examine(model: Any) -> ModelSupport:
    name = architecture(model)
    caches = make_prompt_cache(model)
    kinds = tuple(type(c).__name__ for c in caches)
    full = tuple(i for i, c in enumerate(caches) if is_full_attention(c))
    if not full:
        return ModelSupport(name, kinds, full, batching=_batching_problem(model))
    problem = _cache_problem(model)
    if problem:
        return ModelSupport(name, kinds, full, eviction=problem)
    return ModelSupport(name, kinds, full, _probe_problem(model), _batching_problem(model), _quantized_problem(model))


def _cache_problem(model: Any) -> Optional[str]:
    """Why eviction caches cannot stand in for this model's own (None: they can): a prompt and
    one decode step through eviction caches that keep every token give the model's own logits."""
    ids = _IDS[:10]
    config = EvictionConfig(budget=64, keep="low").for_model(model)
    own, ours = make_prompt_cache(model), make_eviction_cache(model, config)
    try:
        logits = []
        for caches in (own, ours):
            model(mx.array(ids[:-1])[None], cache=caches)
            logits.append(np.array(model(mx.array([ids[-1:]]), cache=caches)[0, -1].astype(mx.float32)))
    except Exception as e:  # noqa: BLE001 - any failure here means the model needs its own caches
        return f"its layers use their caches beyond mlx_lm's cache protocol ({type(e).__name__}: {str(e)[:120]})"
    worst = _relative_difference(logits[0], logits[1])
    if not worst <= 1e-4:
        return f"eviction caches that keep every token gave other logits than its own (relative {worst:.1e})"
    return None


_IDS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def _probe_problem(model: Any) -> Optional[str]:
    from ..eviction.rules.question import probe_queries

    try:
        probe_queries(model, _IDS, 2, 9, [3, 4])
    except UnsupportedModelError as e:
        return str(e).split(": ", 1)[-1]
    except Exception as e:  # noqa: BLE001 - a model whose layers need more of their caches than a probe gives
        return (f"the question probe cannot run it ({type(e).__name__}: {str(e)[:120]}); choose a layout that "
                f"needs no probe, e.g. --preset intrinsic")
    return None


def _quantized_problem(model: Any) -> Optional[str]:
    """Why the kept keys and values cannot be stored quantized (None: they can): mlx_lm's
    attention reads them quantized only through its ``scaled_dot_product_attention`` with
    the keys and values the cache stores (:data:`~knorm_gen.platform.mlx_compat.QUANTIZED_ATTENTION`)."""
    from ..eviction.rules.question import attention_paths

    try:
        by_rope, other = attention_paths(model)
    except Exception as e:  # noqa: BLE001 - a model whose attention cannot be read at all
        return f"its attention could not be read ({type(e).__name__})"
    if by_rope:
        return "the model computes attention itself, not through mlx_lm's scaled_dot_product_attention"
    if other:
        return "its attention layers store a latent the attention is computed from (multi-head latent attention)"
    return None


def _batching_problem(model: Any) -> Optional[str]:
    """Why rows of different lengths cannot decode together on this model (None: they can):
    three rows through mlx_lm's ``BatchGenerator`` as the engine runs them, fresh (prefilled
    together, right-padded) and prefilled alone first (decoded together), the first step's
    log-probabilities compared with the same row's alone, from the model called directly."""
    try:
        decoder_layers(model)
    except UnsupportedModelError as e:
        return str(e).split(": ", 1)[-1]
    # Recency, so no near-tie of scores can part a row from itself alone; the first compressed layer
    # holds fewer tokens than the others, so each layer needs a mask of its own.
    full = [i for i, c in enumerate(make_prompt_cache(model)) if is_full_attention(c)]
    config = EvictionConfig(budget=6, keep="recent", recent=0, n_sink=1,
                            layer_budgets={full[0]: 4} if full else None).for_model(model)
    rows = [_IDS[:9], _IDS[:4], _IDS[:7]]
    worst = 0.0
    for layout in (config, EvictionConfig(budget=None).for_model(model)):  # eviction, and the model's own caches
        alone = [_first_step_alone(model, layout, ids) for ids in rows]
        for history in (False, True):
            try:
                together = _first_step_together(model, layout, rows, history)
            except Exception as e:  # noqa: BLE001 - any failure here means the rows must run alone
                return f"rows decoded together failed ({type(e).__name__}: {str(e)[:160]})"
            for a, t in zip(alone, together):
                worst = max(worst, _relative_difference(a, t))
    if not worst <= 1e-3:
        return f"rows decoded together gave other log-probabilities than each row alone (relative {worst:.1e})"
    return None


def _first_step_alone(model: Any, config: Any, ids: list) -> np.ndarray:
    """The first step's log-probabilities of one row alone, as mlx_lm's ``generate_step``
    computes them: all but the last token prefilled, then the last one."""
    caches = make_eviction_cache(model, config)
    model(mx.array(ids[:-1])[None], cache=caches)
    logits = model(mx.array([ids[-1:]]), cache=caches)[0, -1].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, keepdims=True))


def _first_step_together(model: Any, config: Any, rows: list, history: bool) -> list:
    """The first step's log-probabilities of each row, the rows decoded together."""
    from mlx_lm.generate import BatchGenerator

    caches = [make_eviction_cache(model, config) for _ in rows]
    prompts = [list(ids) for ids in rows]
    if history:
        for c, ids in zip(caches, rows):
            model(mx.array(ids[:-1])[None], cache=c)
        prompts = [ids[-1:] for ids in rows]
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(rows), prefill_batch_size=len(rows))
    try:
        uids = gen.insert(prompts, max_tokens=[1] * len(rows), caches=caches)
        out: dict = {}
        with own_layer_masks(model):
            while len(out) < len(uids):
                _, decoded, _ = generator_step(gen)
                for d in decoded:
                    out.setdefault(d.uid, np.array(d.logprobs.astype(mx.float32)))
    finally:
        gen.close()
    return [out[uid] for uid in uids]


def _relative_difference(want: np.ndarray, got: np.ndarray) -> float:
    """The largest difference over the largest magnitude, over the finite logits (some models set
    tokens they never emit to -inf); inf where the two differ in which are finite."""
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return float("inf")
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(want[finite] - got[finite]))) / max(float(np.max(np.abs(want[finite]))), 1e-6)


def support_row(support: ModelSupport) -> dict:
    """The row of docs/models.md's support table for one architecture (what the
    architecture contract test checks it against)."""
    full = len(support.full_layers)
    kinds = support.describe_kinds()
    if support.eviction or not full:
        outcome = f"refused: {support.eviction or 'no layer has a plain key/value cache'}"
    else:
        outcome = "evicts"
    others = [k for k in support.kinds if k != "KVCache"]
    return {
        "architecture": support.architecture,
        "outcome": outcome,
        "compressed layers": f"{full} of {support.n_layers}" + (f" ({kinds})" if others else ""),
        "sliding-window layers": "kept whole" if "RotatingKVCache" in support.kinds else "none",
        "question rule": "yes" if full and not support.probe and not support.eviction else
                         (f"no: {support.probe}" if support.probe else "-"),
        "rows together": "yes" if not support.batching else f"no, one at a time: {support.batching}",
        "quantized KV": "-" if not full or support.eviction else
                        ("yes" if not support.quantized else f"no: {support.quantized}"),
    }


def describe_model(model: Any, spec: str) -> str:
    """The line a run starts with: the model, its architecture and context, what eviction
    compresses of it, and what it cannot do."""
    from ..platform.mlx_compat import model_context_length

    support = model_support(model)
    ctx = model_context_length(model)
    parts = [f"model {spec}: {support.architecture}, context "
             + (f"{ctx:,} tokens" if ctx else "unknown (no max_position_embeddings)"),
             f"{len(support.full_layers)} of {support.n_layers} layers compressible"
             + (f" (the others: {support.describe_kinds()})" if len(support.full_layers) < support.n_layers else "")]
    if support.batching:
        parts.append(f"rows run one at a time ({support.batching})")
    if support.probe:
        parts.append(f"no question rule ({support.probe})")
    return "; ".join(parts)


def check_model(model: Any, eviction: Any) -> ModelSupport:
    """:func:`model_support`, having checked that the resolved layout ``eviction`` can run on it."""
    support = model_support(model)
    support.check(eviction)
    return support


__all__ = ["ModelSupport", "UnsupportedModelError", "check_model", "describe_model", "model_support", "support_row"]
