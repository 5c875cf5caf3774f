"""Admission by KV memory: what each sequence of a request can reach, what a batch
of them can reach together, and the limit they are admitted under.

:func:`sequence_need` and :func:`batch_bytes` do the arithmetic over a
:class:`~knorm_gen.eviction.memory.KVMemory` (what one row's layers hold);
:class:`KVLimit` admits a request (a prompt, or a context with questions: an
:class:`knorm_gen.generation.engine.Request`, which it reads but does not import) only
while everything in flight stays within ``--max-kv-memory``, whose default is
:func:`default_kv_limit` and whose text form :func:`parse_size` reads.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Hashable

import mlx.core as mx

from ..eviction.config import ResolvedEviction
from ..eviction.memory import KVMemory, kv_memory, mib
from ..eviction.spans import pinned_count

DEFAULT_KV_SHARE = 0.5
"""The default ``--max-kv-memory``: this share of the machine's memory (of Metal's
recommended working set on a Mac), leaving the rest to the weights, the prefill's
transient activations and everything else on the machine."""


class KVMemoryExceeded(ValueError):
    """A row needs more KV memory than the limit allows, even alone."""


@dataclass(frozen=True)
class KVNeed:
    """The most KV memory one sequence can reach: the bytes of its bounded layers,
    and the positions its layers that keep every token will hold."""

    bounded_bytes: int
    unbounded_positions: int


def sequence_need(memory: KVMemory, tokens: int, pinned: int = 0) -> KVNeed:
    """What a sequence of ``tokens`` positions (prompt plus ``max_tokens``) can reach;
    the last ``pinned`` of them (a question and its answer over a compressed context)
    are never evicted, so they come on top of a bounded layer's budget."""
    bounded = sum(row * (min(tokens - pinned, cap) + pinned) for row, cap in memory.layers if cap is not None)
    return KVNeed(bounded, tokens if memory.growth_bytes_per_token else 0)


BATCH_STEP = 256
"""mlx_lm's ``BatchKVCache`` grows in steps of this many positions."""


def batch_bytes(needs: list[KVNeed], growth_bytes_per_token: int) -> int:
    """KV bytes a batch of these sequences can reach together. mlx_lm's batch cache
    for a layer that keeps every token pads every row to the longest one, so those
    layers cost rows x the longest row (in 256-position steps), not the sum."""
    if not needs:
        return 0
    longest = max(n.unbounded_positions for n in needs)
    longest = -(-longest // BATCH_STEP) * BATCH_STEP
    return sum(n.bounded_bytes for n in needs) + len(needs) * longest * growth_bytes_per_token


def machine_memory_bytes() -> int:
    """Metal's recommended working set on an Apple GPU, else the machine's physical memory."""
    try:
        if mx.metal.is_available():
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            return int(info["max_recommended_working_set_size"])
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_limit() -> int:
    """The default limit on KV memory in flight: :data:`DEFAULT_KV_SHARE` of
    :func:`machine_memory_bytes`."""
    return int(DEFAULT_KV_SHARE * machine_memory_bytes())


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(value: Any) -> int:
    """Bytes from ``2GiB``, ``512MiB``, ``1.5GB`` or a plain number of bytes; must be > 0."""
    if isinstance(value, bool):
        raise ValueError(f"a memory size must look like 2GiB or 512MiB, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not m or m[2].lower() not in _UNITS:
            raise ValueError(f"a memory size must look like 2GiB or 512MiB (units B, KiB, MiB, GiB, TiB, or KB, "
                             f"MB, GB, TB), got {value!r}")
        number, unit = float(m[1]), m[2].lower()
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise ValueError(f"a memory size must be more than 0 bytes, got {value!r}")
    return int(size)


class KVLimit:
    """Admission by KV memory: a request (:class:`knorm_gen.generation.engine.Request`) joins the
    batch only while the KV bytes the sequences in flight can reach, plus its own,
    stay within ``limit_bytes``.
    Bounded layers count at their ceiling (a pinned question's tokens on top);
    layers that keep every token count at the prompt plus ``max_tokens``, and in
    a batch at the longest row (mlx_lm's batch cache pads rows to it).
    ``in_flight`` and ``peak`` are what the admitted sequences can reach."""

    def __init__(self, model: Any, limit_bytes: int):
        self.model, self.limit = model, limit_bytes
        self._memory: dict[ResolvedEviction, KVMemory] = {}
        self._needs: dict[Hashable, KVNeed] = {}
        self._growth = 0
        self.in_flight = 0
        self.peak = 0

    def memory(self, eviction: ResolvedEviction) -> KVMemory:
        """What one row of ``eviction`` holds per layer; measured once per layout, the
        budgets that follow each document (``ratio``) read from its plan."""
        key = eviction.batch_form()
        if key not in self._memory:
            self._memory[key] = kv_memory(self.model, eviction.for_document(0) if not eviction.sized else eviction)
        return self._memory[key].for_plan(eviction)

    def needs(self, request: Any) -> list[KVNeed]:
        """One need per sequence of the request."""
        memory, max_tokens = self.memory(request.eviction), request.generation.max_tokens

        def need(tokens: int) -> KVNeed:
            return sequence_need(memory, tokens, pinned=pinned_count(request.spans, request.eviction.n_sink, tokens))

        if request.ids is not None:
            return [need(len(request.ids) + max_tokens)]
        return [need(len(request.context_ids) + len(q) + max_tokens) for q in request.question_ids]

    def bytes_with(self, request: Any = None, *, alone: bool = False) -> int:
        """KV bytes the sequences in flight (none when ``alone``) plus ``request``'s can reach."""
        extra = self.needs(request) if request is not None else []
        growth = self.memory(request.eviction).growth_bytes_per_token if request is not None else self._growth
        return batch_bytes(extra + ([] if alone else list(self._needs.values())), growth)

    def check_alone(self, request: Any) -> None:
        """Raise :class:`KVMemoryExceeded` for a request that cannot fit even alone."""
        need = self.bytes_with(request, alone=True)
        if need > self.limit:
            what = "its prompt plus max_tokens" if request.ids is not None else (
                f"its {len(request.questions)} question(s) over the compressed context, each with max_tokens")
            raise KVMemoryExceeded(f"this row needs {mib(need)} ({need} bytes) of KV memory ({what}), more than "
                                   f"the limit of {mib(self.limit)} ({self.limit} bytes, --max-kv-memory); raise "
                                   "the limit, lower --budget or max_tokens, or bound every layer (--early-factor)")

    def admit(self, request: Any) -> None:
        self._growth = self.memory(request.eviction).growth_bytes_per_token
        for i, need in enumerate(self.needs(request)):
            self._needs[(request.key, i)] = need
        self._update()

    def release(self, key: Hashable) -> None:
        """A sequence finished: its memory is free."""
        self._needs.pop(key, None)
        self._update()

    def release_request(self, request: Any) -> None:
        for i in range(request.sequences):
            self._needs.pop((request.key, i), None)
        self._update()

    def _update(self) -> None:
        self.in_flight = batch_bytes(list(self._needs.values()), self._growth)
        self.peak = max(self.peak, self.in_flight)
