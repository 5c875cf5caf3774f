"""Carry: each carrying layer after the first keeps a share of its rule's slots for the
positions the layers before it scored best (``EvictionConfig.carry``).

On Gemma 3 the first bounded layer ranked a lost key's sentence near its top and a later
layer dropped it; carried, every later layer keeps what an earlier one found. A
:class:`CarryGroup` is the one object a prompt's carrying layers share, created where the
probe is (:func:`knorm_gen.eviction.cache.probe_caches`): it lists them in the order a forward pass
updates them; each layer keeps its own board (its best standardised score per position,
:func:`~knorm_gen.eviction.selection.carry_values`) and reads the earlier members' boards. When
mlx_lm batches caches layer by layer (``merge``) or takes a row out (``extract``), the
layers of the new cache find their new shared group through :func:`merged_group` /
:func:`extracted_group`, keyed by the groups they came from.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import mlx.core as mx


class CarryGroup:
    """The carrying layers of one prompt (or of one batch of prompts), in layer order."""

    def __init__(self, sources: tuple = ()):
        self._members: list = []  # weak references: the layers own the group, not the other way round
        self._sources = sources  # the groups this one was made from, kept alive so their ids stay unique
        self._extracted: "weakref.WeakValueDictionary[int, CarryGroup]" = weakref.WeakValueDictionary()

    def join(self, cache: Any) -> None:
        self._members.append(weakref.ref(cache))

    def carried(self, cache: Any) -> Optional[mx.array]:
        """``(B, W)``: per position the best board value of the members before ``cache``
        (None: none has a board yet)."""
        boards = []
        for ref in self._members:
            member = ref()
            if member is cache:
                break
            if member is not None and member.carry_board is not None:
                boards.append(member.carry_board)
        if not boards:
            return None
        width = min(b.shape[-1] for b in boards)
        carry = boards[0][:, :width]
        for b in boards[1:]:
            carry = mx.maximum(carry, b[:, :width])
        return carry


_MERGED: "weakref.WeakValueDictionary[tuple, CarryGroup]" = weakref.WeakValueDictionary()


def merged_group(groups: list) -> Optional[CarryGroup]:
    """The group the layers of one ``merge`` of these rows' groups share (the same object
    for every layer merged from them); None when no row carries."""
    if all(g is None for g in groups):
        return None
    key = tuple(id(g) for g in groups)
    group = _MERGED.get(key)
    if group is None:
        group = CarryGroup(tuple(groups))
        _MERGED[key] = group
    return group


def extracted_group(group: Optional[CarryGroup], row: Any) -> Optional[CarryGroup]:
    """The group the layers of one row taken out of a batch share (``row``: an object
    that identifies the row for as long as the batch holds it)."""
    if group is None:
        return None
    found = group._extracted.get(id(row))
    if found is None:
        found = CarryGroup((group, row))
        group._extracted[id(row)] = found
    return found
