"""The settings every surface shares: how layers evict, and how text is generated.

``EvictionConfig`` and ``GenerationConfig`` are the single source of truth:
the Python functions take them (or their fields as keywords), ``knorm-batch``
generates its options and job-file keys from their fields (name, default and
help text live in each field's metadata), and each validates itself on
construction, so a bad value is refused the same way everywhere.

:func:`make_configs` is the only builder. :meth:`EvictionConfig.resolved` makes
a config explicit for one model's layers (:class:`ResolvedEviction`); the caches
take that form as it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from .quant import KV_GROUP_SIZES, check_head_dims, check_kv_quantization
from .rules import KEEP_MODES, RULES, Rule, make_rule, setting_fields
from .rules.variants import with_variants
from .spans import Spans, span_positions

EARLY_FRACTION = 0.3
"""The share of leading layers ``skip_layers=None`` (``--preset retrieval``) leaves
uncompressed. On the embedded model, compressing layers 2-8 with keep-low broke passkey
retrieval at every length measured, and leaving layers 0-8 (30% of 30) uncompressed
restored it (docs/history.md)."""

SEED_LIMIT = 2**64  # mx.random.seed takes an unsigned 64-bit integer


def early_layers(n_layers: int, full_layers: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The first 30% (at least two, as the paper leaves uncompressed) of the layers
    eviction can compress: the full-attention ones when ``full_layers`` is given
    (on Gemma 3, global layers 5 and 11 of 5, 11, 17), else all ``n_layers``.
    This is what ``skip_layers=None`` means."""
    layers = list(range(n_layers)) if full_layers is None else sorted(full_layers)
    return tuple(layers[: min(len(layers), max(2, round(EARLY_FRACTION * len(layers))))])


RECENT_SHARE = 0.25
"""The default ``recent_share``: a quarter of each budget holds the most recent tokens,
beside the question rule. Of the three splits measured for that rule (a quarter, an
eighth, a half), the quarter kept random eviction's summary fidelity on both models held
out, where the eighth fell short on Gemma 3 and the half found fewer keys (docs/history.md).
The intrinsic layouts keep the half (``--preset intrinsic``)."""
DEFAULT_STRATIFY = 0.7
"""``stratify`` where it is not given and the rule is the question rule (given by name): seven tenths of
each layer's rule slots given out over stretches of the document (docs/history.md says how it was chosen),
or less where ``carry`` and ``spread`` leave less (:data:`STRATIFY_LEAVES` stays with the rule's scores)."""
STRATIFY_LEAVES = 0.05
"""The share of a question-rule layer's slots an unset ``stratify`` leaves to the rule's own scores."""
OLD_RECENT_SHARE = 0.125
"""A recent window of ``budget // 8``: the paper, retrieval, summarize and question presets
keep it, and a saved tuning or record without ``recent_share`` means it."""


def auto_recent(budget: int, share: float = OLD_RECENT_SHARE, n_sink: int = 0) -> int:
    """The recent window a ``budget`` gets from ``recent_share``: ``int(share * budget)``,
    leaving at least one slot to the rule beside ``n_sink`` so a small budget stays valid.
    Keep-low without a window lost far more perplexity than with one (docs/history.md)."""
    return max(0, min(int(share * budget), budget - n_sink - 1))


def check_rule(rule: Any, field: str = "keep", auto: bool = False) -> str:
    """``rule`` as a rule name of :data:`KEEP_MODES` (or ``"auto"`` where ``auto``), or
    ValueError naming ``field``."""
    if rule not in (("auto",) if auto else ()) + KEEP_MODES:
        hint = RULE_HINTS.get(str(rule).strip().lower().replace("-", "").replace("_", "")) if isinstance(rule, str) else None
        raise ValueError(f"{field} must be {'auto or ' if auto else ''}one of {', '.join(KEEP_MODES)}; got {rule!r}"
                         + (f": {hint}" if hint else ""))
    return rule


RULE_HINTS = {name: "the L2Norm rule (arXiv:2406.11430) is 'low': keep the lowest key norms (--preset paper is the "
                    "paper's whole layout, layers 0 and 1 kept whole)"
              for name in ("l2norm", "l2", "norm", "knorm", "keynorm", "lownorm", "paper")}
"""Names a reader of the paper may try for a rule, and what to give instead."""


def check_recent_share(share: Any) -> float:
    """``recent_share`` as a float in [0, 1), or ValueError."""
    return _check_share(share, "recent_share", 0.5)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


LONG_DOCUMENTS = ("error", "truncate", "chunk")
"""What a document longer than the model's context becomes (``long_documents``; :mod:`knorm_gen.generation.long_documents`)."""

MIN_TEMPERATURE = 2.0**-126
"""The smallest positive temperature accepted (the smallest normal float32):
below about 3e-39 the sampler's ``1 / temperature`` is inf in float32."""


def _finite_float(value: Any) -> bool:
    """Whether a number converts to a finite float (an integer of 400 digits does not)."""
    try:
        return math.isfinite(float(value))
    except (OverflowError, ValueError, TypeError):
        return False


def validate_eviction_args(budget: Any, n_sink: Any, recent: Any, keep: Any, coverage: Any = 0.0) -> None:
    """Raise ValueError naming the field when an eviction setting is invalid."""
    check_coverage(coverage)
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
            f"n_sink + recent must be < budget (got n_sink={n_sink}, recent={recent}, budget={budget}): nothing "
            f"would be left for the rule to choose; raise --budget or lower --recent / --n-sink")
    check_rule(keep)


def check_coverage(coverage: Any) -> float:
    """``coverage`` as a float in [0, 1), or ValueError."""
    return _check_share(coverage, "coverage", 0.25)


def _check_share(value: Any, name: str, example: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a share from 0 to below 1 (e.g. {example}), got {value!r}")
    return float(value)


def _layer_index(i: Any, what: str) -> int:
    if not _is_int(i):
        raise ValueError(f"{what} must hold layer indices (integers), got {i!r}")
    return i


# ---- text forms of the structured fields (command line and job files) ---------


def parse_budget(value: Any) -> Optional[int]:
    """``none``/``full`` (or None) = full cache, else an integer >= 1."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "full")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}")
    try:
        budget = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}") from None
    if budget < 1 or (isinstance(value, float) and value != budget):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}")
    return budget


def parse_ratio(value: Any) -> Optional[float]:
    """``none`` (or None) = no ratio, else a number >= 1: keep 1/R of each document."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"ratio must be a number >= 1 or 'none', got {value!r}")
    try:
        ratio = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"ratio must be a number >= 1 (keep 1/ratio of each document) or 'none', got {value!r}") \
            from None
    if not math.isfinite(ratio) or ratio < 1:
        raise ValueError(f"ratio must be a number >= 1 (keep 1/ratio of each document) or 'none', got {value!r}")
    return ratio


class LayerPlan(NamedTuple):
    """What a compressed layer keeps: ``budget`` tokens, the last ``recent`` of them always.
    Both None in a layout whose budget follows the document (``ratio``) until the document
    is known (:meth:`ResolvedEviction.for_document`, :meth:`ResolvedEviction.for_row`)."""

    budget: Optional[int]
    recent: Optional[int]


MIN_RATIO_BUDGET = 16
"""The fewest tokens a layer keeps of a document under ``ratio`` (a short document is kept whole below it)."""


def ratio_budget(doc_tokens: int, ratio: float, cap: Optional[int] = None, reserved: int = 0) -> int:
    """A layer's budget for a document of ``doc_tokens`` under ``ratio``: its tokens / ratio
    (rounded up), plus the ``reserved`` slots the budget holds that are not the document's
    (sinks in the template), at least :data:`MIN_RATIO_BUDGET`, at most ``cap``."""
    budget = max(MIN_RATIO_BUDGET, math.ceil(doc_tokens / ratio) + reserved)
    return budget if cap is None else min(budget, cap)


def row_budget(ratio: float, cap: Optional[int], n_sink: int, spans: Spans, n_ids: int) -> int:
    """What one row keeps under ``ratio``: each compressed layer's budget for the document
    that ``spans`` mark in a prompt of ``n_ids`` tokens. 1/ratio of the document's positions
    (rounded up), plus the sinks that lie outside the document (pinned, yet held in the
    budget's slots), at least :data:`MIN_RATIO_BUDGET`, at most ``cap``. The one place a
    row's budget is worked out: generation, admission, memory estimates, records and the
    measuring harness (:mod:`knorm_gen.tuning.evaluate`) all come here."""
    sinks = min(n_sink, n_ids)
    return ratio_budget(span_positions(spans, n_ids), ratio, cap, reserved=sinks - span_positions(spans, sinks))


def _layer_list(text: str, what: str) -> list[int]:
    """``0,1`` or ``0-8`` (inclusive ranges) to a list of layer indices."""
    message = f"{what} must be layer indices like '0,1' or '0-8'; got {text!r}"
    items: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        if dash and lo.strip().isdigit() and hi.strip().isdigit():
            if int(hi) < int(lo):
                raise ValueError(f"{what}: the range {part!r} is empty; write it low-high, e.g. "
                                 f"'{hi.strip()}-{lo.strip()}'")
            items.extend(range(int(lo), int(hi) + 1))
        else:
            try:
                items.append(int(part))
            except ValueError:
                raise ValueError(message) from None
    return items


def parse_skip_layers(value: Any) -> Optional[tuple[int, ...]]:
    """``0,1``, ``0-8`` (a range, inclusive) or a list of integers; ``none`` or
    empty = compress every layer; None = the default layers."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if any(isinstance(i, bool) or not isinstance(i, int) for i in value):
            raise ValueError(f"skip_layers must be layer indices like '0,1' or '0-8', or 'none'; got {value!r}")
        return tuple(value)
    if not isinstance(value, str):
        raise ValueError(f"skip_layers must be a comma-separated list of layer indices or 'none', got {value!r}")
    if value.strip().lower() in ("none", ""):
        return ()
    return tuple(_layer_list(value, "skip_layers"))


def parse_layer_budgets(value: Any) -> Optional[dict[int, int]]:
    """``2-8:512,20:128`` (layers:budget) or a table ``{"2": 512}``; ``none`` = no overrides."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    out: dict[int, int] = {}
    if isinstance(value, dict):
        for layer, budget in value.items():
            try:
                out[int(layer)] = budget
            except (TypeError, ValueError):
                raise ValueError(f"layer_budgets keys must be layer indices, got {layer!r}") from None
        return out
    if not isinstance(value, str):
        raise ValueError(f"layer_budgets must look like '2-8:512,20:128', got {value!r}")
    for part in _budget_parts(value):
        layers, colon, budget = part.rpartition(":")
        if not colon or not budget.strip().isdigit():
            raise ValueError(f"layer_budgets must look like '2-8:512,20:128' (layers:budget), got {value!r}")
        for layer in _layer_list(layers, "layer_budgets"):
            out[layer] = int(budget)
    return out


def parse_layer_keep(value: Any) -> Optional[dict[int, str]]:
    """``0-5:low,20:leverage`` (layers:rule) or a table ``{"0": "low"}``; ``none`` = ``keep`` in every layer."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    if isinstance(value, Mapping):  # a job file's or a saved tuning's table: keys may be strings
        return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else _layer_index(k, "layer_keep"): v
                for k, v in value.items()}
    if not isinstance(value, str):
        raise ValueError(f"layer_keep must look like '0-5:low,20:leverage', got {value!r}")
    out: dict[int, str] = {}
    for part in _budget_parts(value):
        layers, colon, rule = part.rpartition(":")
        if not colon or rule.strip() not in KEEP_MODES:
            raise ValueError(f"layer_keep must look like '0-5:low,20:leverage' (layers:rule, a rule of "
                             f"{', '.join(KEEP_MODES)}), got {value!r}")
        for layer in _layer_list(layers, "layer_keep"):
            out[layer] = rule.strip()
    return out


def _budget_parts(value: str) -> list[str]:
    # "2-8:512,20:128": a comma starts a new part only after a ":budget".
    parts, current = [], ""
    for piece in value.split(","):
        current = f"{current},{piece}" if current else piece
        if ":" in piece:
            parts.append(current.strip())
            current = ""
    if current:
        parts.append(current.strip())
    return parts


def parse_kv_bits(value: Any) -> Optional[int]:
    """``4``, ``8`` or ``none`` (full precision)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    try:
        bits = int(value)
    except (TypeError, ValueError):
        bits = value
    check_kv_quantization(bits, KV_GROUP_SIZES[1])
    return bits


def parse_kv_group_size(value: Any) -> int:
    """``32``, ``64`` or ``128``."""
    try:
        group = int(value)
    except (TypeError, ValueError):
        group = value
    check_kv_quantization(None, group)
    return group


def _setting(default: Any, help: str, *, parse=None, metavar: Optional[str] = None, choices=None,
             default_text: Optional[str] = None, multiple: bool = False, cli_name: Optional[str] = None):
    """A config field with what the command line and job files need to know about it:
    its help text, an optional text parser (``"0-8"`` -> a tuple), metavar, choices,
    how to show a default that is computed (``budget // 8``), and for a list field
    the repeatable option's name (``--question`` for ``questions``)."""
    meta = {"help": help, "parse": parse, "metavar": metavar, "choices": choices, "default_text": default_text,
            "multiple": multiple, "cli_name": cli_name}
    return field(default=default, metadata=meta)


# ---- eviction ------------------------------------------------------------------


class _Unset:
    """The default of ``budget`` and ``ratio`` before :class:`EvictionConfig` settles them:
    neither given means :data:`DEFAULT_RATIO`; a budget given alone is a fixed budget."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()

DEFAULT_RATIO = 4.0
# A cache class built by hand without a budget keeps this many tokens per layer: it sees no
# document before its first block, so it cannot follow a ratio. Configs follow DEFAULT_RATIO.
CACHE_BUDGET = 512
"""The compression when neither ``budget`` nor ``ratio`` is given: a quarter of each
document kept (chosen by the rule in docs/history.md, measured in docs/results.md)."""


def _with_rule_settings(cls: type) -> type:
    """A config field per rule setting (each rule's dataclass fields, :mod:`.rules`): a rule's
    settings reach the options, job files, records and fingerprints with no line here."""
    for key, (_, f) in setting_fields().items():
        cls.__annotations__[key] = f.type
        setattr(cls, key, _setting(f.default, f.metadata["help"], choices=f.metadata["choices"],
                                   metavar=f.metadata["metavar"]))
    return cls


@dataclass(frozen=True)
@_with_rule_settings
class EvictionConfig:
    """How every compressed layer evicts, as the user states it. ``budget=None``
    means no eviction; ``recent=None`` means :func:`auto_recent` (``recent_share`` of
    each layer's budget).

    The default bounds every full-attention layer (``skip_layers=()``) and keeps, per
    layer and KV head, the document keys the job's instructions would attend to
    (``keep="question"``: the instructions after the document are probed before it is
    read, :mod:`knorm_gen.eviction.rules.question`; ``question_score="mean"``), with a quarter of
    each later layer's rule slots carried from what the layers before it scored best
    (``carry=0.25``, :mod:`knorm_gen.eviction.carry`), seven tenths of them given out over stretches
    of the document, each stretch its share by length, to what the rule ranks best there
    (``stratify=0.7``, :class:`~knorm_gen.eviction.rules.variants.Stratify`), and a quarter of each
    budget holding the most recent tokens (``recent_share=0.25``). docs/results.md measures it; docs/history.md
    says how it was chosen. A cache that is never probed (a plain mlx_lm loop without
    :func:`~knorm_gen.eviction.cache.probe_caches`) ranks by the key norm and warns.

    ``skip_layers`` are left uncompressed (their memory grows with the input); ``None``
    means :func:`early_layers`: the first 30% (at least two) of the full-attention
    layers (``--preset retrieval``). ``layer_budgets`` (``{layer: budget}``) overrides
    the budget of single layers.

    ``early_factor=N`` bounds every layer instead: nothing is skipped and the first 30%
    of the full-attention layers hold ``N * budget`` tokens. It replaces ``skip_layers``
    and ``layer_budgets``, so it cannot be combined with them.

    :meth:`resolved` / :meth:`for_model` give the explicit per-layer form."""

    budget: Optional[int] = _setting(
        UNSET, "Tokens kept per compressed layer: given alone, a fixed budget; with --ratio, a cap on it; "
        "'none' = no cap (alone: the full cache, nothing evicted).", parse=parse_budget, metavar="INT|none",
        default_text="none: the document's tokens over --ratio")
    ratio: Optional[float] = _setting(
        UNSET, "Keep 1/R of each document's tokens per compressed layer: a budget that follows the document "
        "(with --budget, that budget caps it). 'none' = no ratio (a fixed --budget, or the full cache without "
        "one).", parse=parse_ratio, metavar="R|none",
        default_text=f"{DEFAULT_RATIO:g} when no --budget is given, else none")
    n_sink: int = _setting(4, "Leading tokens never evicted.")
    recent: Optional[int] = _setting(None, "Most recent tokens never evicted (overrides --recent-share).",
                                     default_text="--recent-share x budget")
    keep: str = _setting("question", "The rule that ranks a layer's document keys, keeping: "
                         + "; ".join(f"{name} = {rule.summary}" for name, rule in RULES.items()) + ".",
                         choices=KEEP_MODES)
    spread: float = _setting(
        0.0, "Share of each layer's rule slots kept for positions drawn at random, each KV head and layer its own "
        "(0 = none): what random eviction keeps, beside what the rule keeps.", metavar="SHARE")
    stratify: Optional[float] = _setting(
        None, "Share of each layer's rule slots given out over stretches of the document, each stretch its share "
        "by length, to the positions the rule ranks best within it (0 = none): no stretch is left bare.",
        metavar="SHARE", default_text=f"{DEFAULT_STRATIFY} with --keep question (less where --carry and --spread "
        f"leave less, so that {STRATIFY_LEAVES} of the slots go by the rule's scores), else 0")
    early_keep: str = _setting(
        "auto", "Rule of the first 30% of the full-attention layers (at least two): auto = leverage under "
        "--keep blend (--preset intrinsic), else the --keep rule; or a rule name. --layer-keep overrides it per "
        "layer.",
        choices=("auto", *KEEP_MODES))
    skip_layers: Optional[tuple[int, ...]] = _setting(
        (), "Layers left uncompressed (their memory grows with the input), e.g. '0,1' or '0-8'; 'none' "
        "compresses all.", parse=parse_skip_layers, metavar="LIST|none",
        default_text="none: every layer bounded (--preset retrieval leaves the first 30% of the full-attention "
                     "layers whole)")
    layer_budgets: Optional[Mapping[int, int]] = _setting(
        None, "Per-layer budgets overriding --budget, e.g. '2-8:1024,20:256'.", parse=parse_layer_budgets,
        metavar="LAYERS:INT,...")
    coverage: float = _setting(
        0.0, "Share of each layer's budget kept evenly spread over the positions seen (0 = none); the rest goes "
        "by the rule. Keeps what a summary needs beside what the rule keeps.", metavar="SHARE")
    recent_share: float = _setting(
        RECENT_SHARE, "Share of each layer's budget kept as its most recent tokens when --recent is not given.",
        metavar="SHARE")
    early_factor: Optional[int] = _setting(
        None, "Bound every layer: nothing skipped, the first 30% of the full-attention layers hold N x --budget "
        "(8: a fixed memory ceiling near what --preset retrieval holds on an 8k-token document).")
    kv_bits: Optional[int] = _setting(
        None, "Store the kept keys and values quantized to 4 or 8 bits (mx.quantize; decode steps attend "
        "through mlx_lm's quantized SDPA); 'none' = full precision. Eviction still scores full-precision keys.",
        parse=parse_kv_bits, metavar="4|8|none")
    kv_group_size: int = _setting(
        64, "Elements of a head's key or value that share one quantization scale and bias (with --kv-bits): "
        "32, 64 or 128, dividing the model's head dimension.", parse=parse_kv_group_size, metavar="32|64|128")
    layer_keep: Optional[Mapping[int, str]] = _setting(
        None, "Per-layer rules overriding --keep, e.g. '0-5:low,20:leverage'.",
        parse=parse_layer_keep, metavar="LAYERS:RULE,...")

    def __post_init__(self):
        self._settle_budget()
        if self.skip_layers is not None:
            if isinstance(self.skip_layers, (str, bytes)) or not hasattr(self.skip_layers, "__iter__"):
                raise ValueError(f"skip_layers must be a list of layer indices, got {self.skip_layers!r}")
            object.__setattr__(self, "skip_layers",
                               tuple(_layer_index(i, "skip_layers") for i in self.skip_layers))
        if self.recent is not None and not _is_int(self.recent):
            raise ValueError(f"recent must be an integer, got {self.recent!r}")
        object.__setattr__(self, "coverage", check_coverage(self.coverage))
        object.__setattr__(self, "spread", _check_share(self.spread, "spread", 0.25))
        if self.stratify is not None:  # None: settled with the rule's own settings (_check_rule_settings)
            object.__setattr__(self, "stratify", _check_share(self.stratify, "stratify", 0.5))
        self._check_rule_settings()
        object.__setattr__(self, "recent_share", check_recent_share(self.recent_share))
        check_rule(self.early_keep, "early_keep", auto=True)
        check_kv_quantization(self.kv_bits, self.kv_group_size)
        if self.budget is not None:
            validate_eviction_args(self.budget, self.n_sink, self.layer_recent(self.budget), self.keep,
                                   self.coverage)
        else:
            check_rule(self.keep)
        if self.ratio is not None:
            try:
                validate_eviction_args(MIN_RATIO_BUDGET, self.n_sink, self.layer_recent(MIN_RATIO_BUDGET),
                                       self.keep, self.coverage)
            except ValueError as e:
                raise ValueError(f"with ratio a short document's budget is {MIN_RATIO_BUDGET} tokens: {e}") from None
        self._check_layer_maps()
        if self.ratio is not None:
            object.__setattr__(self, "ratio", parse_ratio(self.ratio))
            if self.early_factor is not None or self.layer_budgets is not None:
                raise ValueError("ratio sets each layer's budget from the document: leave early_factor and "
                                 "layer_budgets unset, or give a fixed --budget instead of --ratio")
        if self.early_factor is not None:
            if not _is_int(self.early_factor) or self.early_factor < 1:
                raise ValueError(f"early_factor must be an integer >= 1, got {self.early_factor!r}")
            if self.skip_layers not in (None, ()) or self.layer_budgets is not None:
                raise ValueError("early_factor sets the layer layout itself: leave skip_layers and layer_budgets "
                                 "unset, or drop early_factor")

    def _check_rule_settings(self) -> None:
        """``keep`` given as a rule object sets its settings; every rule checks its own
        (:class:`~knorm_gen.eviction.rules.base.Rule`), and what a rule carries plus ``spread``
        must leave slots to the rule."""
        by_name = not isinstance(self.keep, Rule)  # a rule object is what runs: its own variants only
        if not by_name:
            for key, value in self.keep.settings().items():
                object.__setattr__(self, key, value)
            object.__setattr__(self, "keep", self.keep.name)
        check_rule(self.keep)
        values = {key: getattr(self, key) for key in setting_fields()}
        for cls in RULES.values():
            for key, value in cls.from_settings(values).settings().items():
                object.__setattr__(self, key, value)
        carried = max((self.rule(r).carry for r in self.rules() if r in RULES), default=0.0)  # others: refused below
        if self.stratify is None:  # the question rule's default share, less where carry and spread leave less
            share = min(DEFAULT_STRATIFY, round(1 - STRATIFY_LEAVES - carried - self.spread, 6))
            object.__setattr__(self, "stratify", max(0.0, share) if by_name and self.keep == "question" else 0.0)
        if carried + self.spread + self.stratify >= 1:
            raise ValueError(f"carry + spread + stratify must be below 1 (got {carried} + {self.spread} + "
                             f"{self.stratify}): nothing would be left "
                             f"for the rule to choose")

    def rule_settings(self) -> tuple[tuple[str, Any], ...]:
        """Every rule's settings as ``(key, value)`` pairs (what the caches build rules from)."""
        return tuple((key, getattr(self, key)) for key in setting_fields())

    def rule(self, name: Optional[str] = None) -> Rule:
        """The rule ``name`` (default ``keep``) with this config's settings."""
        return make_rule(name or self.keep, **dict(self.rule_settings()))

    def _check_layer_maps(self) -> None:
        """``layer_budgets`` and ``layer_keep``: layer index to a budget or a rule, each checked."""
        if self.layer_budgets is not None:
            if not isinstance(self.layer_budgets, Mapping):
                raise ValueError(f"layer_budgets must map layer index to budget, got {self.layer_budgets!r}")
            budgets = {_layer_index(k, "layer_budgets"): v for k, v in self.layer_budgets.items()}
            for layer, b in budgets.items():
                try:
                    validate_eviction_args(b, self.n_sink, self.layer_recent(b) if _is_int(b) else 0, self.keep,
                                           self.coverage)
                except ValueError as e:
                    raise ValueError(f"layer_budgets[{layer}]: {e}") from None
            object.__setattr__(self, "layer_budgets", budgets or None)
        if self.layer_keep is not None:
            if not isinstance(self.layer_keep, Mapping):
                raise ValueError(f"layer_keep must map layer index to rule, got {self.layer_keep!r}")
            rules = parse_layer_keep(self.layer_keep)
            for layer, rule in rules.items():
                check_rule(rule, f"layer_keep[{layer}]")
            object.__setattr__(self, "layer_keep", rules or None)

    def _settle_budget(self) -> None:
        """Neither ``budget`` nor ``ratio`` given: ``ratio=DEFAULT_RATIO`` without a cap;
        otherwise what is not given is None, so a budget given alone is fixed and
        ``budget=None`` alone is the full cache. ``early_factor`` and ``layer_budgets`` need
        ``budget`` stated (they cannot follow a ratio)."""
        if self.budget is UNSET and self.ratio is UNSET:
            for name in ("early_factor", "layer_budgets"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} sets layers' budgets from budget: give budget=N (--budget N) with it, "
                                     "or budget=None for the other layers whole")
        given = self.budget is not UNSET or self.ratio is not UNSET
        if self.budget is UNSET:
            object.__setattr__(self, "budget", None)
        if self.ratio is UNSET:
            object.__setattr__(self, "ratio", None if given else DEFAULT_RATIO)

    def rules(self) -> set[str]:
        """Every rule some layer may run (``keep``, the early layers', ``layer_keep``'s)."""
        return {self.keep, self.early_rule() or self.keep, *(self.layer_keep or {}).values()}

    def layer_recent(self, budget: int) -> int:
        """The recent window of a layer holding ``budget`` tokens."""
        return auto_recent(budget, self.recent_share, self.n_sink) if self.recent is None else self.recent

    def early_rule(self) -> Optional[str]:
        """The rule of the early layers where it is not ``keep`` (None: ``keep`` there too)."""
        rule = (RULES[self.keep].early or self.keep) if self.early_keep == "auto" else self.early_keep
        return None if rule == self.keep else rule

    def for_model(self, model: Any) -> "ResolvedEviction":
        """:meth:`resolved` for ``model``, its default layers counted among its
        full-attention layers (found by building the model's own caches: a
        run that resolves many configs should find them once, with
        :func:`knorm_gen.platform.mlx_compat.full_attention_layers`, and call :meth:`resolved`)."""
        from ..platform.mlx_compat import full_attention_layers, kv_head_dims, make_prompt_cache

        if self.kv_bits:
            check_head_dims(kv_head_dims(model), self.kv_group_size)
        return self.resolved(len(make_prompt_cache(model)), full_attention_layers(model))

    def resolved(self, n_layers: int, full_layers: Optional[Sequence[int]] = None) -> "ResolvedEviction":
        """This config made explicit for a model of ``n_layers`` whose plain
        full-attention layers are ``full_layers`` (None: all of them): the skipped
        layers, the per-layer budgets and recent windows. A ValueError names an
        index out of range."""
        full = tuple(range(n_layers)) if full_layers is None else tuple(sorted(full_layers))
        skip, budgets = self.skip_layers, dict(self.layer_budgets or {})
        if self.early_factor is not None:
            skip = ()
            if self.budget is not None:
                budgets = {i: self.early_factor * self.budget for i in early_layers(n_layers, full_layers)}
        elif skip is None:
            skip = early_layers(n_layers, full_layers)
        for what, layers in (("skip_layers", skip), ("layer_budgets", budgets), ("layer_keep", self.layer_keep or {})):
            for i in layers:
                if not -n_layers <= i < n_layers:
                    raise ValueError(f"{what} index {i} is out of range for a model with {n_layers} layers "
                                     f"(0 to {n_layers - 1})")
        plan: list[Optional[LayerPlan]] = [None] * n_layers
        if self.ratio is not None or self.budget is not None:
            skipped = {i % n_layers for i in skip}
            own = {i % n_layers: b for i, b in budgets.items()}
            for i in full:
                if i not in skipped:  # under ratio the budget follows the document: None until it is known
                    b = own.get(i, self.budget if self.ratio is None else None)
                    plan[i] = LayerPlan(b, None if b is None else self.layer_recent(b))
        base_recent = self.layer_recent(self.budget) if self.budget else self.recent or 0
        early = self.early_rule()
        rules = {i: early for i in early_layers(n_layers, full_layers) if early and plan[i] is not None}
        rules.update({i % n_layers: r for i, r in (self.layer_keep or {}).items()})
        rules = rules or None
        return ResolvedEviction(self.budget, self.n_sink, base_recent, self.keep, tuple(skip), budgets or None,
                                n_layers, full, tuple(plan), self.coverage, self.kv_bits, self.kv_group_size, rules,
                                self.rule_settings(), self.spread, self.ratio, self.recent_share, self.recent,
                                self.stratify)

    def to_dict(self) -> dict:
        """JSON-ready: ``skip_layers`` as a list (or None); ``layer_budgets`` and
        ``early_factor`` only when set."""
        d = asdict(self)
        d["skip_layers"] = None if self.skip_layers is None else list(self.skip_layers)
        if self.early_factor is None:  # records made before the field existed keep their fingerprints
            d.pop("early_factor")
        if self.ratio is None:
            d.pop("ratio")
        if not self.coverage:
            d.pop("coverage")
        if self.recent_share == OLD_RECENT_SHARE:  # what every config before the field had
            d.pop("recent_share")
        d["early_keep"] = self.early_rule()  # what runs, so "auto" and the rule it means match
        if d["early_keep"] is None:  # keep in every layer, as every config before the field
            d.pop("early_keep")
        if self.kv_bits is None:  # full precision: the fingerprints of records made before kv_bits
            d.pop("kv_bits")
            d.pop("kv_group_size")
        if self.layer_budgets is None:
            d.pop("layer_budgets")
        else:
            d["layer_budgets"] = {str(k): v for k, v in sorted(self.layer_budgets.items())}
        if self.layer_keep is None:
            d.pop("layer_keep")
        else:
            d["layer_keep"] = {str(k): v for k, v in sorted(self.layer_keep.items())}
        used = self.rules()
        for key, (rule, _) in setting_fields().items():  # a rule's own settings mean nothing where it does not run
            if rule.name not in used:
                d.pop(key)
        if not self.spread:
            d.pop("spread")
        if not self.stratify:
            d.pop("stratify")
        return d

    def __hash__(self) -> int:
        return hash((self.budget, self.n_sink, self.recent, self.keep, self.skip_layers,
                     tuple(sorted((self.layer_budgets or {}).items())), self.early_factor, self.coverage,
                     self.recent_share, self.early_rule(), self.rule_settings(), self.spread, self.stratify,
                     self.kv_bits, self.kv_group_size, tuple(sorted((self.layer_keep or {}).items()))))


@dataclass(frozen=True)
class ResolvedEviction:
    """An :class:`EvictionConfig` made explicit for one model (see
    :meth:`EvictionConfig.resolved`): ``layers[i]`` is the :class:`LayerPlan` of a
    layer the eviction cache replaces, or None for a layer left as the model made
    it (a skipped layer, a sliding-window or SSM layer, or every layer when
    ``budget`` is None). Under ``ratio`` the plans hold no budget until the document
    is known (:attr:`sized`). The caches take it as it is."""

    budget: Optional[int]
    n_sink: int
    recent: int
    keep: str
    skip_layers: tuple[int, ...]
    layer_budgets: Optional[dict[int, int]]
    n_layers: int
    full_layers: tuple[int, ...]
    layers: tuple[Optional[LayerPlan], ...]
    coverage: float = 0.0
    kv_bits: Optional[int] = None
    kv_group_size: int = KV_GROUP_SIZES[1]
    layer_keep: Optional[dict[int, str]] = None  # {layer: rule} where it is not ``keep``
    rule_settings: tuple[tuple[str, Any], ...] = ()  # every rule's settings by key (EvictionConfig.rule_settings)
    spread: float = 0.0
    ratio: Optional[float] = None
    recent_share: float = OLD_RECENT_SHARE
    fixed_recent: Optional[int] = None  # recent as the user gave it (None: recent_share of each budget)
    stratify: float = 0.0

    @property
    def sized(self) -> bool:
        """Whether every compressed layer's budget is known (a ratio needs the document's length first)."""
        return not any(p is not None and p.budget is None for p in self.layers)

    def for_document(self, doc_tokens: int, reserved: int = 0) -> "ResolvedEviction":
        """This layout for one document of ``doc_tokens`` positions: under ``ratio`` each
        compressed layer keeps its tokens / ratio of it (:func:`ratio_budget`, with the
        ``reserved`` sink slots outside it, at most ``budget``); otherwise itself."""
        if self.ratio is None:
            return self
        return self._sized(ratio_budget(doc_tokens, self.ratio, self.budget, reserved))

    def _sized(self, b: int) -> "ResolvedEviction":
        r = auto_recent(b, self.recent_share, self.n_sink) if self.fixed_recent is None else self.fixed_recent
        return replace(self, layers=tuple(None if p is None else LayerPlan(b, r) for p in self.layers))

    def for_row(self, spans: Spans, n_ids: int) -> "ResolvedEviction":
        """This layout for one row: the document that ``spans`` mark in a prompt of ``n_ids``
        tokens sets each compressed layer's budget under ``ratio`` (:func:`row_budget`)."""
        if self.ratio is None:
            return self
        return self._sized(row_budget(self.ratio, self.budget, self.n_sink, spans, n_ids))

    def batch_form(self) -> "ResolvedEviction":
        """The settings rows must share to decode together: this layout with the budgets that
        follow each document (``ratio``) left out, as a batch cache holds one per row."""
        if self.ratio is None:
            return self
        return replace(self, layers=tuple(None if p is None else LayerPlan(None, None) for p in self.layers))

    def keep_of(self, layer: int) -> str:
        """The rule of ``layer``."""
        return (self.layer_keep or {}).get(layer, self.keep)

    def rules(self) -> set[str]:
        """The rules of the compressed layers."""
        return {self.keep_of(i) for i, plan in enumerate(self.layers) if plan is not None} or {self.keep}

    def rule_of(self, layer: int) -> Rule:
        """The rule object of ``layer``, with its settings, wrapped by the variants this layout sets
        (:func:`~knorm_gen.eviction.rules.variants.with_variants`)."""
        return with_variants(make_rule(self.keep_of(layer), **dict(self.rule_settings)), self.coverage, self.spread,
                             self.stratify)

    def to_dict(self) -> dict:
        """The ``config`` records and results report (the same keys as ever:
        ``budget, n_sink, recent, keep, skip_layers`` and ``layer_budgets`` when set)."""
        d = {"budget": self.budget, "n_sink": self.n_sink, "recent": self.recent, "keep": self.keep,
             "skip_layers": list(self.skip_layers)}
        if self.layer_budgets is not None:
            d["layer_budgets"] = {str(k): v for k, v in sorted(self.layer_budgets.items())}
        if self.coverage:
            d["coverage"] = self.coverage
        if self.kv_bits:
            d["kv_bits"], d["kv_group_size"] = self.kv_bits, self.kv_group_size
        if self.layer_keep:
            d["layer_keep"] = {str(k): v for k, v in sorted(self.layer_keep.items())}
        for name in sorted(self.rules()):  # each rule that runs reports its own settings
            d.update(make_rule(name, **dict(self.rule_settings)).settings())
        if self.spread:
            d["spread"] = self.spread
        if self.stratify:
            d["stratify"] = self.stratify
        if self.ratio is not None:  # each row's budget follows its document: the settings that decide it
            d["ratio"], d["recent"] = self.ratio, self.fixed_recent
            if self.fixed_recent is None:
                d["recent_share"] = self.recent_share
        return d

    def __hash__(self) -> int:
        return hash((self.n_sink, self.keep, self.layers, self.coverage, self.kv_bits, self.kv_group_size,
                     tuple(sorted((self.layer_keep or {}).items())), self.rule_settings, self.spread, self.stratify))


# ---- generation ----------------------------------------------------------------


@dataclass(frozen=True)
class GenerationConfig:
    """How text is generated. ``chat=None`` applies the chat template to text
    when the tokenizer has one; ``question_separator`` goes between a context
    and each question in :func:`~knorm_gen.answer_questions`.

    ``temperature`` is 0 (greedy) or at least :data:`MIN_TEMPERATURE` (2**-126,
    about 1.2e-38, the smallest normal float32): a smaller positive one is
    refused, since the sampler's ``1 / temperature`` overflows float32 and would
    sample uniformly random tokens. A number that is not a finite float (an
    integer of a few hundred digits) is refused like any bad value.

    ``parse_special_tokens=False`` (the default) tokenizes user text (prompts,
    message roles and contents, contexts, questions) as text: ``<|im_end|>``
    written in a document is those characters, and only the chat template's own
    markers are control tokens. True parses special-token spellings in user
    text as the tokenizer's control tokens (what the template path did before)."""

    max_tokens: int = _setting(256, "Tokens to generate at most, per row (per answer for question rows). 256, not "
                                    "mlx_lm's 100: a summary of a long document in three or so sentences rarely fits "
                                    "in 100 tokens.")
    temperature: float = _setting(0.0, "Sampling temperature; 0 = greedy.")
    top_p: float = _setting(1.0, "Nucleus sampling: keep the smallest set of tokens whose probability reaches p.")
    seed: Optional[int] = _setting(None, "Sampling seed, 0 to 2**64-1: set before each row at --batch-size 1, "
                                         "once per batch otherwise.")
    prefill_step_size: int = _setting(512, "Prompt tokens per forward pass. 512, not mlx_lm's 2048: on a CPU a "
                                           "smaller block bounds the transient memory of attention, and each later "
                                           "block attends only to what eviction kept of the earlier ones, as the "
                                           "product runs and was measured.")
    chat: Optional[bool] = _setting(None, "Apply the chat template to text prompts.",
                                    default_text="when the tokenizer has one")
    question_separator: str = _setting("\n\n", "Text between a context and each question.",
                                       default_text="a blank line")
    top_k: int = _setting(0, "Sample only from the k most likely tokens (0 = all); with temperature > 0.")
    min_p: float = _setting(0.0, "Drop tokens less likely than min_p times the most likely one (0 = off); "
                                 "with temperature > 0.")
    repetition_penalty: float = _setting(1.0, "Divide the logits of tokens seen in the last "
                                              "repetition_context_size tokens by this (1 = off; small models "
                                              "repeat themselves: 1.1-1.3 helps).")
    repetition_context_size: int = _setting(20, "Tokens the repetition penalty looks back over.")
    system_prompt: Optional[str] = _setting(None, "A system message before each row's prompt (chat template only).")
    parse_special_tokens: bool = _setting(False, "Parse special-token spellings in user text (<|im_end|>) as "
                                                 "control tokens; by default they are text.")
    pin_prefix_chars: int = _setting(0, "Characters at the start of each user text (a row's prompt or context) "
                                        "pinned with the instructions: an instruction written before the document "
                                        "('Summarize the following...'). The template, system turn, question and "
                                        "answer are always pinned.", metavar="CHARS")
    long_documents: str = _setting(
        "error", "A document longer than the model's context: error = an error record naming its length, the limit "
        "and these choices; truncate = keep its start and end (half the room each); chunk = answer the question on "
        "each piece that fits, then once more over the pieces' answers (question rows).",
        choices=LONG_DOCUMENTS)

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite_float(value):
                shown = "an integer too large for a float" if _is_int(value) else repr(value)
                raise ValueError(f"{name} must be a finite number, got {shown}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least 2**-126 (about 1.2e-38), got "
                             f"{self.temperature!r}: smaller, 1/temperature overflows float32 and sampling "
                             f"becomes uniformly random")
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
        self._check_sampling()
        if not isinstance(self.parse_special_tokens, bool):
            raise ValueError(f"parse_special_tokens must be true or false, got {self.parse_special_tokens!r}")
        if not _is_int(self.pin_prefix_chars) or self.pin_prefix_chars < 0:
            raise ValueError(f"pin_prefix_chars must be an integer >= 0, got {self.pin_prefix_chars!r}")
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"long_documents must be one of {', '.join(LONG_DOCUMENTS)}, got {self.long_documents!r}")

    def _check_sampling(self) -> None:
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if not _is_int(self.repetition_context_size) or self.repetition_context_size < 1:
            raise ValueError(f"repetition_context_size must be an integer >= 1, got {self.repetition_context_size!r}")
        if self.system_prompt is not None and (not isinstance(self.system_prompt, str)
                                               or not self.system_prompt.strip()):
            raise ValueError(f"system_prompt must be non-empty text, got {self.system_prompt!r}")

    def to_dict(self) -> dict:
        """JSON-ready. Fields added after the first release appear only when set, so
        records made before them keep their fingerprints."""
        d = asdict(self)
        for f in fields(self):
            if f.name in _LATER_GENERATION_FIELDS and d[f.name] == f.default:
                del d[f.name]
        return d


_LATER_GENERATION_FIELDS = ("top_k", "min_p", "repetition_penalty", "repetition_context_size", "system_prompt",
                            "parse_special_tokens", "pin_prefix_chars", "long_documents")


@dataclass(frozen=True)
class RowsConfig:
    """How ``knorm-batch`` reads each row's document and question: ``context_field``
    names the field holding a row's document (``text``, ``article``, ``body``), and
    ``questions`` (``--question``, repeatable) are asked of every row that has a
    document and no question of its own. Both are part of every record's
    ``config`` (when set) and so of its fingerprint."""

    questions: tuple[str, ...] = _setting((), "A question (an instruction) for every row that has a document "
                                              "and no question of its own; repeat for several.",
                                          default_text="none", multiple=True, cli_name="question")
    context_field: str = _setting("context", "The field that holds a row's document.")

    def __post_init__(self):
        if isinstance(self.questions, str) or not isinstance(self.questions, (list, tuple)):
            raise ValueError(f"questions must be a list of text, got {self.questions!r}")
        object.__setattr__(self, "questions", tuple(self.questions))
        for i, q in enumerate(self.questions):
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"questions[{i}] must be non-empty text, got {q!r}")
        if not isinstance(self.context_field, str) or not self.context_field.strip():
            raise ValueError(f"context_field must be a field name, got {self.context_field!r}")
        if self.context_field in ("id", "prompt", "messages", "question", "questions"):
            raise ValueError(f"context_field cannot be {self.context_field!r}: that field has its own meaning")

    def to_dict(self) -> dict:
        """Only what differs from the defaults (records made before these settings
        existed keep their fingerprints)."""
        d = {}
        if self.questions:
            d["questions"] = list(self.questions)
        if self.context_field != "context":
            d["context_field"] = self.context_field
        return d


EVICTION_FIELDS = tuple(f.name for f in fields(EvictionConfig))
GENERATION_FIELDS = tuple(f.name for f in fields(GenerationConfig))
ROWS_FIELDS = tuple(f.name for f in fields(RowsConfig))
DEFAULT_PREFILL_STEP = GenerationConfig.prefill_step_size
DEFAULT_QUESTION_SEPARATOR = GenerationConfig.question_separator


PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(recent_share=RECENT_SHARE, keep="question", question_score="mean", carry=0.25, early_keep="auto",
                    skip_layers=(), early_factor=None, layer_budgets=None, coverage=0.0, layer_keep=None, spread=0.0,
                    stratify=None),
    "paper": dict(recent_share=OLD_RECENT_SHARE, keep="low", early_keep="auto", skip_layers=(0, 1),
                  early_factor=None, layer_budgets=None, coverage=0.0, layer_keep=None, spread=0.0, stratify=0.0),
    "retrieval": dict(recent_share=OLD_RECENT_SHARE, keep="low", early_keep="auto", skip_layers=None,
                      early_factor=None, layer_budgets=None, coverage=0.0, layer_keep=None, spread=0.0,
                      stratify=0.0),
    "summarize": dict(recent_share=OLD_RECENT_SHARE, keep="keydiff", early_keep="auto", skip_layers=(),
                      early_factor=None, layer_budgets=None, coverage=0.0, layer_keep=None, spread=0.0,
                      stratify=0.0),
    "question": dict(recent_share=OLD_RECENT_SHARE, keep="question", question_score="best", carry=0.0,
                     early_keep="auto", skip_layers=(), early_factor=None, layer_budgets=None, coverage=0.0,
                     layer_keep=None, spread=0.0, stratify=0.0),
    "intrinsic": dict(recent_share=0.5, keep="blend", early_keep="auto", skip_layers=(), early_factor=None,
                      layer_budgets=None, coverage=0.25, layer_keep=None, spread=0.0, stratify=0.0),
    "auto": {},  # the model's saved tuning: resolved once the model is loaded (knorm_gen.generation.tunings.auto_config)
}
LAYOUT_FIELDS = ("keep", "question_score", "carry", "spread", "stratify", "early_keep", "coverage", "recent_share",
                 "skip_layers", "layer_budgets", "early_factor", "layer_keep")
"""The fields a layout (a preset, a saved tuning) sets; the budget and the rest are the run's.

Named layouts (``--preset``, ``preset=``; the fields given beside a preset override it):
``default``: the default layout (the question rule in every layer, the mean reading,
carrying a quarter, seven tenths of its slots stratified, the recent quarter; ``stratify`` left
unset means 0.7 under the question rule and 0 under any other, so the default's form with another
``keep`` is that rule alone). ``paper``: the paper's rule and layers (keep-low,
layers 0-1 uncompressed, so their memory grows with the input). ``retrieval``: keep-low with
the first 30% of the full-attention layers uncompressed (memory grows with the input).
``summarize``: KeyDiff in every layer, every layer bounded. ``question``: the question rule
with the best reading, no carry and the recent eighth. ``intrinsic``: no probe: leverage in
the first 30% of the full-attention layers, the blend in the rest, a quarter of each budget
spread evenly, the recent half, every layer bounded. ``auto``: the layout ``knorm-tune``
saved for the model (the default without one)."""


def make_configs(eviction: Optional[EvictionConfig] = None, generation: Optional[GenerationConfig] = None,
                 *, preset: Optional[str] = None, **settings: Any) -> tuple[EvictionConfig, GenerationConfig]:
    """``(eviction, generation)`` from optional configs plus keyword fields of
    either (``budget=64, max_tokens=48``), which override the configs' values.
    ``preset`` (a name of :data:`PRESETS`) sets the eviction layout first; the
    keyword fields override it. An unknown keyword is a TypeError that lists the
    allowed ones. The only builder: the Python API, the command line, job files
    and per-row overrides all go through it."""
    unknown = set(settings) - set(EVICTION_FIELDS) - set(GENERATION_FIELDS)
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(sorted(unknown))}; allowed: "
                        f"{', '.join(EVICTION_FIELDS + GENERATION_FIELDS + ('preset',))}")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    layout = PRESETS[preset] if preset is not None else {}
    ev = {k: v for k, v in settings.items() if k in EVICTION_FIELDS}
    if eviction is None:  # built from what is given: a budget given alone is fixed (EvictionConfig)
        eviction = EvictionConfig(**{**layout, **ev})
    elif layout or ev:  # on top of a given config: its ratio stays, and a budget given caps it
        over = {**layout, **ev}
        if {"keep", "carry", "spread"} & set(over) and "stratify" not in over:
            over["stratify"] = None  # unset, it follows the rule that runs (EvictionConfig.stratify)
        eviction = replace(eviction, **over)
    generation = generation or GenerationConfig()
    gen = {k: v for k, v in settings.items() if k in GENERATION_FIELDS}
    if gen:
        generation = replace(generation, **gen)
    return eviction, generation


def settings_dict(eviction: Union[EvictionConfig, ResolvedEviction], generation: GenerationConfig,
                  rows: Optional[RowsConfig] = None) -> dict:
    """The ``config`` a result and a record report: the eviction settings (resolved
    for the model), the generation settings, and (``knorm-batch``) how rows were read."""
    return {**eviction.to_dict(), **generation.to_dict(), **(rows.to_dict() if rows else {})}
