"""The settings every surface shares: how layers evict, and how text is generated.

``EvictionConfig`` and ``GenerationConfig`` are the single source of truth:
the Python functions take them (or their fields as keywords), ``knorm-batch``
derives its options and job-file keys from their fields, and each validates
itself on construction, so a bad value is refused the same way everywhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping, Optional, Sequence

from .scores import SCORES

KEEP_MODES = tuple(SCORES)
"""Ranking rules, one per entry of :data:`knorm_gen.scores.SCORES`. ``low`` is the
paper's; ``high`` its ablation; ``random`` and ``recent`` (StreamingLLM: sinks +
most recent) are baselines."""

EARLY_FRACTION = 0.3
"""The share of leading layers the default leaves uncompressed. On the embedded
model, compressing layers 2-8 broke passkey retrieval at every length we measured,
and leaving layers 0-8 (30% of 30) uncompressed restored it (README, Results)."""

DEFAULT_PREFILL_STEP = 512
DEFAULT_QUESTION_SEPARATOR = "\n\n"
SEED_LIMIT = 2**64  # mx.random.seed takes an unsigned 64-bit integer


def early_layers(n_layers: int, full_layers: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The first 30% (at least two, as the paper leaves uncompressed) of the layers
    eviction can compress: the full-attention ones when ``full_layers`` is given
    (on Gemma 3, global layers 5 and 11 of 5, 11, 17), else all ``n_layers``."""
    layers = list(range(n_layers)) if full_layers is None else sorted(full_layers)
    return tuple(layers[: min(len(layers), max(2, round(EARLY_FRACTION * len(layers))))])


def full_attention_layers(model: Any) -> list[int]:
    """The layers whose mlx_lm cache is a plain ``KVCache``: the only ones eviction
    replaces (sliding-window and SSM caches stay as the model made them)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return [i for i, c in enumerate(make_prompt_cache(model)) if type(c) is KVCache]


default_skip_layers = early_layers  # what skip_layers=None means


def auto_recent(budget: int) -> int:
    """The default recent window: budget // 8. Our perplexity benchmark showed
    keep-low without one losing far more than with it (README, Results)."""
    return budget // 8


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_eviction_args(budget: Any, n_sink: Any, recent: Any, keep: Any) -> None:
    """Raise ValueError naming the field when an eviction setting is invalid."""
    for name, value in (("budget", budget), ("n_sink", n_sink), ("recent", recent)):
        if not _is_int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if n_sink < 0:
        raise ValueError(f"n_sink must be >= 0, got {n_sink}")
    if recent < 0:
        raise ValueError(f"recent must be >= 0, got {recent}")
    if n_sink + recent >= budget:
        raise ValueError(
            f"n_sink + recent must be < budget (got n_sink={n_sink}, recent={recent}, "
            f"budget={budget}): nothing would be left to choose by key norm"
        )
    if keep not in KEEP_MODES:
        raise ValueError(f"keep must be one of {', '.join(KEEP_MODES)}; got {keep!r}")


def _layer_index(i: Any, what: str) -> int:
    if not _is_int(i):
        raise ValueError(f"{what} must hold layer indices (integers), got {i!r}")
    return i


@dataclass(frozen=True)
class EvictionConfig:
    """How every compressed layer evicts. ``budget=None`` means no eviction;
    ``recent=None`` means :func:`auto_recent` (``budget // 8``, per layer).
    ``skip_layers`` are left uncompressed (their memory grows with the input);
    ``None`` means :func:`default_skip_layers`: the first 30% (at least two) of the
    full-attention layers, counted by :meth:`for_model` (all layers by :meth:`resolved` alone).
    ``layer_budgets`` (``{layer: budget}``) overrides the budget of single layers.

    ``early_factor=N`` bounds every layer instead: nothing is skipped and the
    first 30% of the full-attention layers hold ``N * budget`` tokens (with 8, memory at budget 512
    stops growing past 4096 tokens; README, Results). It replaces
    ``skip_layers`` and ``layer_budgets``, so it cannot be combined with them."""

    budget: Optional[int] = 512
    n_sink: int = 4
    recent: Optional[int] = None
    keep: str = "low"
    skip_layers: Optional[tuple[int, ...]] = None
    layer_budgets: Optional[Mapping[int, int]] = None
    early_factor: Optional[int] = None
    recent_auto: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.skip_layers is not None:
            if isinstance(self.skip_layers, (str, bytes)) or not hasattr(self.skip_layers, "__iter__"):
                raise ValueError(f"skip_layers must be a list of layer indices, got {self.skip_layers!r}")
            object.__setattr__(self, "skip_layers",
                               tuple(_layer_index(i, "skip_layers") for i in self.skip_layers))
        object.__setattr__(self, "recent_auto", self.recent is None)
        if self.recent is None:
            object.__setattr__(self, "recent", auto_recent(self.budget) if _is_int(self.budget) else 0)
        if self.budget is not None:
            validate_eviction_args(self.budget, self.n_sink, self.recent, self.keep)
        elif self.keep not in KEEP_MODES:
            raise ValueError(f"keep must be one of {', '.join(KEEP_MODES)}; got {self.keep!r}")
        if self.layer_budgets is not None:
            if not isinstance(self.layer_budgets, Mapping):
                raise ValueError(f"layer_budgets must map layer index to budget, got {self.layer_budgets!r}")
            budgets = {_layer_index(k, "layer_budgets"): v for k, v in self.layer_budgets.items()}
            for layer, b in budgets.items():
                try:
                    validate_eviction_args(b, self.n_sink, self.layer_recent(b), self.keep)
                except ValueError as e:
                    raise ValueError(f"layer_budgets[{layer}]: {e}") from None
            object.__setattr__(self, "layer_budgets", budgets or None)
        if self.early_factor is not None:
            if not _is_int(self.early_factor) or self.early_factor < 1:
                raise ValueError(f"early_factor must be an integer >= 1, got {self.early_factor!r}")
            if self.skip_layers is not None or self.layer_budgets is not None:
                raise ValueError("early_factor sets the layer layout itself: leave skip_layers and layer_budgets "
                                 "unset, or drop early_factor")

    def layer_recent(self, budget: int) -> int:
        """The recent window of a layer holding ``budget`` tokens."""
        return auto_recent(budget) if self.recent_auto else self.recent

    def for_model(self, model: Any) -> "EvictionConfig":
        """:meth:`resolved` for ``model``, its default layers counted among its
        full-attention layers."""
        return self.resolved(len(model.layers), full_attention_layers(model))

    def resolved(self, n_layers: int, full_layers: Optional[Sequence[int]] = None) -> "EvictionConfig":
        """This config with its layer layout made explicit for a model of ``n_layers``
        (``skip_layers``, and ``layer_budgets`` for ``early_factor``), checked against
        it (a ValueError names an index out of range)."""
        config = self
        recent = None if self.recent_auto else self.recent
        if self.early_factor is not None:
            early = ({} if self.budget is None
                     else {i: self.early_factor * self.budget for i in early_layers(n_layers, full_layers)})
            config = replace(self, skip_layers=(), layer_budgets=early or None, early_factor=None, recent=recent)
        elif self.skip_layers is None:
            config = replace(self, skip_layers=default_skip_layers(n_layers, full_layers), recent=recent)
        for what, layers in (("skip_layers", config.skip_layers), ("layer_budgets", config.layer_budgets or {})):
            for i in layers:
                if not -n_layers <= i < n_layers:
                    raise ValueError(f"{what} index {i} is out of range for a model with {n_layers} layers "
                                     f"(0 to {n_layers - 1})")
        return config

    def to_dict(self) -> dict:
        """JSON-ready: ``skip_layers`` as a list (or None); ``layer_budgets`` and
        ``early_factor`` only when set."""
        d = asdict(self)
        d.pop("recent_auto")
        d["skip_layers"] = None if self.skip_layers is None else list(self.skip_layers)
        if self.early_factor is None:  # records made before the field existed keep their fingerprints
            d.pop("early_factor")
        if self.layer_budgets is None:
            d.pop("layer_budgets")
        else:
            d["layer_budgets"] = {str(k): v for k, v in sorted(self.layer_budgets.items())}
        return d

    def __hash__(self) -> int:
        return hash((self.budget, self.n_sink, self.recent, self.keep, self.skip_layers,
                     tuple(sorted((self.layer_budgets or {}).items())), self.early_factor))


@dataclass(frozen=True)
class GenerationConfig:
    """How text is generated. ``chat=None`` applies the chat template to text
    when the tokenizer has one; ``question_separator`` goes between a context
    and each question in :func:`~knorm_gen.answer_questions`."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    chat: Optional[bool] = None
    question_separator: str = DEFAULT_QUESTION_SEPARATOR

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        if not _is_int(self.prefill_step_size) or self.prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be an integer >= 1, got {self.prefill_step_size!r}")
        if self.chat is not None and not isinstance(self.chat, bool):
            raise ValueError(f"chat must be true, false or null (automatic), got {self.chat!r}")
        if not isinstance(self.question_separator, str):
            raise ValueError(f"question_separator must be text, got {self.question_separator!r}")

    def to_dict(self) -> dict:
        return asdict(self)


EVICTION_FIELDS = tuple(f.name for f in fields(EvictionConfig) if f.init)
GENERATION_FIELDS = tuple(f.name for f in fields(GenerationConfig))


def make_configs(eviction: Optional[EvictionConfig] = None, generation: Optional[GenerationConfig] = None,
                 **settings: Any) -> tuple[EvictionConfig, GenerationConfig]:
    """``(eviction, generation)`` from optional configs plus keyword fields of
    either (``budget=64, max_tokens=48``), which override the configs' values.
    An unknown keyword is a TypeError that lists the allowed ones."""
    unknown = set(settings) - set(EVICTION_FIELDS) - set(GENERATION_FIELDS)
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(sorted(unknown))}; allowed: "
                        f"{', '.join(EVICTION_FIELDS + GENERATION_FIELDS)}")
    eviction = eviction or EvictionConfig()
    generation = generation or GenerationConfig()
    ev = {k: v for k, v in settings.items() if k in EVICTION_FIELDS}
    if ev:
        base = {name: getattr(eviction, name) for name in EVICTION_FIELDS}
        if eviction.recent_auto and "recent" not in ev:
            base["recent"] = None  # a new budget gets its own automatic window
        eviction = EvictionConfig(**{**base, **ev})
    gen = {k: v for k, v in settings.items() if k in GENERATION_FIELDS}
    if gen:
        generation = replace(generation, **gen)
    return eviction, generation
