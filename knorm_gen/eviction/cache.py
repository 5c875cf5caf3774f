"""KV-cache eviction on mlx_lm's cache protocol: one implementation for B rows.

``BatchEvictionKVCache`` holds one layer's keys for B rows and keeps at most each row's
``budget`` of its document tokens, chosen by a rule (:mod:`knorm_gen.eviction.rules`: the paper's
L2Norm rule ``keep="low"``, Devoto et al., arXiv:2406.11430, KeyDiff, the question rule
and the others) through the selection arithmetic of :mod:`knorm_gen.eviction.selection`.
``EvictionKVCache`` is the same class holding one row, seen through mlx_lm's single-row
protocol (an ``int`` offset, the ``"causal"`` mask, ``trim``); as in mlx_lm's own
``KVCache`` / ``BatchKVCache``, the two name each other (``merge``, ``extract``).

What a row pins (never evicts, held on top of its budget) is given by its *spans*, the
position ranges of its document (:mod:`knorm_gen.eviction.spans`): the chat template, the system
turn, a question and the answer lie outside them (:mod:`knorm_gen.generation.prompts` finds them).

Attend first, evict after: ``update_and_fetch`` returns every kept row plus the whole
incoming block, then cuts the stored state back to each row's limit. Layout: row b's
valid tokens fill slots ``[0, counts[b])`` for every head (not in time order; attention
does not need it). After a decode step over its limit each (row, head) has one *hole*,
the slot it just evicted, which the next decode step fills in place; any other operation
first compacts the holes away. Invalid slots carry ``PAD`` rank. The mask of a batch call
is per row: the first ``counts[b]`` stored slots, then the incoming block causally.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ..platform.mlx_compat import (
    _BaseCache,
    create_attention_mask,
    is_full_attention,
    make_prompt_cache,
    register_cache_class,
)
from . import quant
from .carry import CarryGroup, extracted_group, merged_group
from .config import CACHE_BUDGET, EvictionConfig, ResolvedEviction, validate_eviction_args
from .legacy import OLD_CACHE_CLASSES, old_row_state, saved_rule
from .quant import Stored
from .rules import RULES, Rule, make_rule
from .rules.question import Probe, make_probe
from .rules.variants import VARIANTS, share_of, with_variants
from .selection import (
    PAD,
    PROTECTED,
    block_ranks,
    capacity,
    carry_slots,
    carry_tier,
    carry_values,
    evict_key,
    rank_positions,
    rescore,
)
from .spans import ALL_EVICTABLE, Spans, check_spans, evictable_from, open_ended, pin_from, pinned_count, span_array

UNBOUNDED = 1 << 40
"""The budget of a layer that stores quantized but never evicts (``kv_bits`` with
``budget=None``, or a skipped layer): more tokens than any row reaches."""

_ROW_LISTS = ("budgets", "recents", "counts", "seen", "holes", "spans", "probes", "tokens")


@register_cache_class  # load_prompt_cache rebuilds caches by class name from mlx_lm's cache module
class BatchEvictionKVCache(_BaseCache):
    """One layer's eviction cache for B rows. Every row has its own budget, recent
    window and spans (what it pins), so question rows, prompt rows and rows whose
    documents differ in length share one batch; the rule, its settings, ``n_sink``,
    carry, the variants wrapping the rule and the stored precision are the batch's.

    Over a row's limit (its budget plus the pinned tokens it has seen) each (row, KV
    head) keeps its smallest ranks: the first ``n_sink`` positions, the last
    ``recent`` ones and every pinned position first, then the tiers of the variants
    wrapping the rule that come before carry (:class:`~knorm_gen.eviction.rules.variants.Coverage`),
    then (a carrying question layer after the first) the positions the earlier layers
    scored best, then the tiers of those that come after it
    (:class:`~knorm_gen.eviction.rules.variants.Spread`), then the rule's scores, ties to
    the earlier position.
    """

    per_row_mask = True  # rows differ in what they hold: see mlx_compat.own_layer_masks

    def __init__(self, budget: int = CACHE_BUDGET, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: Union[str, Rule] = "low", batch_size: int = 0,
                 spans: Optional[Sequence[Spans]] = None, kv_bits: Optional[int] = None,
                 kv_group_size: int = EvictionConfig.kv_group_size, *, salt: int = 0,
                 budgets: Optional[Sequence[int]] = None, recents: Optional[Sequence[int]] = None,
                 **rule_settings: Any):
        rows = batch_size if spans is None else len(spans)
        budgets = [budget] * rows if budgets is None else [int(b) for b in budgets]
        recents = [recent] * rows if recents is None else [int(r) for r in recents]
        rule = _rule(keep, rule_settings)
        for b, r in zip(budgets, recents):
            validate_eviction_args(b, n_sink, r, rule.name, share_of(rule, "coverage"))
        self._settings_from(n_sink, rule, kv_bits, kv_group_size, salt)
        self.budgets, self.recents = budgets, recents
        self.spans = [ALL_EVICTABLE] * rows if spans is None else [check_spans(s) for s in spans]
        self.counts, self.seen, self.holes = [0] * rows, [0] * rows, [False] * rows
        self.probes: list[Optional[Probe]] = [None] * rows
        self.tokens: list = [object() for _ in range(rows)]  # each row's identity while it is held
        self._empty_state()

    def _settings_from(self, n_sink, rule: Rule, kv_bits, kv_group_size, salt=0) -> None:
        self.rule: Rule = rule  # the rule with its own settings and variants; the cache never asks which it is
        self.n_sink, self.keep = int(n_sink), rule.name
        self.salt = int(salt)  # the layer, so each layer draws its own spread positions
        quant.check_kv_quantization(kv_bits, kv_group_size)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        # mlx_lm's attention takes the quantized path for a cache that has ``bits``
        # (mlx_compat.QUANTIZED_ATTENTION), so a full-precision cache must not have one.
        quant.mark_for_attention(self, kv_bits, kv_group_size)

    def _empty_state(self) -> None:
        # Stored keys and values: arrays, or with kv_bits the (packed, scales, biases) triples (:mod:`.quant`).
        self.keys: Optional[Stored] = None
        self.values: Optional[Stored] = None
        # int64 per slot: (score bits << 32) | position; pinned ones are negative, empty ones PAD.
        self.rank: Optional[mx.array] = None
        self.free: Optional[mx.array] = None  # (B, H): the hole of each (row, head) after a decode step
        self.state_of_rule: Any = None  # the rule's running state over every token seen (Rule.update)
        self.group: Optional[CarryGroup] = None  # the carrying layers this one reads (carry.py)
        self.carry_board: Optional[mx.array] = None  # (B, positions): this layer's best standardised scores
        self.carry_stats: Optional[mx.array] = None  # (B, H, 3): what they were standardised by
        self._lengths: Optional[list[int]] = None  # prepare(): real tokens per row of a padded call
        self._consumed = 0
        self._probe_batch: Optional[tuple] = None  # (the probes' ids, what the rule prepared of them)
        self._spans_for = self._spans_arr = None
        self._sync_offset()

    # ---- mlx_lm batch protocol -----------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.counts)

    def _sync_offset(self) -> None:
        self.offset = mx.array(self.seen, dtype=mx.int32)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a right-padded prefill call: ``lengths`` real tokens per row."""
        if left_padding is not None and max(_as_list(left_padding), default=0) > 0:
            raise ValueError("BatchEvictionKVCache takes right-padded prompts (mlx_lm's BatchGenerator), "
                             "not left padding")
        if right_padding is not None and max(_as_list(right_padding), default=0) > 0:
            if lengths is None:
                raise ValueError("right padding needs the rows' lengths")
            self._lengths, self._consumed = _as_list(lengths), 0

    def finalize(self) -> None:
        self._lengths, self._consumed = None, 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Stored, Stored]:
        b, h, n, _ = keys.shape
        if b != self.batch_size:
            raise ValueError(f"a block of {b} rows for a cache of {self.batch_size}")
        if self.keys is None:
            self._allocate(h, keys.shape[3], values.shape[3], keys.dtype, 0)
        if n == 1 and self._lengths is None:
            return self._attention_form(*self._decode(keys, values), block=False)
        real = ([n] * b if self._lengths is None
                else [min(max(length - self._consumed, 0), n) for length in self._lengths])
        self._consumed += n
        return self._attention_form(*self._block(keys, values, real), block=True)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """Boolean ``(B, 1, N, keys)`` for the keys the next update returns."""
        counts = mx.array(self.counts, dtype=mx.int32)[:, None]
        if N == 1 and self._lengths is None:
            width = max(self.counts, default=0) + 1
            return (mx.arange(width)[None, :] < counts + 1)[:, None, None, :]
        width = max(self.counts, default=0)
        stored = mx.arange(width)[None, :] < counts  # (B, width)
        causal = mx.arange(N)[None, :] <= mx.arange(N)[:, None]  # (N, N)
        stored = mx.broadcast_to(stored[:, None, None, :], (self.batch_size, 1, N, width))
        causal = mx.broadcast_to(causal[None, None], (self.batch_size, 1, N, N))
        return mx.concatenate([stored, causal], axis=-1)

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only the given rows, in that order."""
        idx = [int(i) for i in _as_list(batch_indices)]
        sel = mx.array(idx, dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values, self.rank = quant.pick(self.keys, sel), quant.pick(self.values, sel), self.rank[sel]
            if self.free is not None:
                self.free = self.free[sel]
        for name in ("state_of_rule", "carry_board", "carry_stats"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[sel])
        for name in _ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in idx])
        self._sync_offset()

    def extend(self, other: "BatchEvictionKVCache") -> None:
        """Append the rows of ``other`` (the same settings; budgets may differ) after this cache's rows."""
        if not isinstance(other, BatchEvictionKVCache) or _settings(other) != _settings(self):
            raise ValueError("can only extend with an eviction cache of the same layer, rule (its settings and "
                             "variants), n_sink and kv_bits/kv_group_size")
        self._compact()
        other._compact()
        if other.keys is not None or self.keys is not None:
            template = self if self.keys is not None else other
            for c in (self, other):
                if c.keys is None:
                    c._allocate(*template._dims(), 0)
            cap = max(quant.slots(self.keys), quant.slots(other.keys))
            self._grow_to(cap)
            other._grow_to(cap)
            self.keys = quant.concat([self.keys, other.keys], axis=0)
            self.values = quant.concat([self.values, other.values], axis=0)
            self.rank = mx.concatenate([self.rank, other.rank])
            if self.state_of_rule is not None or other.state_of_rule is not None:
                self.state_of_rule = mx.concatenate([c._rule_state_or_zeros() for c in (self, other)])
        self._extend_carry(other)
        for name in _ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._probe_batch = None
        self._sync_offset()

    def _extend_carry(self, other: "BatchEvictionKVCache") -> None:
        if self.group is None and other.group is None:
            return
        rows = (self.batch_size, other.batch_size)
        width = max((c.carry_board.shape[-1] for c in (self, other) if c.carry_board is not None), default=0)
        boards = [_pad_board(c.carry_board, n, width) for c, n in zip((self, other), rows)]
        self.carry_board = mx.concatenate(boards) if width else None
        stats = [c.carry_stats for c in (self, other)]
        if any(s is not None for s in stats):
            heads = next(s for s in stats if s is not None).shape[1]
            self.carry_stats = mx.concatenate([mx.zeros((n, heads, 3)) if s is None else s
                                               for s, n in zip(stats, rows)])
        self.group = merged_group([self.group, other.group])
        if self.carrying:
            self.group.join(self)

    def extract(self, idx: int) -> "EvictionKVCache":
        """Row ``idx`` as a single-row :class:`EvictionKVCache`."""
        self._compact()
        single = EvictionKVCache.__new__(EvictionKVCache)
        single._settings_from(*self._settings_args())
        for name in _ROW_LISTS:
            setattr(single, name, [getattr(self, name)[idx]])
        single.holes = [False]
        single._empty_state()
        n = self.counts[idx]
        if self.keys is not None and n:
            single.keys = quant.contiguous(quant.each(lambda a: a[idx : idx + 1, :, :n], self.keys))
            single.values = quant.contiguous(quant.each(lambda a: a[idx : idx + 1, :, :n], self.values))
            single.rank = mx.contiguous(self.rank[idx : idx + 1, :, :n])
        if self.state_of_rule is not None and self.seen[idx]:
            single.state_of_rule = mx.contiguous(self.state_of_rule[idx : idx + 1])
        if self.group is not None:
            single.group = extracted_group(self.group, self.tokens[idx])
            single.carry_board = None if self.carry_board is None else self.carry_board[idx : idx + 1]
            single.carry_stats = None if self.carry_stats is None else self.carry_stats[idx : idx + 1]
            if single.carrying:
                single.group.join(single)
        return single

    @classmethod
    def merge(cls, caches: Sequence["BatchEvictionKVCache"]) -> "BatchEvictionKVCache":
        """One batch cache of the rows of ``caches`` (single-row or batch eviction caches of
        the same rule and settings; their budgets may differ)."""
        first = caches[0]
        out = BatchEvictionKVCache.__new__(BatchEvictionKVCache)  # also when called on the single-row class
        out._settings_from(*first._settings_args())
        for name in _ROW_LISTS:
            setattr(out, name, [])
        out._empty_state()
        for c in caches:
            out.extend(c)
        return out

    def _settings_args(self) -> tuple:
        return (self.n_sink, self.rule, self.kv_bits, self.kv_group_size, self.salt)

    # ---- state -------------------------------------------------------------------
    @property
    def state(self):
        meta = {"n_sink": self.n_sink, "keep": self.keep, **self.rule.settings(), "salt": self.salt,
                "kv_bits": self.kv_bits,
                "kv_group_size": self.kv_group_size, "budgets": self.budgets, "recents": self.recents,
                "counts": self.counts, "seen": self.seen, "holes": self.holes, "spans": self.spans}
        return self.keys, self.values, self.rank, self.free, self.state_of_rule, json.dumps(meta)

    @state.setter
    def state(self, v):
        # Named settings beside the arrays; a row saved as positional slots is read by the translator.
        keys, values, rank, free, rule_state, meta = (tuple(v[:5]) + (json.loads(v[5]),) if len(v) == 6 and
                                                      isinstance(v[5], str) else old_row_state(v))
        rule = with_variants(make_rule(**saved_rule(meta)), meta.get("coverage", 0.0), meta.get("spread", 0.0),
                             meta.get("stratify", 0.0))
        self._settings_from(meta["n_sink"], rule, meta.get("kv_bits"),
                            meta.get("kv_group_size", EvictionConfig.kv_group_size), meta.get("salt", 0))
        rows = len(meta["counts"])
        self.budgets = list(meta.get("budgets") or [meta["budget"]] * rows)
        self.recents = list(meta.get("recents") or [meta["recent"]] * rows)
        self.counts, self.seen = list(meta["counts"]), list(meta["seen"])
        self.holes = [bool(x) for x in meta["holes"]]
        self.spans = [check_spans(s) for s in meta["spans"]]
        self.probes, self.tokens = [None] * rows, [object() for _ in range(rows)]
        self._empty_state()
        self.keys, self.values = quant.as_stored(keys), quant.as_stored(values)
        self.rank, self.free, self.state_of_rule = rank, free, rule_state

    def size(self) -> int:
        return max(self.counts, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (key/value buffers, quantized when they are, ranks, the rule's
        running state, the probe and the carry board)."""
        if self.keys is None:
            return 0
        extra = sum(x.nbytes for x in (self.state_of_rule, self.carry_board, self.carry_stats) if x is not None)
        extra += sum(p.nbytes for p in self.probes if p is not None)
        return quant.nbytes(self.keys) + quant.nbytes(self.values) + self.rank.nbytes + extra

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    # ---- probe and carry ---------------------------------------------------------
    @property
    def bounded(self) -> bool:
        """Whether this layer evicts (False: it only stores quantized, ``budget=None`` or a skipped layer)."""
        return all(b < UNBOUNDED for b in self.budgets)

    @property
    def carrying(self) -> bool:
        """Whether this layer keeps a share of its slots for what earlier layers scored best."""
        return self.rule.carries and self.bounded

    def set_probe(self, probes: Sequence[Optional[Probe]], group: Optional[CarryGroup] = None) -> None:
        """Give each row its probe (a rule that reads one) and, when this layer carries, the
        group of the prompt's carrying layers it joins (in layer order)."""
        if len(probes) != self.batch_size:
            raise ValueError(f"{len(probes)} probes for a cache of {self.batch_size} rows")
        self.probes, self._probe_batch = list(probes), None
        self.carry_board = self.carry_stats = None
        self.group = group if self.carrying else None
        if self.group is not None:
            self.group.join(self)

    def _probe_state(self) -> Any:
        """What the rule reads from the rows' probes (:meth:`~knorm_gen.eviction.rules.base.Rule.prepare`),
        made once per set of probes; None when no row is probed."""
        if not self.rule.reads_probe or all(p is None for p in self.probes):
            return None
        if any(p is None for p in self.probes):
            raise ValueError("the rows of one batch are all probed or none is: probe every row's caches "
                             "(knorm_gen.probe_caches) before batching them")
        key = tuple(id(p) for p in self.probes)
        if self._probe_batch is None or self._probe_batch[0] != key:
            self._probe_batch = (key, self.rule.prepare(self.probes))
        return self._probe_batch[1]

    def _write_carry(self, rank: mx.array, start: Sequence[int]) -> None:
        values, self.carry_stats = carry_values(rank, self.carry_stats, self.rule.penalty)
        n = values.shape[-1]
        end = max(s + n for s in start)
        board = self.carry_board
        if board is None or board.shape[-1] < end:
            grow = end - (0 if board is None else board.shape[-1])
            pad = mx.full((self.batch_size, grow), -mx.inf, mx.float32)
            board = pad if board is None else mx.concatenate([board, pad], axis=-1)
        if len(set(start)) == 1:
            board[:, start[0] : start[0] + n] = values
        else:
            at = mx.array(list(start)).reshape(-1, 1) + mx.arange(n)[None, :]
            board = mx.put_along_axis(board, at, values, axis=-1)
        self.carry_board = board

    # ---- what selection ranks by -----------------------------------------------------
    def _limits(self) -> list[int]:
        """Tokens each row may hold now: its budget plus its pinned tokens seen."""
        return [b + pinned_count(sp, self.n_sink, s) for b, sp, s in zip(self.budgets, self.spans, self.seen)]

    def _evict_key(self, rank: mx.array) -> mx.array:
        """Ranks with each row's recent window, its variants' tiers and carried positions before its
        scores (PAD stays PAD)."""
        variants = self.rule.variants()
        reserved = [self.n_sink + r for r in self.recents]  # sinks and the recent window
        for v in variants:
            if not v.after_carry:
                slots = [v.slots(b, res) for b, res in zip(self.budgets, reserved)]
                rank = v.mark(rank, self.seen, slots, self.salt)
                reserved = [res + n for res, n in zip(reserved, slots)]
        key = evict_key(rank, self.seen, self.recents)
        carry = self.group.carried(self) if self.group is not None else None
        if carry is not None:  # a carrying layer after the first: the earlier ones' best positions next
            slots = [carry_slots(b, self.rule.carry, res) for b, res in zip(self.budgets, reserved)]
            key = carry_tier(key, carry, slots)
        for v in variants:  # the variants after carry share the slots carry shares out, not carry's own
            if v.after_carry:
                key = v.mark(key, self.seen, [v.slots(b, res) for b, res in zip(self.budgets, reserved)], self.salt)
        return key

    def _span_array(self) -> Optional[mx.array]:
        if self._spans_for != self.spans:  # built once per spans, not at every decode step of every layer
            self._spans_for, self._spans_arr = list(self.spans), span_array(self.spans)
        return self._spans_arr

    def _all_pinned(self) -> bool:
        """Whether every row pins every position it is fed from now on (asked only for a
        rule that reads a probe, the one kind that needs to know)."""
        return self.rule.reads_probe and not any(evictable_from(s, n) for s, n in zip(self.spans, self.seen))

    def _rule_state_or_zeros(self) -> mx.array:
        if self.state_of_rule is not None:
            return self.state_of_rule
        heads, dk, _, _ = self._dims()
        return self.rule.zeros(self.batch_size, heads, dk)

    def _reference(self, keys: mx.array, real: Sequence[int], spans: Optional[mx.array]) -> Any:
        """What the rule scores this block against: its running state, updated first (for a
        block of more than one token the held keys are re-scored against it), or else the
        rows' probe, or nothing."""
        self.state_of_rule = self.rule.update(self.state_of_rule, keys, self.seen, real)
        if self.state_of_rule is None:
            return self._probe_state()
        ref = self.rule.reference(self.state_of_rule, [s + r for s, r in zip(self.seen, real)])
        if max(self.counts, default=0) and any(r > 1 for r in real):  # one reference for all a block compares
            self._rescore_held(ref, real, spans)
        return ref

    def _rescore_held(self, ref: Any, real: Sequence[int], spans: Optional[mx.array]) -> None:
        """The held keys of each row fed more than one token re-scored against ``ref``."""
        self._compact()
        width = max(self.counts)
        held = self.rank[:, :, :width]
        again = rescore(self.rule, self.n_sink, self._float_keys(width), held, ref, spans)
        if not all(r > 1 for r in real):
            again = mx.where(mx.array([r > 1 for r in real])[:, None, None], again, held)
        self.rank[:, :, :width] = again

    # ---- a block ------------------------------------------------------------------------
    def _block(self, keys: mx.array, values: mx.array, real: list[int]):
        self._compact()
        spans = self._span_array()
        ref = self._reference(keys, real, spans)
        rank = block_ranks(self.rule, self.n_sink, keys, self.seen, ref, spans, pinned=self._all_pinned())
        n = keys.shape[2]
        if any(r < n for r in real):  # right padding: never kept, never counted
            rank = mx.where((mx.arange(n)[None, :] >= mx.array(real)[:, None])[:, None, :], PAD, rank)
        if self.group is not None and n > 1:  # decode tokens are never carried
            self._write_carry(rank, self.seen)
        keys, values = self._store(keys, values)
        self.seen = [s + r for s, r in zip(self.seen, real)]
        self._sync_offset()
        total = [c + r for c, r in zip(self.counts, real)]
        limits = self._limits()
        if self.batch_size == 1:
            return self._row_block(keys, values, rank, total[0], limits[0])
        return self._rows_block(keys, values, rank, total, limits)

    def _row_block(self, keys: Stored, values: Stored, rank: mx.array, total: int, limit: int):
        """One row: under its limit the block is appended; over it, the ``limit``
        smallest ranks of held + block stay, with one spare slot for a decode step."""
        if total <= limit:
            self._append(keys, values, rank)
            return quant.rows(self.keys, 0, self.counts[0]), quant.rows(self.values, 0, self.counts[0])
        count = self.counts[0]
        all_k = quant.concat([quant.rows(self.keys, 0, count), keys]) if count else keys
        all_v = quant.concat([quant.rows(self.values, 0, count), values]) if count else values
        all_r = mx.concatenate([self.rank[:, :, :count], rank], axis=2) if count else rank
        keep = mx.argpartition(self._evict_key(all_r), kth=limit - 1, axis=-1)[..., :limit]
        self.keys = quant.concat([quant.take(all_k, keep), quant.zeros(keys, 1)])
        self.values = quant.concat([quant.take(all_v, keep), quant.zeros(values, 1)])
        self.rank = mx.concatenate([mx.take_along_axis(all_r, keep, axis=-1), mx.full(rank.shape[:2] + (1,), PAD,
                                                                                       mx.int64)], axis=2)
        self.counts = [limit]
        return all_k, all_v

    def _rows_block(self, keys: Stored, values: Stored, rank: mx.array, total: list[int], limits: list[int]):
        width = max(self.counts, default=0)
        all_k = quant.concat([quant.rows(self.keys, 0, width), keys])
        all_v = quant.concat([quant.rows(self.values, 0, width), values])
        all_r = mx.concatenate([self.rank[:, :, :width], rank], axis=2)
        self.counts = [min(t, limit) for t, limit in zip(total, limits)]
        keep = max(self.counts, default=0)
        order = mx.argsort(self._evict_key(all_r), axis=-1)[..., :keep]
        self.keys = quant.take(all_k, order)
        self.values = quant.take(all_v, order)
        kept = mx.take_along_axis(all_r, order, axis=-1)
        # A row holding fewer than the widest keeps PAD in its tail slots.
        valid = mx.arange(keep)[None, :] < mx.array(self.counts)[:, None]
        self.rank = mx.where(valid[:, None, :], kept, PAD)
        return all_k, all_v

    def _append(self, keys: Stored, values: Stored, rank: mx.array) -> None:
        """One row under its limit: the block after the held slots, growing in whole steps."""
        n = rank.shape[2]
        count = self.counts[0]
        cap = quant.slots(self.keys)
        if count + n > cap:
            grows = open_ended(self.spans[0]) or not self.bounded
            grow = capacity(count + n, self._limits()[0], grows) - cap
            self.keys = quant.concat([self.keys, quant.zeros(keys, grow)])
            self.values = quant.concat([self.values, quant.zeros(values, grow)])
            self.rank = mx.concatenate([self.rank, mx.full(rank.shape[:2] + (grow,), PAD, mx.int64)], axis=2)
        quant.assign(self.keys, count, count + n, keys)
        quant.assign(self.values, count, count + n, values)
        self.rank[:, :, count : count + n] = rank
        self.counts = [count + n]

    # ---- a decode step -------------------------------------------------------------------
    def _decode(self, keys: mx.array, values: mx.array):
        slot = self._decode_slots(keys.shape[:2])
        ref = self._reference(keys, [1] * self.batch_size, None)
        rank = block_ranks(self.rule, self.n_sink, keys, self.seen, ref, self._span_array(),
                           pinned=self._all_pinned())
        keys, values = self._store(keys, values)
        at = slot[..., None, None]
        self.keys = quant.put(self.keys, at, keys)
        self.values = quant.put(self.values, at, values)
        self.rank = mx.put_along_axis(self.rank, slot[..., None], rank, axis=2)
        width = max(self.counts) + 1
        self.seen = [s + 1 for s in self.seen]
        self._sync_offset()
        out = quant.rows(self.keys, 0, width), quant.rows(self.values, 0, width)
        self._evict_one(width)
        return out

    def _decode_slots(self, shape) -> mx.array:
        """Where each (row, head) writes the decoded token: its hole, or the slot after its rows."""
        if self.batch_size == 1 and not self.holes[0]:
            slot = mx.full(shape, self.counts[0], mx.int32)
        else:
            slot = mx.broadcast_to(mx.array(self.counts, dtype=mx.int32)[:, None], shape)
            if any(self.holes):
                slot = mx.where(mx.array(self.holes)[:, None], self.free.astype(mx.int32), slot)
        need = max((c + 1 for c, hole in zip(self.counts, self.holes) if not hole), default=0)
        if need > quant.slots(self.keys):
            grows = not self.bounded or any(open_ended(s) for s in self.spans)
            self._grow_to(capacity(need, max(self._limits()) + 1, grows))
        return slot

    def _evict_one(self, width: int) -> None:
        """After attending: each (row, head) over its limit drops its worst rank into a hole."""
        before = self.counts
        limits = self._limits()
        over = [c + 1 > limit for c, limit in zip(before, limits)]
        self.counts = [limit if o else c + 1 for c, o, limit in zip(before, over, limits)]
        if any(over):
            key = self._evict_key(self.rank[:, :, :width])
            if self.batch_size > 1:
                valid = mx.arange(width)[None, :] < (mx.array(before) + 1)[:, None]  # (B, width)
                key = mx.where(valid[:, None, :], key, PROTECTED)
            victim = mx.argmax(key, axis=-1).astype(mx.uint32)  # (B, H)
            dropped = mx.put_along_axis(self.rank, victim[..., None].astype(mx.int32),
                                        mx.array(PAD, dtype=mx.int64), axis=2)
            if all(over):
                self.rank, self.free = dropped, victim
            else:
                rows = mx.array(over)[:, None]
                self.rank = mx.where(rows[..., None], dropped, self.rank)
                self.free = mx.where(rows, victim, self._free_or_zero())
        self.holes = over

    # ---- storage ------------------------------------------------------------------------
    def _attention_form(self, keys: Stored, values: Stored, block: bool) -> tuple[Stored, Stored]:
        """What attention gets, and the attribute that tells mlx_lm which attention to run.
        With kv_bits a decode step attends to the stored triples through mlx_lm's quantized
        SDPA; a block of queries attends to the same values dequantized, through the
        full-precision SDPA: the numbers quantized SDPA would use, but on this CPU
        ``mx.quantized_matmul`` with hundreds of query rows took 3.1x the prefill time of BLAS."""
        if not self.kv_bits:
            return keys, values
        if block:
            quant.mark_for_attention(self, None, self.kv_group_size)
            return (quant.dequantize(keys, self.kv_bits, self.kv_group_size),
                    quant.dequantize(values, self.kv_bits, self.kv_group_size))
        quant.mark_for_attention(self, self.kv_bits, self.kv_group_size)
        return keys, values

    def _store(self, keys: mx.array, values: mx.array) -> tuple[Stored, Stored]:
        return (quant.quantize(keys, self.kv_bits, self.kv_group_size),
                quant.quantize(values, self.kv_bits, self.kv_group_size))

    def _float_keys(self, stop: int, start: int = 0) -> mx.array:
        # What the running rules re-score: the held keys, dequantized with kv_bits.
        return quant.dequantize(quant.rows(self.keys, start, stop), self.kv_bits, self.kv_group_size)

    def _dims(self) -> tuple[int, int, int, Any]:
        """``(heads, key dim, value dim, dtype)`` the stored keys and values stand for."""
        heads = self.rank.shape[1]
        return (heads, quant.head_dim(self.keys, self.kv_bits), quant.head_dim(self.values, self.kv_bits),
                quant.dtype(self.keys))

    def _allocate(self, heads: int, dk: int, dv: int, dtype, capacity: int) -> None:
        b = self.batch_size
        self.keys = quant.empty(b, heads, capacity, dk, dtype, self.kv_bits, self.kv_group_size)
        self.values = quant.empty(b, heads, capacity, dv, dtype, self.kv_bits, self.kv_group_size)
        self.rank = mx.full((b, heads, capacity), PAD, dtype=mx.int64)

    def _grow_to(self, capacity: int) -> None:
        grow = capacity - quant.slots(self.keys)
        if grow <= 0:
            return
        b, h = self.rank.shape[:2]
        self.keys = quant.concat([self.keys, quant.zeros(self.keys, grow)])
        self.values = quant.concat([self.values, quant.zeros(self.values, grow)])
        self.rank = mx.concatenate([self.rank, mx.full((b, h, grow), PAD, dtype=mx.int64)], axis=2)

    def _free_or_zero(self) -> mx.array:
        if self.free is None:
            return mx.zeros(self.rank.shape[:2], dtype=mx.uint32)
        return self.free

    def _compact(self) -> None:
        """Close the decode holes: valid slots first, by rank (PAD sorts last)."""
        if not any(self.holes):
            return
        width = max(c + h for c, h in zip(self.counts, self.holes))
        if self.batch_size == 1:  # one row: its held slots without the hole, in slot order
            self.keys, self.values, self.rank = self.held()
        else:
            order = mx.argsort(self.rank[:, :, :width], axis=-1)
            self.keys = quant.take(quant.rows(self.keys, 0, width), order)
            self.values = quant.take(quant.rows(self.values, 0, width), order)
            self.rank = mx.take_along_axis(self.rank[:, :, :width], order, axis=-1)
        self.holes = [False] * self.batch_size
        self.free = None

    def held(self) -> tuple[Stored, Stored, mx.array]:
        """One row's held ``(keys, values, ranks)`` without its hole (stored order, not time order)."""
        count = self.counts[0]
        if not self.holes[0]:
            return quant.rows(self.keys, 0, count), quant.rows(self.values, 0, count), self.rank[:, :, :count]
        slots = mx.arange(count, dtype=mx.int32)
        idx = slots + (slots >= self.free[..., None]).astype(mx.int32)
        return quant.take(self.keys, idx), quant.take(self.values, idx), mx.take_along_axis(self.rank, idx, axis=-1)


@register_cache_class
class EvictionKVCache(BatchEvictionKVCache):
    """One row's eviction cache for one layer, on mlx_lm's single-row protocol: an ``int``
    ``offset``, the ``"causal"`` mask, ``trim`` while nothing has been evicted, and a saved
    form ``load_prompt_cache`` reads back. Built by hand it keeps the paper's ``"low"``
    rule, the one the class was first named for; :func:`make_eviction_cache` builds the
    config's. The selection is :class:`BatchEvictionKVCache`'s with one row."""

    per_row_mask = False

    def __init__(self, budget: int = CACHE_BUDGET, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: Union[str, Rule] = "low", spans: Spans = ALL_EVICTABLE,
                 kv_bits: Optional[int] = None, kv_group_size: int = EvictionConfig.kv_group_size, *,
                 salt: int = 0, **rule_settings: Any):
        super().__init__(budget, n_sink, recent, keep, spans=[spans], kv_bits=kv_bits,
                         kv_group_size=kv_group_size, salt=salt, **rule_settings)

    def _sync_offset(self) -> None:
        pass  # offset is a property of the one row

    @property
    def offset(self) -> int:
        return self.seen[0]

    @offset.setter
    def offset(self, value: int) -> None:
        self.seen = [int(value)]

    @property
    def budget(self) -> int:
        return self.budgets[0]

    @property
    def recent(self) -> int:
        return self.recents[0]

    @property
    def count(self) -> int:
        """Rows held per KV head."""
        return self.counts[0]

    @property
    def probe(self) -> Optional[Probe]:
        return self.probes[0]

    @property
    def row_spans(self) -> Spans:
        """The row's spans (the document's positions; everything else is pinned)."""
        return self.spans[0]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        # Rows are returned as (kept rows, then the block), so a mask aligned to
        # the rows held is exact; "causal" is bottom-right aligned by MLX.
        return create_attention_mask(N, offset=self.count, return_array=return_array, window_size=window_size)

    def is_trimmable(self) -> bool:
        # Trimming is only honest while nothing has been evicted: an evicted token cannot be brought back.
        return self.count == self.offset and not self.holes[0]

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self.count, n)
        if self.state_of_rule is not None and n:  # nothing was evicted: the keys left are every key seen, in order
            left = self._float_keys(self.count - n)
            self.state_of_rule = (self.rule.update(None, left, [0], [left.shape[2]]) if self.count > n else None)
        self.counts = [self.count - n]
        self.seen = [self.offset - n]
        return n

    # ---- stats ---------------------------------------------------------------
    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> int:
        return self.count

    @property
    def tokens_pinned(self) -> int:
        """Tokens held on top of the budget: pinned positions seen, the sinks aside."""
        return pinned_count(self.row_spans, self.n_sink, self.offset)

    @property
    def limit(self) -> int:
        """Tokens this cache may hold now: the budget plus the pinned tokens seen."""
        return self.budget + self.tokens_pinned

    def limit_at(self, seen: int) -> int:
        """Tokens it may hold once ``seen`` positions have been fed."""
        return self.budget + pinned_count(self.row_spans, self.n_sink, seen)

    @property
    def evictions(self) -> int:
        """Tokens evicted so far, per KV head."""
        return self.offset - self.count

    def bytes_per_position(self) -> int:
        """Key and value bytes one position takes as stored (with kv_bits: the packed
        values plus their scales and biases)."""
        if self.keys is None:
            return 0
        return quant.batch_rows(self.keys) * (quant.bytes_per_slot(self.keys) + quant.bytes_per_slot(self.values))

    def full_precision_bytes_per_position(self) -> int:
        """Key and value bytes one position takes in the model's own dtype, unquantized."""
        if self.keys is None:
            return 0
        return quant.batch_rows(self.keys) * (quant.dense_bytes_per_slot(self.keys, self.kv_bits)
                                              + quant.dense_bytes_per_slot(self.values, self.kv_bits))

    @property
    def kept_bytes(self) -> int:
        """Key and value bytes of the rows held, as stored."""
        return self.count * self.bytes_per_position()

    @property
    def full_bytes(self) -> int:
        """Key and value bytes a full-precision cache without eviction would hold for the same tokens."""
        return self.offset * self.full_precision_bytes_per_position()

    # ---- user-facing extras ---------------------------------------------------
    def pin(self) -> None:
        """Pin every later token (a question over a compressed context, and its answer)."""
        self.spans = [pin_from(self.row_spans, self.offset)]
        self.probes, self._probe_batch = [None], None  # nothing later is evictable: the probe has done its work
        self.group = self.carry_board = self.carry_stats = None

    @property
    def pinned(self) -> bool:
        """Whether every later token is pinned."""
        return open_ended(self.row_spans)

    def copy(self) -> "EvictionKVCache":
        """An independent copy (MLX writes into a shared array object would leak across copies);
        the probe, read only, is shared; the carry group is not (a copy carries nothing)."""
        new = EvictionKVCache.__new__(EvictionKVCache)
        new.state = tuple(quant.copy(x) if isinstance(x, (mx.array, tuple)) else x for x in self.state)
        new.probes = list(self.probes)
        return new

    def ordered_state(self) -> tuple[Stored, Stored, mx.array]:
        """Kept ``(keys, values, positions)`` per head, sorted by position (keys and
        values as stored: triples with kv_bits)."""
        keys, values, rank = self.held()
        pos = rank_positions(rank)
        order = mx.argsort(pos, axis=-1)
        return quant.take(keys, order), quant.take(values, order), mx.take_along_axis(pos, order, axis=-1)


def _rule(keep: Union[str, Rule], settings: dict) -> Rule:
    """``keep`` as a rule object: given as one, or by name with its settings and its variants'
    shares (``coverage=``, ``spread=``) by their keys."""
    if isinstance(keep, Rule) and settings:
        raise TypeError(f"keep={keep!r} is a rule with its settings: leave out {', '.join(settings)}")
    known = {key for cls in RULES.values() for key in cls.setting_fields()} | set(VARIANTS)
    unknown = set(settings) - known
    if unknown:
        raise TypeError(f"unknown rule setting(s) {', '.join(sorted(unknown))}; the rules' settings are "
                        f"{', '.join(sorted(known))}")
    shares = {key: settings.pop(key) for key in VARIANTS if key in settings}
    return with_variants(make_rule(keep, **settings), **shares)


def _settings(c: BatchEvictionKVCache) -> tuple:
    return (c.n_sink, c.rule, c.salt, c.kv_bits, c.kv_group_size)


def _pad_board(board: Optional[mx.array], rows: int, width: int) -> mx.array:
    if board is None:
        return mx.full((rows, width), -mx.inf, mx.float32)
    return mx.pad(board, [(0, 0), (0, width - board.shape[-1])], constant_values=-mx.inf)


def _as_list(x: Any) -> list:
    if isinstance(x, mx.array):
        return x.tolist()
    return list(x)


# A saved prompt cache may name the classes by their old names (legacy.OLD_CACHE_CLASSES).
_CLASSES = {cls.__name__: cls for cls in (EvictionKVCache, BatchEvictionKVCache)}
for _old, _new in OLD_CACHE_CLASSES.items():
    register_cache_class(_CLASSES[_new], _old)


def make_eviction_cache(model: nn.Module, config: Union[EvictionConfig, ResolvedEviction, None] = None,
                        spans: Spans = ALL_EVICTABLE) -> list:
    """A fresh per-layer cache list: the model's own caches, with each layer the
    resolved config compresses (a plain full-attention ``KVCache`` outside
    ``skip_layers``) replaced by an :class:`EvictionKVCache`. With ``kv_bits`` every
    plain full-attention layer stores quantized, the ones that keep every token
    (``budget=None``, ``skip_layers``) in an eviction cache that never evicts
    (mlx_lm's own ``QuantizedKVCache`` cannot be batched). Rotating (sliding-window)
    and non-attention caches stay as the model made them, in full precision.
    ``config`` may be given resolved (:meth:`EvictionConfig.for_model`); it is then
    taken as it is. ``spans``: the positions of the row's document (everything else is
    pinned; :func:`knorm_gen.generation.prompts.encode_with_spans`)."""
    caches = make_prompt_cache(model)
    if not isinstance(config, ResolvedEviction):
        config = (config or EvictionConfig()).for_model(model)
    if config.n_layers != len(caches):
        raise ValueError(f"these settings were resolved for a model of {config.n_layers} layers, not {len(caches)}")
    if not config.sized:
        raise ValueError(f"ratio={config.ratio:g} (the default when no budget is given) sets each layer's budget "
                         "from the document's length, which a cache made alone does not know: give a fixed budget "
                         "(EvictionConfig(budget=512)), or resolve the layout for the document first "
                         "(config.for_model(model).for_document(n_document_tokens))")
    bits, group = config.kv_bits, config.kv_group_size

    def layer(i, c, plan):
        if plan is not None:
            return EvictionKVCache(plan.budget, config.n_sink, plan.recent, config.rule_of(i), spans, bits, group,
                                   salt=i)
        if bits and is_full_attention(c):
            return EvictionKVCache(UNBOUNDED, 0, 0, "low", ALL_EVICTABLE, bits, group)
        return c

    return [layer(i, c, plan) for i, (c, plan) in enumerate(zip(caches, config.layers))]


def probed(caches: Sequence[Any]) -> bool:
    """Whether any layer of ``caches`` scores against a probe (its rule reads one: ``keep="question"``)."""
    return any(isinstance(c, BatchEvictionKVCache) and c.rule.reads_probe for c in caches)


def set_probe(caches: Sequence[Any], probe: Sequence[Optional[Probe]]) -> list:
    """Hand each single-row eviction layer whose rule reads a probe its layer's
    :class:`~knorm_gen.eviction.rules.question.Probe` (:func:`~knorm_gen.eviction.rules.question.make_probe`);
    the carrying layers among them share one :class:`~knorm_gen.eviction.carry.CarryGroup`,
    joined in layer order, the order a forward pass updates them. Returns the list."""
    if len(probe) != len(caches):
        raise ValueError(f"a probe of {len(probe)} layers for {len(caches)} caches")
    group = CarryGroup()
    for c, p in zip(caches, probe):
        if isinstance(c, EvictionKVCache) and c.rule.reads_probe:
            c.set_probe([p], group)
    return list(caches)


def probe_caches(caches: Sequence[Any], model: Any, tokenizer: Any, prompt: Sequence[int],
                 spans: Spans = ALL_EVICTABLE, questions: Sequence[Sequence[int]] = ()) -> list:
    """Probe fresh ``caches`` for the token ids ``prompt`` before it is prefilled, when
    a layer's rule needs it (the question rule, the default): the model reads the
    prompt's text after the document ``spans`` (all of it evictable: the last paragraph
    of the prompt's last :data:`~knorm_gen.eviction.rules.question.PROMPT_TAIL` tokens) and
    ``questions`` (token ids asked after it); returns the list. Any other layout is
    returned as it is, so a plain mlx_lm loop can call it for every layout::

        caches = probe_caches(make_eviction_cache(model, config), model, tokenizer, ids)
        mlx_lm.generate(model, tokenizer, ids, prompt_cache=caches)
    """
    caches = list(caches)
    if probed(caches):
        set_probe(caches, make_probe(model, tokenizer, prompt, spans, questions))
    return caches


def copy_caches(caches: Sequence[Any]) -> list:
    """Independent copies of a cache list (e.g. one compressed context, many questions)."""

    def dup(value):
        if isinstance(value, mx.array):
            return mx.array(value)
        if isinstance(value, list):
            return [dup(v) for v in value]
        return value

    out = []
    for c in caches:
        if isinstance(c, EvictionKVCache):
            out.append(c.copy())
            continue
        new = copy.copy(c)
        for name, value in vars(c).items():
            setattr(new, name, dup(value))
        out.append(new)
    return out


def pin_caches(caches: Sequence[Any]) -> list:
    """``caches`` with every later token pinned in each eviction layer (a question
    and its answer over a compressed context); returns the list."""
    for c in caches:
        if isinstance(c, EvictionKVCache):
            c.pin()
    return list(caches)
