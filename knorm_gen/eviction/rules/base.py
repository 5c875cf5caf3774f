"""What a rule is: a score per key, lower kept first, and the hooks the cache calls.

The caches share one selection machinery (:mod:`knorm_gen.eviction.selection`): a rule only
states its score, so a new rule is one small class in one file of this package plus
its entry in :data:`knorm_gen.eviction.rules.RULES`, and the shared tests
(``tests/test_rules.py``) cover it the day it is added.
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, Mapping, Optional, Sequence

import mlx.core as mx


def setting(default: Any, help: str, *, key: Optional[str] = None, choices: Optional[Sequence[Any]] = None,
            metavar: Optional[str] = None) -> Any:
    """A rule's setting: a dataclass field whose ``key`` (default ``<rule name>_<field>``) is
    its name everywhere a setting is named: the config field, the command-line option
    (``--key``), the job-file key, the record's ``config`` and so the fingerprint."""
    return field(default=default, metadata={"help": help, "key": key, "choices": choices, "metavar": metavar})


@dataclass(frozen=True, eq=True)
class Rule:
    """A ranking rule. The cache calls the hooks below and never asks which rule it holds;
    each hook has a default, so a rule that scores the keys alone defines :meth:`score` and
    nothing else. A rule's settings are its dataclass fields (:func:`setting`);
    ``Question(reading="mean", carry=0.25)`` is a rule with its settings.

    - :meth:`score` ``(keys (B, H, N, D), positions (B, 1, N), state)`` gives one float32 per
      token ``(B, H, N)``; **lower is kept first**. ``state`` is what the hooks below made
      (None for a rule that uses neither).
    - Running state over every token a row has seen: :meth:`update` returns it after each
      block (the default keeps none), :meth:`reference` is what :meth:`score` reads of it,
      :meth:`zeros` is the state of rows that have seen nothing (batched beside rows that
      have). While a rule keeps one, a block of more than one token re-scores the held keys
      against the updated state, so one selection never compares scores made against
      different states.
    - A probe of the job's instructions, made before the document is read
      (:mod:`knorm_gen.eviction.rules.question`): :attr:`reads_probe` asks for one, and
      :meth:`prepare` makes what :meth:`score` reads from the rows' probes. A probe is fixed,
      so held keys are never re-scored.
    - :attr:`carries`: whether a layer keeps the share ``carry`` of its rule slots for the
      positions the layers before it scored best (:mod:`knorm_gen.eviction.carry`); the
      carrying layers are grouped where the probe is made, so only a rule that reads one
      carries. :attr:`penalty`: what :meth:`score` adds to a key it ranks after the rest on
      purpose, which carry then leaves out.

    ``early``: the rule of the early layers under ``early_keep="auto"`` (None: this one).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # what it keeps, in a few words: the command line's help lists it
    reads_probe: ClassVar[bool] = False
    penalty: ClassVar[float] = math.inf
    early: ClassVar[Optional[str]] = None
    carry = 0.0  # unannotated, so a rule that carries declares it as one of its settings

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        raise NotImplementedError

    @property
    def carries(self) -> bool:
        """Whether a layer of this rule keeps a share of its slots for what earlier layers scored best."""
        return self.carry > 0 and self.reads_probe

    @classmethod
    def keeps_state(cls) -> bool:
        """Whether the rule keeps running state (it defines :meth:`update`)."""
        return cls.update is not Rule.update

    @classmethod
    def setting_fields(cls) -> dict[str, Field]:
        """The rule's settings by their key (:func:`setting`)."""
        return {f.metadata.get("key") or f"{cls.name}_{f.name}": f for f in fields(cls)}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "Rule":
        """The rule with the settings ``settings`` holds under their keys (the rest: defaults)."""
        return cls(**{f.name: settings[key] for key, f in cls.setting_fields().items() if key in settings})

    def settings(self) -> dict:
        """The rule's settings by their key: what a record's ``config`` holds for it."""
        return {key: getattr(self, f.name) for key, f in self.setting_fields().items()}

    def check_share(self, name: str, example: float = 0.25, key: Optional[str] = None) -> None:
        """Raise ValueError unless setting ``name`` (named ``key`` in the message; default its
        setting's key) is a share from 0 to below 1."""
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            key = key or next(k for k, f in self.setting_fields().items() if f.name == name)
            raise ValueError(f"{key} must be a share from 0 to below 1 (e.g. {example}), got {value!r}")
        object.__setattr__(self, name, float(value))

    def check_choice(self, name: str) -> None:
        """Raise ValueError unless setting ``name`` is one of its field's choices."""
        key, f = next((k, f) for k, f in self.setting_fields().items() if f.name == name)
        if getattr(self, name) not in f.metadata["choices"]:
            raise ValueError(f"{key} must be one of {', '.join(map(str, f.metadata['choices']))}; "
                             f"got {getattr(self, name)!r}")

    def variants(self) -> tuple:
        """The variants wrapping this rule, innermost first (:mod:`.variants`); a rule alone has none."""
        return ()

    def base(self) -> "Rule":
        """The rule itself, out of any variants wrapping it."""
        return self

    # ---- running state -------------------------------------------------------
    def update(self, state: Any, keys: mx.array, seen: Sequence[int], real: Sequence[int]) -> Optional[mx.array]:
        """The running state once a block ``keys (B, H, N, D)`` is read: ``state`` before it
        (None: none yet), ``seen`` tokens per row before it, ``real`` tokens of it per row
        (right padding after them). An array whose first axis is the row (the cache takes
        rows out and joins them along it); None: the rule keeps no running state."""
        return state

    def reference(self, state: Any, seen: Sequence[int]) -> Any:
        """What :meth:`score` reads of the running ``state`` once each row has seen ``seen`` tokens."""
        return state

    def zeros(self, batch: int, heads: int, dim: int) -> mx.array:
        """The running state of ``batch`` rows that have seen nothing (a rule that keeps one defines it)."""
        raise NotImplementedError(f"rule {self.name!r} keeps running state, so it defines zeros()")

    # ---- a probe of the job's instructions --------------------------------------
    def prepare(self, probes: Sequence[Any]) -> Any:
        """What :meth:`score` reads from the rows' probes, one per row (asked only when
        :attr:`reads_probe` and every row is probed)."""
        return None


def squared_norm(keys: mx.array) -> mx.array:
    """``|k|^2`` per key, float32 whatever the cache dtype (no sqrt: the order is the norm's)."""
    return mx.sum(mx.square(keys.astype(mx.float32)), axis=-1)


def unit_keys(keys: mx.array) -> mx.array:
    """Keys scaled to unit length, float32 (a zero key stays zero)."""
    return keys.astype(mx.float32) * mx.rsqrt(mx.maximum(squared_norm(keys), 1e-30))[..., None]
