"""KV-cache eviction on mlx_lm's cache protocol: one row, and a batch.

``EvictionKVCache`` holds one layer's keys for one row and keeps at most
``budget`` of the row's document tokens, chosen by a rule (the table in
:mod:`knorm_gen.scores`: the paper's L2Norm rule ``keep="low"``, Devoto et al.,
arXiv:2406.11430, KeyDiff, and the others); ``BatchEvictionKVCache`` the same for
B rows, and each (row, KV head) selects exactly as the single-row cache does on
that row alone. As in mlx_lm's own ``KVCache`` / ``BatchKVCache``, the two live
together and name each other (``merge``, ``extract``); the ranking and
selection arithmetic they share is in :mod:`knorm_gen.scores`.

What a row pins (never evicts, held on top of the budget) is given by its
*spans*, the position ranges of its document: the chat template, the system
turn, a question and the answer lie outside them (:mod:`knorm_gen.prompts`
finds them).

Batch layout: row b's valid tokens fill slots ``[0, counts[b])`` for every head
(the order inside is not time order; attention does not need it). After a
decode step over its limit each (row, head) has one *hole*, the slot it just
evicted, which the next decode step fills in place, as the single-row cache
does; any other operation first compacts the holes away. Invalid slots carry
``PAD`` rank. The mask of a call is per row: the first ``counts[b]`` stored
slots, then the incoming block causally. Rows may differ in length; padding is
never kept and never counted.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from .config import EvictionConfig, ResolvedEviction, validate_eviction_args
from . import quant
from .mlx_compat import _BaseCache, create_attention_mask, is_full_attention, make_prompt_cache, register_cache_class
from .quant import Stored
from . import question
from .question import make_probe
from .scores import (ALL_EVICTABLE, CARRIED, PAD, PROBED, PROTECTED, RUNNING, Spans, block_ranks, capacity,
                     carry_slots, carry_tier, carry_values, check_spans, cover_slots, evict_key, evictable_from,
                     open_ended, pin_from, pinned_count, rank_positions, rescore, running_reference, running_update,
                     running_zeros, span_array)


UNBOUNDED = 1 << 40
"""The budget of a layer that stores quantized but never evicts (``kv_bits`` with
``budget=None``, or a skipped layer): more tokens than any row reaches."""


@register_cache_class  # load_prompt_cache rebuilds caches by class name from mlx_lm's cache module
class EvictionKVCache(_BaseCache):
    """A KV cache holding at most ``budget`` evictable tokens per (batch row, KV
    head), chosen by the rule ``keep`` (:data:`knorm_gen.scores.SCORES`;
    built by hand it defaults to the paper's ``"low"``, the one the class was
    named for; :func:`make_eviction_cache` builds the config's, the question rule).

    Attend first, evict after: ``update_and_fetch`` returns every kept row plus
    the whole incoming block, then cuts the stored state back to its limit.
    Over the limit it keeps the smallest ``(score, position)`` pairs, where the
    score is the rule's: the key's L2 norm (``keep="low"``, the paper's rule),
    its negation (``"high"``), a random draw (``"random"``), the negated
    position (``"recent"``), the cosine to the head's mean unit key
    (``"keydiff"``, ``"blend"``: see :mod:`knorm_gen.scores` for the anchor), or
    minus the key's leverage against the keys seen (``"leverage"``).
    Never evicted: the first ``n_sink`` positions, the last ``recent`` ones, and
    every position outside ``spans`` (the row's document: the instructions around
    it are pinned and held on top of the budget, so the limit is ``budget`` plus
    the pinned tokens seen). ``coverage`` keeps a share of the budget evenly
    spread over the positions seen (:func:`knorm_gen.scores.cover`). Scores are
    float32; the norm rules score a token once, when it is inserted, the ones
    with running state (``scores.RUNNING``) also re-score the held keys at every block.
    """

    def __init__(self, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: str = "low", coverage: float = 0.0, spans: Spans = ALL_EVICTABLE,
                 kv_bits: Optional[int] = None, kv_group_size: int = EvictionConfig.kv_group_size):
        validate_eviction_args(budget, n_sink, recent, keep, coverage)
        self.budget, self.n_sink, self.recent, self.keep = budget, n_sink, recent, keep
        self.coverage = float(coverage)
        self.spans: Spans = check_spans(spans)
        self._set_quantization(kv_bits, kv_group_size)
        # Stored keys and values: arrays, or with kv_bits the (packed, scales, biases) triples (:mod:`.quant`).
        self.keys: Optional[Stored] = None
        self.values: Optional[Stored] = None
        # int64 per slot: (score bits << 32) | position, so one integer compare
        # ranks by score and breaks ties by position; pinned ones are negative.
        self.rank: Optional[mx.array] = None
        # A decode step over the limit leaves one logically evicted slot per head;
        # the next token is written there, so no step sorts or concatenates.
        self.free: Optional[mx.array] = None
        self.count = 0  # rows held per (batch row, head)
        self.offset = 0  # absolute positions processed (RoPE needs the true one)
        # The running state of the rules in scores.RUNNING over every token seen, float32:
        # keydiff/blend the sum of the unit keys (B, H, D), leverage its scatter, inverse and mean.
        self.key_sum: Optional[mx.array] = None
        # keep="question" (scores.PROBED): the probe of the job's instructions, (queries, pieces, repeated)
        # (set_probe), fixed; dropped when the cache is pinned, as no later token is evictable.
        self.probe: Optional[tuple[mx.array, mx.array, mx.array]] = None
        # keep="question_carry" (scores.CARRIED), set with the probe: the same prompt's earlier such layers, whose
        # best standardised score per position this layer carries, and its own (B, positions) and running stats.
        self.carry_from: Optional[list] = None
        self.carry_board: Optional[mx.array] = None
        self.carry_stats: Optional[mx.array] = None

    # ---- mlx_lm protocol -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._attention_form(*self._update(keys, values), block=keys.shape[2] > 1)

    def _update(self, keys: mx.array, values: mx.array) -> tuple[Stored, Stored]:
        n = keys.shape[2]
        anchor = None
        spans = self._span_array()
        if self.keep in PROBED:
            anchor = self.probe
        elif self.keep in RUNNING:
            self.key_sum = running_update(self.keep, self.key_sum, keys, self.offset)
            anchor = running_reference(self.keep, self.key_sum, self.offset + n)
            if n > 1 and self.keys is not None and self.count:  # one anchor for every score a block compares
                self._compact()
                held = self.rank[:, :, : self.count]
                self.rank[:, :, : self.count] = rescore(self.keep, self.n_sink, self._float_keys(self.count),
                                                        held, anchor, spans)
        # Scored in full precision, stored (and attended) quantized when kv_bits is set.
        rank = block_ranks(self.keep, self.n_sink, keys, self.offset, anchor, spans,
                           pinned=self.keep in PROBED and not evictable_from(self.spans, self.offset))
        if self.carry_from is not None and n > 1:  # decode tokens are never carried
            board, self.carry_stats = carry_values(rank, self.carry_stats)
            if self.carry_board is not None and self.carry_board.shape[-1] < self.offset:  # decoded since: none
                gap = mx.full((board.shape[0], self.offset - self.carry_board.shape[-1]), -mx.inf, mx.float32)
                self.carry_board = mx.concatenate([self.carry_board, gap], axis=-1)
            self.carry_board = board if self.carry_board is None else mx.concatenate([self.carry_board, board], -1)
        keys, values = self._store(keys, values)
        self.offset += n
        limit = self.limit
        if self.count + n <= limit:
            self._compact()
            self._append(keys, values, rank)
            return quant.rows(self.keys, 0, self.count), quant.rows(self.values, 0, self.count)
        if n == 1:
            return self._decode_over_budget(keys, values, rank)
        return self._block_over_budget(keys, values, rank, limit)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        # Rows are returned as (kept rows, then the block), so a mask aligned to
        # the rows held is exact; "causal" is bottom-right aligned by MLX.
        return create_attention_mask(N, offset=self.count, return_array=return_array, window_size=window_size)

    @property
    def state(self):
        # Slot 10 was ``pinned`` (0/1) before spans existed: kept so older saved caches load.
        return (
            self.keys, self.values, self.rank, self.free,
            self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, 0,
            self.key_sum, json.dumps(self.spans), self.coverage, self.kv_bits or 0, self.kv_group_size,
        )

    @state.setter
    def state(self, v):
        (self.keys, self.values, self.rank, self.free,
         self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, pinned) = v[:11]
        self.keys, self.values = quant.as_stored(self.keys), quant.as_stored(self.values)
        self.key_sum = v[11] if len(v) > 11 else None
        self.probe = None  # not saved: a loaded question cache takes a new one (set_probe) or stays pinned
        self.carry_from = self.carry_board = self.carry_stats = None  # nor is the board: it serves one prefill
        self._set_quantization(int(v[14]) or None if len(v) > 14 else None,
                               int(v[15]) if len(v) > 15 else EvictionConfig.kv_group_size)
        if len(v) > 12:
            self.spans, self.coverage = check_spans(json.loads(v[12])), float(v[13])
        else:  # saved before 0.3: pinned meant every token after the budget was kept
            self.coverage = 0.0
            self.spans = pin_from(ALL_EVICTABLE, self.offset - max(self.count - self.budget, 0)) if pinned \
                else ALL_EVICTABLE

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(str(x) for x in (self.count, self.offset, self.budget, self.n_sink,
                                      self.recent, self.keep, json.dumps(self.spans), self.coverage,
                                      self.kv_bits or 0, self.kv_group_size))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        count, offset, budget, n_sink, recent, keep, spans, coverage = v[:8]
        if len(v) > 8:
            self._set_quantization(int(v[8]) or None, int(v[9]))
        self.count, self.offset, self.budget = int(count), int(offset), int(budget)
        self.n_sink, self.recent, self.keep = int(n_sink), int(recent), keep
        self.spans, self.coverage = check_spans(json.loads(spans)), float(coverage)

    def size(self) -> int:
        return self.count

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (key/value buffers, quantized when they are, ranks and the rule's running state)."""
        if self.keys is None:
            return 0
        state = 0 if self.key_sum is None else self.key_sum.nbytes
        if self.probe is not None:
            state += sum(x.nbytes for x in self.probe)
        state += sum(x.nbytes for x in (self.carry_board, self.carry_stats) if x is not None)
        return quant.nbytes(self.keys) + quant.nbytes(self.values) + self.rank.nbytes + state

    def is_trimmable(self) -> bool:
        # Trimming is only honest while nothing has been evicted: an evicted
        # token cannot be brought back.
        return self.count == self.offset and self.free is None

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self.count, n)
        if self.key_sum is not None and n:  # nothing was evicted: the keys left are every key seen, in order
            left = self._float_keys(self.count - n)
            self.key_sum = running_update(self.keep, None, left, 0) if self.count > n else None
        self.count -= n
        self.offset -= n
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
        return pinned_count(self.spans, self.n_sink, self.offset)

    @property
    def limit(self) -> int:
        """Tokens this cache may hold now: the budget plus the pinned tokens seen."""
        return self.budget + self.tokens_pinned

    def limit_at(self, seen: int) -> int:
        """Tokens it may hold once ``seen`` positions have been fed."""
        return self.budget + pinned_count(self.spans, self.n_sink, seen)

    @property
    def evictions(self) -> int:
        """Tokens evicted so far, per (batch row, KV head)."""
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

    @property
    def bounded(self) -> bool:
        """Whether this layer evicts (False: it only stores quantized, ``budget=None`` or a skipped layer)."""
        return self.budget < UNBOUNDED

    # ---- user-facing extras ---------------------------------------------------
    def pin(self) -> None:
        """Pin every later token (a question over a compressed context, and its answer)."""
        self.spans = pin_from(self.spans, self.offset)
        self.probe = None  # nothing later is evictable: the probe has done its work
        self.carry_from = self.carry_board = self.carry_stats = None

    @property
    def pinned(self) -> bool:
        """Whether every later token is pinned."""
        return open_ended(self.spans)

    @classmethod
    def merge(cls, caches: Sequence["EvictionKVCache"]) -> "BatchEvictionKVCache":
        """A :class:`BatchEvictionKVCache` of these single-row caches. mlx_lm batches
        caches through ``merge``; the one inherited from ``KVCache`` would build a
        plain ``BatchKVCache`` and silently stop evicting."""
        return BatchEvictionKVCache.merge(caches)

    def copy(self) -> "EvictionKVCache":
        """An independent copy (MLX writes into a shared array object would leak across copies)."""
        new = EvictionKVCache.__new__(EvictionKVCache)
        new.state = tuple(quant.copy(x) if isinstance(x, (mx.array, tuple)) else x for x in self.state)
        new.probe = self.probe  # read only, never written into: shared
        return new

    def ordered_state(self) -> tuple[Stored, Stored, mx.array]:
        """Kept ``(keys, values, positions)`` per head, sorted by position (keys and
        values as stored: triples with kv_bits)."""
        keys, values, rank = self.held()
        pos = rank_positions(rank)
        order = mx.argsort(pos, axis=-1)
        return quant.take(keys, order), quant.take(values, order), mx.take_along_axis(pos, order, axis=-1)

    def held(self) -> tuple[Stored, Stored, mx.array]:
        """The held ``(keys, values, ranks)`` without the evicted slot (stored order,
        not time order)."""
        if self.free is None:
            return quant.rows(self.keys, 0, self.count), quant.rows(self.values, 0, self.count), \
                self.rank[:, :, : self.count]
        slots = mx.arange(self.count, dtype=mx.int32)
        idx = slots + (slots >= self.free[..., None]).astype(mx.int32)
        return quant.take(self.keys, idx), quant.take(self.values, idx), mx.take_along_axis(self.rank, idx, axis=-1)

    # ---- internals -------------------------------------------------------------
    def _set_quantization(self, bits: Optional[int], group_size: int) -> None:
        # mlx_lm's attention takes the quantized path for a cache that has ``bits``
        # (mlx_compat.QUANTIZED_ATTENTION), so a full-precision cache must not have one.
        quant.check_kv_quantization(bits, group_size)
        self.kv_bits, self.kv_group_size = bits, group_size
        quant.mark_for_attention(self, bits, group_size)

    def _dims(self) -> tuple[int, int, int, Any]:
        return _dims(self)

    def _attention_form(self, keys: Stored, values: Stored, block: bool) -> tuple[Stored, Stored]:
        """What attention gets, and the attribute that tells mlx_lm which attention to run.
        With kv_bits a decode step attends to the stored triples through mlx_lm's quantized
        SDPA; a block of queries attends to the same values dequantized, through the
        full-precision SDPA: the numbers quantized SDPA would use, but on this CPU
        ``mx.quantized_matmul`` with hundreds of query rows took 3.1x the prefill time
        of BLAS (benchmarks/bench_summarize.py, docs/results.md)."""
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
        # What the anchored rules re-score: the held keys, dequantized with kv_bits.
        return quant.dequantize(quant.rows(self.keys, start, stop), self.kv_bits, self.kv_group_size)

    def _span_array(self) -> Optional[mx.array]:
        # Built once per spans, not at every decode step of every layer.
        if getattr(self, "_spans_for", None) != self.spans:
            self._spans_for, self._spans_arr = self.spans, span_array([self.spans])
        return self._spans_arr

    @property
    def _cover_slots(self) -> int:
        return cover_slots(self.budget, self.coverage, self.n_sink + self.recent)

    def _evict_key(self, rank: mx.array) -> mx.array:
        key = evict_key(rank, self.offset, self.recent, self._cover_slots)
        boards = [c.carry_board for c in self.carry_from or () if c.carry_board is not None]
        if boards:  # a question_carry layer after the first: the earlier ones' best positions next
            width = min(x.shape[-1] for x in boards)
            carry = boards[0][:, :width]
            for x in boards[1:]:
                carry = mx.maximum(carry, x[:, :width])
            share = carry_slots(self.budget, question.CARRY_SHARE, self.n_sink + self.recent + self._cover_slots)
            key = carry_tier(key, carry, share)
        return key

    def _compact(self) -> None:
        if self.free is not None:
            self.keys, self.values, self.rank = self.held()
            self.free = None

    def _append(self, keys, values, rank) -> None:
        n = rank.shape[2]
        cap = 0 if self.keys is None else quant.slots(self.keys)
        if self.count + n > cap:
            b, h = rank.shape[:2]
            grow = capacity(self.count + n, self.limit, self.pinned or not self.bounded) - cap
            new = (quant.zeros(keys, grow), quant.zeros(values, grow), mx.zeros((b, h, grow), mx.int64))
            if self.keys is None:
                self.keys, self.values, self.rank = new
            else:
                self.keys = quant.concat([self.keys, new[0]])
                self.values = quant.concat([self.values, new[1]])
                self.rank = mx.concatenate([self.rank, new[2]], axis=2)
        start, self.count = self.count, self.count + n
        quant.assign(self.keys, start, self.count, keys)
        quant.assign(self.values, start, self.count, values)
        self.rank[:, :, start : self.count] = rank

    def _decode_over_budget(self, keys, values, rank):
        # Here count == limit: the spare slot after them takes the token.
        rows = self.count + 1
        if self.free is None:
            if quant.slots(self.keys) < rows:
                self._append(keys, values, rank)  # fills the spare slot
                self.count -= 1
            else:
                quant.assign(self.keys, self.count, rows, keys)
                quant.assign(self.values, self.count, rows, values)
                self.rank[:, :, self.count : rows] = rank
        else:
            slot = self.free[..., None, None]
            self.keys = quant.put(self.keys, slot, keys)
            self.values = quant.put(self.values, slot, values)
            self.rank = mx.put_along_axis(self.rank, slot[..., 0], rank.reshape(slot.shape[:-1]), axis=2)
        # Evict after attending: the largest rank leaves; its slot takes the next token.
        self.free = mx.argmax(self._evict_key(self.rank[:, :, :rows]), axis=-1)
        return quant.rows(self.keys, 0, rows), quant.rows(self.values, 0, rows)

    def _block_over_budget(self, keys, values, rank, limit: int):
        if self.keys is None:
            all_k, all_v, all_r = keys, values, rank
        else:
            hk, hv, hr = self.held()
            all_k, all_v = quant.concat([hk, keys]), quant.concat([hv, values])
            all_r = mx.concatenate([hr, rank], axis=2)
        keep = mx.argpartition(self._evict_key(all_r), kth=limit - 1, axis=-1)[..., :limit]
        b, h = rank.shape[:2]
        self.keys = quant.concat([quant.take(all_k, keep), quant.zeros(keys, 1)])
        self.values = quant.concat([quant.take(all_v, keep), quant.zeros(values, 1)])
        self.rank = mx.concatenate([mx.take_along_axis(all_r, keep, axis=-1), mx.zeros((b, h, 1), mx.int64)], axis=2)
        self.count, self.free = limit, None
        return all_k, all_v


@register_cache_class
class BatchEvictionKVCache(_BaseCache):
    """One layer's eviction cache for a batch of rows (see the module docstring).
    Each row has its own spans (what it pins), so question rows, prompt rows and
    rows whose instructions differ share one batch."""

    per_row_mask = True  # rows differ in what they hold: see mlx_compat.own_layer_masks

    def __init__(self, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: str = "low", coverage: float = 0.0,
                 batch_size: int = 0, spans: Optional[Sequence[Spans]] = None,
                 kv_bits: Optional[int] = None, kv_group_size: int = EvictionConfig.kv_group_size):
        validate_eviction_args(budget, n_sink, recent, keep, coverage)
        self.budget, self.n_sink, self.recent, self.keep = budget, n_sink, recent, keep
        self.coverage = float(coverage)
        self.spans: list[Spans] = ([ALL_EVICTABLE] * batch_size if spans is None
                                   else [check_spans(s) for s in spans])
        self._set_quantization(kv_bits, kv_group_size)
        self.keys: Optional[Stored] = None  # (B, H, capacity, D), or its quantized triple
        self.values: Optional[Stored] = None
        self.rank: Optional[mx.array] = None  # (B, H, capacity) int64
        self.counts: list[int] = [0] * len(self.spans)  # valid slots per row
        self.seen: list[int] = [0] * len(self.spans)  # true positions per row (RoPE offset)
        self.holes: list[bool] = [False] * len(self.spans)
        self.free: Optional[mx.array] = None  # (B, H) the hole of each (row, head)
        self._lengths: Optional[list[int]] = None  # prepare(): real tokens per row, padded call
        self._consumed = 0
        self.key_sum: Optional[mx.array] = None  # each row's running state (scores.RUNNING), as EvictionKVCache
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

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
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
        if self.keys is not None:
            sel = mx.array(idx, dtype=mx.int32)
            self.keys, self.values, self.rank = quant.pick(self.keys, sel), quant.pick(self.values, sel), self.rank[sel]
            if self.key_sum is not None:
                self.key_sum = self.key_sum[sel]
            if self.free is not None:
                self.free = self.free[sel]
        for name in _ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in idx])
        self._sync_offset()

    def extend(self, other: "BatchEvictionKVCache") -> None:
        """Append the rows of ``other`` (same settings) after this cache's rows."""
        if not isinstance(other, BatchEvictionKVCache) or _settings(other) != _settings(self):
            raise ValueError("can only extend with a BatchEvictionKVCache of the same settings")
        if other.keys is not None or self.keys is not None:
            template = self if self.keys is not None else other
            for c in (self, other):
                if c.keys is None:
                    c._allocate(*template._dims(), 0)
            cap = max(quant.slots(self.keys), quant.slots(other.keys))
            self._grow_to(cap)
            other._grow_to(cap)
            self.free = mx.concatenate([self._free_or_zero(), other._free_or_zero()])
            self.keys = quant.concat([self.keys, other.keys], axis=0)
            self.values = quant.concat([self.values, other.values], axis=0)
            self.rank = mx.concatenate([self.rank, other.rank])
            if self.key_sum is not None:
                self.key_sum = mx.concatenate([self.key_sum, other.key_sum])
        for name in _ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._sync_offset()

    def extract(self, idx: int) -> EvictionKVCache:
        """Row ``idx`` as a single-row :class:`EvictionKVCache`."""
        self._compact()
        single = EvictionKVCache(self.budget, self.n_sink, self.recent, self.keep, self.coverage, self.spans[idx],
                                 self.kv_bits, self.kv_group_size)
        single.offset, single.count = self.seen[idx], self.counts[idx]
        n = self.counts[idx]
        if self.keys is not None and n:
            single.keys = quant.contiguous(quant.each(lambda a: a[idx : idx + 1, :, :n], self.keys))
            single.values = quant.contiguous(quant.each(lambda a: a[idx : idx + 1, :, :n], self.values))
            single.rank = mx.contiguous(self.rank[idx : idx + 1, :, :n])
        if self.key_sum is not None and self.seen[idx]:
            single.key_sum = mx.contiguous(self.key_sum[idx : idx + 1])
        return single

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchEvictionKVCache":
        """One batch cache from single-row ``EvictionKVCache`` layers of the same settings."""
        first = caches[0]
        if any(_settings(c) != _settings(first) for c in caches):
            raise ValueError("cannot batch eviction caches with different budget/n_sink/recent/keep/coverage/"
                             "kv_bits/kv_group_size")
        out = cls(first.budget, first.n_sink, first.recent, first.keep, first.coverage, batch_size=len(caches),
                  spans=[c.spans for c in caches], kv_bits=first.kv_bits, kv_group_size=first.kv_group_size)
        held = [c for c in caches if not c.empty() and c.count]
        out.seen = [c.offset for c in caches]
        out.counts = [0 if c.empty() else c.count for c in caches]
        out._sync_offset()
        if not held:
            return out
        k0, v0 = held[0].keys, held[0].values
        width = max(out.counts)
        heads, dk, dv, dt = held[0]._dims()
        out._allocate(heads, dk, dv, dt, width)
        keys, values, ranks = [], [], []
        for c, n in zip(caches, out.counts):
            if n:
                k, v, r = c.held()
            else:
                k, v, r = quant.zeros(k0, 0, batch=1), quant.zeros(v0, 0, batch=1), mx.zeros((1, heads, 0), mx.int64)
            pad = width - n
            keys.append(quant.pad(k, pad))
            values.append(quant.pad(v, pad))
            ranks.append(mx.pad(r, [(0, 0), (0, 0), (0, pad)], constant_values=PAD))
        out.keys, out.values = quant.concat(keys, axis=0), quant.concat(values, axis=0)
        out.rank = mx.concatenate(ranks)
        if out.key_sum is not None:
            zero = running_zeros(out.keep, 1, heads, dk)
            out.key_sum = mx.concatenate([zero if c.key_sum is None else c.key_sum for c in caches])
        return out

    @property
    def state(self):
        """Every array the cache holds and, as JSON, its settings and per-row
        bookkeeping (counts, positions, holes, spans): a saved and loaded batch
        cache continues exactly as the one saved."""
        meta = {"budget": self.budget, "n_sink": self.n_sink, "recent": self.recent, "keep": self.keep,
                "coverage": self.coverage, "counts": self.counts, "seen": self.seen, "holes": self.holes,
                "spans": [list(map(list, s)) for s in self.spans], "kv_bits": self.kv_bits,
                "kv_group_size": self.kv_group_size}
        return self.keys, self.values, self.rank, self.free, self.key_sum, json.dumps(meta)

    @state.setter
    def state(self, v):
        if len(v) != 6:
            raise ValueError("this batch eviction cache was saved before 0.3, without its rows' counts and "
                             "settings, so it cannot be restored; extract() its rows into single-row caches "
                             "before saving")
        self.keys, self.values, self.rank, self.free, self.key_sum, meta = v
        self.keys, self.values = quant.as_stored(self.keys), quant.as_stored(self.values)
        meta = json.loads(meta)
        self._set_quantization(meta.get("kv_bits"), meta.get("kv_group_size", EvictionConfig.kv_group_size))
        self.budget, self.n_sink, self.recent, self.keep = meta["budget"], meta["n_sink"], meta["recent"], meta["keep"]
        self.coverage = float(meta["coverage"])
        self.counts, self.seen = list(meta["counts"]), list(meta["seen"])
        self.holes = [bool(x) for x in meta["holes"]]
        self.spans = [check_spans(s) for s in meta["spans"]]
        self._lengths, self._consumed = None, 0
        self._sync_offset()

    def size(self) -> int:
        return max(self.counts, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        state = 0 if self.key_sum is None else self.key_sum.nbytes
        return quant.nbytes(self.keys) + quant.nbytes(self.values) + self.rank.nbytes + state

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    # ---- internals -------------------------------------------------------------
    def _limits(self) -> list[int]:
        """Tokens each row may hold now: the budget plus its pinned tokens seen."""
        return [self.budget + pinned_count(sp, self.n_sink, s) for sp, s in zip(self.spans, self.seen)]

    _set_quantization = EvictionKVCache._set_quantization
    _attention_form = EvictionKVCache._attention_form
    _store = EvictionKVCache._store
    _float_keys = EvictionKVCache._float_keys

    def _dims(self) -> tuple[int, int, int, Any]:
        return _dims(self)

    def _allocate(self, heads: int, dk: int, dv: int, dtype, capacity: int) -> None:
        b = self.batch_size
        self.keys = quant.empty(b, heads, capacity, dk, dtype, self.kv_bits, self.kv_group_size)
        self.values = quant.empty(b, heads, capacity, dv, dtype, self.kv_bits, self.kv_group_size)
        self.rank = mx.full((b, heads, capacity), PAD, dtype=mx.int64)
        if self.keep in RUNNING:
            self.key_sum = running_zeros(self.keep, b, heads, dk)

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
        order = mx.argsort(self.rank[:, :, :width], axis=-1)
        self.keys = quant.take(quant.rows(self.keys, 0, width), order)
        self.values = quant.take(quant.rows(self.values, 0, width), order)
        self.rank = mx.take_along_axis(self.rank[:, :, :width], order, axis=-1)
        self.holes = [False] * self.batch_size
        self.free = None

    def _all_pinned(self) -> bool:
        """Whether every row pins every position it is fed from now on (asked only for a
        rule in PROBED, the one rule that needs to know)."""
        return self.keep in PROBED and not any(evictable_from(s, seen) for s, seen in zip(self.spans, self.seen))

    def _decode(self, keys: mx.array, values: mx.array):
        counts = mx.array(self.counts, dtype=mx.int32)
        slot = mx.broadcast_to(counts[:, None], keys.shape[:2])
        if any(self.holes):
            slot = mx.where(mx.array(self.holes)[:, None], self.free.astype(mx.int32), slot)
        need = max((c + 1 for c, hole in zip(self.counts, self.holes) if not hole), default=0)
        if need > quant.slots(self.keys):
            self._grow_to(capacity(need, max(self._limits()) + 1,
                                   self.budget >= UNBOUNDED or any(open_ended(s) for s in self.spans)))
        anchor = None
        if self.key_sum is not None:
            self.key_sum = running_update(self.keep, self.key_sum, keys, self.seen)
            anchor = running_reference(self.keep, self.key_sum, [s + 1 for s in self.seen])
        rank = block_ranks(self.keep, self.n_sink, keys, mx.array(self.seen, dtype=mx.int64), anchor,
                           span_array(self.spans), pinned=self._all_pinned())
        keys, values = self._store(keys, values)
        at = slot[..., None, None]
        self.keys = quant.put(self.keys, at, keys)
        self.values = quant.put(self.values, at, values)
        self.rank = mx.put_along_axis(self.rank, slot[..., None], rank, axis=2)
        width = max(self.counts) + 1
        self.seen = [s + 1 for s in self.seen]
        self._sync_offset()
        out = quant.rows(self.keys, 0, width), quant.rows(self.values, 0, width)
        # Evict after attending: each (row, head) over its limit drops its worst rank into a hole.
        limits = self._limits()
        over = [c + 1 > limit for c, limit in zip(self.counts, limits)]
        self.counts = [limit if o else c + 1 for c, o, limit in zip(self.counts, over, limits)]
        if any(over):
            valid = mx.arange(width)[None, :] < (counts + 1)[:, None]  # (B, width)
            key = self._evict_key(self.rank[:, :, :width])
            key = mx.where(valid[:, None, :], key, PROTECTED)
            victim = mx.argmax(key, axis=-1).astype(mx.uint32)  # (B, H)
            over_rows = mx.array(over)[:, None]
            dropped = mx.put_along_axis(self.rank, victim[..., None].astype(mx.int32),
                                        mx.array(PAD, dtype=mx.int64), axis=2)
            self.rank = mx.where(over_rows[..., None], dropped, self.rank)
            self.free = mx.where(over_rows, victim, self._free_or_zero())
        self.holes = over
        return out

    def _evict_key(self, rank: mx.array) -> mx.array:
        """Ranks with each row's recent window and coverage positions protected (PAD stays PAD)."""
        return evict_key(rank, self.seen, self.recent, cover_slots(self.budget, self.coverage,
                                                                   self.n_sink + self.recent))

    def _block(self, keys: mx.array, values: mx.array, real: list[int]):
        self._compact()
        b, h, n, _ = keys.shape
        width = max(self.counts, default=0)
        spans = span_array(self.spans)
        anchor = None
        if self.key_sum is not None:
            self.key_sum = running_update(self.keep, self.key_sum, keys, self.seen, real)
            anchor = running_reference(self.keep, self.key_sum, [s + r for s, r in zip(self.seen, real)])
            if width and any(r > 1 for r in real):  # as a row alone: held keys re-scored when >1 token arrives
                held = self.rank[:, :, :width]
                again = rescore(self.keep, self.n_sink, self._float_keys(width), held, anchor, spans)
                self.rank[:, :, :width] = mx.where(mx.array([r > 1 for r in real])[:, None, None], again, held)
        rank = block_ranks(self.keep, self.n_sink, keys, mx.array(self.seen, dtype=mx.int64), anchor, spans,
                           pinned=self._all_pinned())
        if any(r < n for r in real):  # right padding: never kept, never counted
            is_pad = mx.arange(n)[None, :] >= mx.array(real)[:, None]
            rank = mx.where(is_pad[:, None, :], PAD, rank)
        keys, values = self._store(keys, values)
        all_k = quant.concat([quant.rows(self.keys, 0, width), keys])
        all_v = quant.concat([quant.rows(self.values, 0, width), values])
        all_r = mx.concatenate([self.rank[:, :, :width], rank], axis=2)
        self.seen = [s + r for s, r in zip(self.seen, real)]
        self._sync_offset()
        total = [c + r for c, r in zip(self.counts, real)]
        self.counts = [min(t, limit) for t, limit in zip(total, self._limits())]
        keep = max(self.counts, default=0)
        order = mx.argsort(self._evict_key(all_r), axis=-1)[..., :keep]
        self.keys = quant.take(all_k, order)
        self.values = quant.take(all_v, order)
        kept = mx.take_along_axis(all_r, order, axis=-1)
        # A row holding fewer than the widest keeps PAD in its tail slots.
        valid = mx.arange(keep)[None, :] < mx.array(self.counts)[:, None]
        self.rank = mx.where(valid[:, None, :], kept, PAD)
        return all_k, all_v


_ROW_LISTS = ("counts", "seen", "holes", "spans")


def _settings(c: Any) -> tuple:
    return (c.budget, c.n_sink, c.recent, c.keep, c.coverage, c.kv_bits, c.kv_group_size)


def _dims(c: Any) -> tuple[int, int, int, Any]:
    """``(heads, key dim, value dim, dtype)`` a cache's stored keys and values stand for."""
    heads = c.rank.shape[1]
    return (heads, quant.head_dim(c.keys, c.kv_bits), quant.head_dim(c.values, c.kv_bits), quant.dtype(c.keys))


# The names before 0.3, when the cache held one rule: saved prompt caches name them.
L2NormKVCache = EvictionKVCache
BatchL2NormKVCache = BatchEvictionKVCache
register_cache_class(EvictionKVCache, "L2NormKVCache")
register_cache_class(BatchEvictionKVCache, "BatchL2NormKVCache")


def _as_list(x: Any) -> list:
    if isinstance(x, mx.array):
        return x.tolist()
    return list(x)


def make_eviction_cache(model: nn.Module, config: Union[EvictionConfig, ResolvedEviction, None] = None,
                        spans: Spans = ALL_EVICTABLE) -> list:
    """A fresh per-layer cache list: the model's own caches, with each layer the
    resolved config compresses (a plain full-attention ``KVCache`` outside
    ``skip_layers``) replaced by an :class:`EvictionKVCache`. With ``kv_bits`` every
    plain full-attention layer stores quantized, the ones that keep every token
    (``budget=None``, ``skip_layers``) in an eviction cache that never evicts
    (mlx_lm's own ``QuantizedKVCache`` cannot be batched). Rotating
    (sliding-window) and non-attention caches stay as the model made them, in full
    precision. ``config`` may be given
    resolved (:meth:`EvictionConfig.for_model`); it is then taken as it is.
    ``spans``: the positions of the row's document (everything else is pinned;
    :func:`knorm_gen.prompts.encode_with_spans`)."""
    caches = make_prompt_cache(model)
    if not isinstance(config, ResolvedEviction):
        config = (config or EvictionConfig()).for_model(model)
    if config.n_layers != len(caches):
        raise ValueError(f"these settings were resolved for a model of {config.n_layers} layers, not {len(caches)}")
    bits, group = config.kv_bits, config.kv_group_size

    def layer(i, c, plan):
        if plan is not None:
            return EvictionKVCache(plan[0], config.n_sink, plan[1], config.keep_of(i), config.coverage, spans, bits,
                                   group)
        if bits and is_full_attention(c):
            return EvictionKVCache(UNBOUNDED, 0, 0, "low", 0.0, ALL_EVICTABLE, bits, group)
        return c

    return [layer(i, c, plan) for i, (c, plan) in enumerate(zip(caches, config.layers))]


def set_probe(caches: Sequence[Any], probe: Sequence[tuple[mx.array, mx.array, mx.array]]) -> list:
    """Hand each eviction layer whose rule is in :data:`~knorm_gen.scores.PROBED`
    (``keep="question"``) its layer's probe (:func:`knorm_gen.question.make_probe`);
    returns the list. The ``question_carry`` layers (:data:`~knorm_gen.scores.CARRIED`)
    are linked in layer order, the order a forward pass updates them: each carries the
    earlier ones' best positions (:func:`knorm_gen.scores.carry_tier`)."""
    if len(probe) != len(caches):
        raise ValueError(f"a probe of {len(probe)} layers for {len(caches)} caches")
    carriers: list = []
    for c, p in zip(caches, probe):
        if isinstance(c, EvictionKVCache) and c.keep in PROBED:
            c.probe = p
            if c.keep in CARRIED and c.bounded:
                c.carry_from, c.carry_board, c.carry_stats = list(carriers), None, None
                carriers.append(c)
    return list(caches)


def probed(caches: Sequence[Any]) -> bool:
    """Whether any layer of ``caches`` scores against a probe (``keep="question"``)."""
    return any(isinstance(c, EvictionKVCache) and c.keep in PROBED for c in caches)


def probe_caches(caches: Sequence[Any], model: Any, tokenizer: Any, prompt: Sequence[int],
                 spans: Spans = ALL_EVICTABLE, questions: Sequence[Sequence[int]] = ()) -> list:
    """Probe fresh ``caches`` for the token ids ``prompt`` before it is prefilled, when
    a layer's rule needs it (the question rules, the default among them): the model reads the
    prompt's text after the document ``spans`` (all of it evictable: the last paragraph
    of the prompt's last :data:`~knorm_gen.question.PROMPT_TAIL` tokens) and ``questions`` (token ids
    asked after it); returns the list. Any other layout is returned as it is, so a
    plain mlx_lm loop can call it for every layout::

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
