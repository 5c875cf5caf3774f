"""The ``question`` rule: keep the document keys the job's own instructions would attend to.

Every intrinsic rule (the key's norm, KeyDiff, leverage) lost keys planted in real
prose, which the same layout kept once they were pinned (docs/results.md, "Keys in
real prose"): a sentence that does not stand out from its neighbours is lost by
selection. This rule knows what the job asks. ``benchmarks/question_probe.py``
measured it. What it does, in order:

1. :func:`probe_queries`: before the document is prefilled, the model runs the
   template before the document, then the pinned text after it (instructions, the
   question) at its true RoPE positions, then ``draft`` tokens it answers with no
   document; the queries of those tokens are recorded per layer.
2. :func:`segment_ids`: the prompt cut into sentence pieces (a piece ends after a
   token with a sentence end or a line break in it, or after ``longest`` tokens).
3. :func:`question_scores`: a key's score is its largest dot product with a unit
   probe query of its KV head's group, less the mean score within ``local``
   positions (RoPE's decay with distance would otherwise favour the late keys),
   and every token of a piece takes the piece's best score, so a hit keeps its
   whole sentence (the digits after "The pass key is").

:func:`make_probe` runs 1 and 2 for a prompt and its document's positions; the
caches hold the result (:func:`knorm_gen.cache.set_probe`) and score each block
against it (:func:`knorm_gen.scores.score_question`). It works best with questions asked
apart from the document (``answer_questions``, question rows); a prompt is probed by the
text after its document and the last paragraph of the document's last :data:`PROMPT_TAIL`
tokens (all of them when they hold no blank line): a question written after the text.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from .mlx_compat import (KVCache, ProbeCache, RotatingKVCache, UnsupportedModelError, architecture,
                          make_prompt_cache, record_queries)

PROBE_DRAFT = 8
"""Tokens the model answers with no document during the probe (their queries join the question's)."""

SEGMENT_TOKENS = 16
"""The longest sentence piece: 8 split "The pass key is 81313." and lost most keys; 16 and 32 kept them."""

LOCAL = 64
"""Positions either side whose mean score a key's score is measured against (0: none)."""

DETREND = False
"""Take each block's least-squares line over its positions out of its scores instead of
the local mean (``question_scores(detrend=True)``, ``choose_default.py --trend line``):
measured in 0.9.1 (docs/results.md) and not kept; the mean within :data:`LOCAL` positions
holds a sentence's own scores, a line over a block barely moves for one sentence."""

PER_QUERY = False
"""Take each probe query's own mean within :data:`LOCAL` positions out of its dot products
before the best query is taken (``question_scores(per_query=True)``, ``choose_default.py
--trend query``): a broad query (one that scores whole regions high) then no longer decides
the selection alone. Measured in 0.9.2 (docs/results.md): Gemma 3 found more keys, SmolLM2
fewer, so it is the rule ``keep="question_per_query"`` (a ``knorm-tune`` candidate), not the
default; this switch makes ``keep="question"`` score that way too (the benchmarks' ``--trend query``)."""

PER_QUERY_LOCAL = 128
"""The reach of ``keep="question_per_query"``'s per-query local mean (0.9.3; 0.9.2 used
:data:`LOCAL`, 64). Measured against 64 through the product's prefill (docs/results.md,
0.9.3): SmolLM2 kept 41 of the full cache's 46 held-out keys (64: 39), Gemma 3 36/36 held out
(64: 36) and 14 of 16 on five fresh READMEs (64: 13), and Gemma 3's summary of six fresh
READMEs recovered 83.6% (64: 78.4%)."""

CARRY_SHARE = 0.25
"""The share of a carrying layer's rule slots (``keep="question_carry"``, ``"question_per_query_carry"``,
``"question_both_carry"``; the budget less its sinks, recent window and coverage) kept for
the positions the earlier such layers of the prompt scored best (:func:`knorm_gen.scores.carry_tier`; 0.10). On Gemma 3 the first bounded
layer ranked a lost key's sentence near its top and a later layer dropped it
(docs/results.md, 0.9.3); carried, every later layer keeps what an earlier one found."""

REPEAT_SHORTEST = 4
"""A sentence piece of at least this many tokens that repeats an earlier piece token for token
ranks after every piece that does not (:func:`repeated_pieces`): shorter ones (a line break, a
code fence) repeat in any text."""

REPEAT_PENALTY = 1e5
"""Taken from a repeated piece's score: more than any score spans (a unit query's dot product
is at most the key's norm), so such pieces rank after the rest and still in their own order."""

PROBE_SINK = 4
"""A prompt probed without questions always runs its first tokens, as the cache always keeps its
sinks: without a BOS or the template's start (a prompt all evictable) the probe lost every key on SmolLM2."""

PROMPT_TAIL = 64
"""Without questions asked apart, the document's last tokens the probe reads too: a prompt's own
question sits there (in a chat prompt the user's whole text is the document)."""


def _probe_caches(model: Any) -> list:
    """The model's own caches with every attention layer (plain or sliding-window) a
    :class:`~knorm_gen.mlx_compat.ProbeCache`; state-space layers keep their own."""
    return [ProbeCache(i) if isinstance(c, (KVCache, RotatingKVCache)) else c
            for i, c in enumerate(make_prompt_cache(model))]


def _run_probe(model: Any, ids: list, start: int, end: int, after: list, draft: int,
               one_by_one: bool) -> tuple[dict, set, list]:
    caches = _probe_caches(model)

    def feed(tokens):
        out = None
        for block in ([[t] for t in tokens] if one_by_one else [tokens]):
            out = model(mx.array(block)[None], cache=caches)
        return out

    with record_queries(model, caches) as seen:
        if start:
            feed(ids[:start])
        for c in caches:
            if isinstance(c, ProbeCache):
                seen.close(c)
                c.offset = end
        seen.clear()
        logits = feed(after)
        for _ in range(draft):
            logits = model(mx.array([[int(mx.argmax(logits[0, -1]).item())]]), cache=caches)
    return seen.queries, seen.other, caches


def probe_queries(model: Any, ids: Sequence[int], start: int, end: int, question_ids: Sequence[int] = (),
                  draft: int = PROBE_DRAFT) -> list[Optional[mx.array]]:
    """Per layer, ``(1, KV heads, group x probe tokens, head dim)`` unit-length float32
    queries of the prompt's tokens after the document (``ids[end:]``) and
    ``question_ids``, at their true positions, then of ``draft`` greedy tokens;
    ``ids[:start]`` (before the document) is attended but not recorded, and the
    document ``ids[start:end]`` is not run at all. None for a layer without attention.
    A model whose prefill attends with keys other than those its cache stores
    (multi-head latent attention) is probed one token at a time, the form in which it
    attends with them; :class:`~knorm_gen.mlx_compat.UnsupportedModelError` when no
    layer's queries can be read."""
    ids = [int(t) for t in ids]
    if not 0 <= start <= end <= len(ids):
        raise ValueError(f"the document's span [{start}, {end}) does not lie in a prompt of {len(ids)} tokens")
    after = ids[end:] + [int(t) for t in question_ids]
    if not after:
        raise ValueError("nothing after the document to probe: the instructions or a question must follow it")
    queries, other, caches = _run_probe(model, ids, start, end, after, draft, one_by_one=False)
    attention = [c.layer for c in caches if isinstance(c, ProbeCache)]
    if other or any(len(queries.get(i, ())) != 1 + draft for i in attention):
        queries, other, caches = _run_probe(model, ids, start, end, after, draft, one_by_one=True)
    missing = [i for i in attention if not queries.get(i)]
    if missing:
        raise UnsupportedModelError(
            f"{architecture(model)}: the question probe cannot read the queries of layers {missing} (its attention "
            f"goes neither through mlx_lm's scaled_dot_product_attention nor through a rope module with the keys "
            f"its cache stores); choose a layout that needs no probe, e.g. --preset intrinsic")
    out: list[Optional[mx.array]] = []
    for c in caches:
        if not isinstance(c, ProbeCache):
            out.append(None)
            continue
        q = mx.concatenate(queries[c.layer], axis=2).astype(mx.float32)
        b, hq, m, d = q.shape
        hk = c.keys.shape[1]
        q = q.reshape(b, hk, (hq // hk) * m, d)  # a KV head's group, every probe token
        out.append(q * mx.rsqrt(mx.maximum(mx.sum(q * q, axis=-1, keepdims=True), 1e-30)))
    return out


def segment_ids(tokenizer: Any, ids: Sequence[int], longest: int = SEGMENT_TOKENS) -> np.ndarray:
    """A piece number per token of ``ids``: a piece ends after a token whose text
    holds ``.``, ``!``, ``?`` or a line break, or after ``longest`` tokens."""
    if longest < 1:
        raise ValueError(f"longest={longest}: a piece holds at least one token")
    out = np.zeros(len(ids), dtype=np.int64)
    piece = run = 0
    for i, t in enumerate(ids):
        out[i] = piece
        run += 1
        if run >= longest or any(c in tokenizer.decode([int(t)]) for c in ".!?\n"):
            piece, run = piece + 1, 0
    return out


def question_scores(keys: mx.array, queries: mx.array, segments: Optional[mx.array] = None,
                    local: Optional[int] = None, detrend: Optional[bool] = None,
                    per_query: Optional[bool] = None) -> mx.array:
    """``(B, H, N)`` float32 scores (higher: more wanted) of a block of keys ``(B, H, N, D)``
    against unit probe queries ``(B, H, M, D)`` (:func:`probe_queries`); ``segments``:
    ``(B, N)`` piece numbers of the block's tokens (:func:`segment_ids`), nondecreasing
    along a row; None: each token alone. ``detrend``: the block's least-squares line over
    its positions is subtracted (None: :data:`DETREND`); ``local``: the mean score within
    that many positions is subtracted (None: :data:`LOCAL`; 0: none); ``per_query``: from
    each query's dot products before the best is taken, not from the best (None:
    :data:`PER_QUERY`)."""
    local = LOCAL if local is None else local
    s = keys.astype(mx.float32) @ mx.swapaxes(queries.astype(mx.float32), -1, -2)  # (B, H, N, M)
    if (PER_QUERY if per_query is None else per_query) and local:
        s = s - _local_mean(s, local, axis=2)
        local = 0
    s = mx.max(s, axis=-1)
    b, h, n = s.shape
    if DETREND if detrend is None else detrend:
        x = mx.arange(n, dtype=mx.float32) - (n - 1) / 2  # centred: the line's slope and mean apart
        slope = mx.sum(s * x, axis=-1, keepdims=True) / max(n * (n * n - 1) / 12, 1.0)  # sum of x^2
        s = s - mx.mean(s, axis=-1, keepdims=True) - slope * x
    if local:
        s = s - _local_mean(s, local, axis=-1)
    if segments is None:
        return s
    seg = mx.array(segments).astype(mx.int64).reshape(b, n)
    seg = seg - mx.min(seg, axis=-1, keepdims=True) + (mx.arange(b, dtype=mx.int64) * n)[:, None]  # rows apart
    flat = seg.reshape(-1)
    rows = mx.swapaxes(s, 1, 2).reshape(b * n, h)  # (B*N, H): a row per token
    best = mx.full((b * n, h), -mx.inf, dtype=mx.float32).at[flat].maximum(rows)
    return mx.swapaxes(best[flat].reshape(b, n, h), 1, 2)


def _local_mean(s: mx.array, local: int, axis: int) -> mx.array:
    """The mean of ``s`` within ``local`` positions either side along ``axis`` (fewer at the ends)."""
    axis = axis % s.ndim
    n = s.shape[axis]
    shape = list(s.shape)
    shape[axis] = 1
    c = mx.concatenate([mx.zeros(shape, mx.float32), mx.cumsum(s, axis=axis)], axis=axis)
    i = mx.arange(n)
    lo, hi = mx.maximum(i - local, 0), mx.minimum(i + local + 1, n)
    count = (hi - lo).astype(mx.float32).reshape([n if a == axis else 1 for a in range(s.ndim)])
    return (mx.take(c, hi, axis=axis) - mx.take(c, lo, axis=axis)) / count


def repeated_pieces(ids: Sequence[int], pieces: np.ndarray, shortest: int = REPEAT_SHORTEST) -> np.ndarray:
    """Per token of ``ids``, whether its sentence piece (``pieces``, :func:`segment_ids`)
    has at least ``shortest`` tokens and repeats, token for token, a piece earlier in
    ``ids``: text repeated word for word (a filler, boilerplate) holds nothing its first
    copy does not."""
    ids = np.asarray([int(t) for t in ids], dtype=np.int64)
    pieces = np.asarray(pieces).reshape(-1)
    out = np.zeros(len(ids), dtype=bool)
    seen: set = set()
    cuts = np.flatnonzero(np.diff(pieces)) + 1
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(ids)]):
        if b - a < shortest:
            continue
        text = tuple(ids[a:b].tolist())
        if text in seen:
            out[a:b] = True
        seen.add(text)
    return out


def last_paragraph(tokenizer: Any, ids: Sequence[int], start: int, end: int) -> int:
    """The first position of ``ids[start:end]``'s last paragraph: after the last
    blank line (a token, or two tokens in a row, holding line breaks with nothing
    but spaces between them) that leaves at least one token after it; ``start``
    when there is none."""
    text = [tokenizer.decode([int(t)]) for t in ids[start:end]]
    for j in range(len(text) - 2, -1, -1):
        if re.search(r"\n[ \t]*\n", text[j]):
            return start + j + 1
        if text[j].rstrip(" \t").endswith("\n") and text[j + 1].lstrip(" \t").startswith("\n") and j + 2 < len(text):
            return start + j + 2
    return start


def make_probe(model: Any, tokenizer: Any, ids: Sequence[int], spans: Sequence[tuple[int, int]],
               questions: Sequence[Sequence[int]] = (), draft: int = PROBE_DRAFT,
               longest: int = SEGMENT_TOKENS, tail: int = PROMPT_TAIL,
               paragraph: bool = True, repeats: bool = True) -> list[tuple[mx.array, mx.array, mx.array]]:
    """Per layer ``(queries, pieces, repeated)`` for a prompt ``ids`` whose document lies in
    ``spans`` (the evictable positions; everything else is the job's): the probe
    queries of the text after the document and of each of ``questions`` (token ids
    asked after ``ids``; one probe pass each, their queries joined), and the prompt's
    sentence pieces ``(1, len(ids))``. Without ``questions`` the probe also reads the
    document's last ``tail`` tokens, where a question written into the prompt sits
    (a whole prompt evictable, completion style, is probed by its end alone); with
    ``paragraph``, only their last paragraph (:func:`last_paragraph`) when they hold a
    blank line: the rest of them is document, and its queries pull the selection
    toward the text around them. ``repeated`` ``(1, len(ids))``: the tokens of pieces
    that repeat an earlier one (:func:`repeated_pieces`; all False without ``repeats``),
    which the rule keeps last."""
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("an empty prompt has nothing to probe")
    spans = [(int(a), min(int(b), len(ids))) for a, b in spans]
    start, end = (spans[0][0], spans[-1][1]) if spans else (0, len(ids))
    asks = [list(q) for q in questions]
    if not asks:  # a prompt: its end holds the question; its first tokens (a BOS, the template's start) are run
        cut = max(start, end - tail)
        if paragraph:  # the tail's last paragraph alone, when it has one: a question written after the text
            cut = last_paragraph(tokenizer, ids, cut, end)
        end = cut
        start = min(max(start, PROBE_SINK), end)
        asks = [[]]
    per_ask = [probe_queries(model, ids, start, end, q, draft) for q in asks]
    seg = segment_ids(tokenizer, ids, longest)
    pieces = mx.array(seg)[None]
    repeated = mx.array(repeated_pieces(ids, seg) if repeats else np.zeros(len(ids), dtype=bool))[None]
    return [None if per_ask[0][i] is None else
            (mx.concatenate([p[i] for p in per_ask], axis=2) if len(per_ask) > 1 else per_ask[0][i], pieces, repeated)
            for i in range(len(per_ask[0]))]
