"""The ``question`` rule: keep the document keys the job's own instructions would attend to.

Every intrinsic rule (the key's norm, KeyDiff, leverage) lost pass keys planted in real
prose, which the same layout kept once they were pinned: a sentence that does not stand
out from its neighbours is lost by selection. This rule knows what the job asks. What it
does, in order:

1. :func:`probe_queries`: before the document is prefilled, the model runs the
   template before the document, then the pinned text after it (instructions, the
   question) at its true RoPE positions, then :data:`PROBE_DRAFT` tokens it answers with
   no document; the queries of those tokens are recorded per layer.
2. :func:`segment_ids`: the prompt cut into sentence pieces (a piece ends after a
   token with a sentence end or a line break in it, or after :data:`SEGMENT_TOKENS` tokens).
3. :func:`question_scores`: a key's score is read from its dot products with the unit
   probe queries of its KV head's group (:class:`Question`'s ``reading``), less a local
   mean (RoPE's decay with distance would otherwise favour the late keys), and every token
   of a piece takes the piece's best score, so a hit keeps its whole sentence (the digits
   after "The pass key is"); a piece that repeats an earlier one ranks after the rest.

:func:`make_probe` runs 1 and 2 for a prompt and its document's positions; the caches
hold the result (:func:`knorm_gen.eviction.cache.probe_caches`) and score each block against it.
It works best with questions asked apart from the document (``answer_questions``,
question rows); a prompt is probed by the text after its document and the last paragraph
of the document's last :data:`PROMPT_TAIL` tokens (all of them when they hold no blank
line): a question written after the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from ...platform.mlx_compat import (
    KVCache,
    ProbeCache,
    RotatingKVCache,
    UnsupportedModelError,
    architecture,
    is_full_attention,
    make_prompt_cache,
    record_queries,
)
from .base import Rule, setting

PROBE_DRAFT = 8
"""Tokens the model answers with no document during the probe (their queries join the question's)."""

SEGMENT_TOKENS = 16
"""The longest sentence piece: 8 split "The pass key is 81313." and lost most keys; 16 and 32 kept them."""

BEST_REACH = 64
"""``reading="best"``: positions either side whose mean best-query score a key's is measured against."""

PER_QUERY_REACH = 128
"""``reading="per_query"``: positions either side whose mean a query's dot products are measured
against before the best query is taken (measured against 64: more held-out keys on SmolLM2, the
same on Gemma 3, more of a fresh README's summary on Gemma 3)."""

READINGS = ("best", "per_query", "mean")
"""How a key's score is read from the probe (``question_score``):

- ``best``: the best query's dot product, less its mean within :data:`BEST_REACH` positions;
- ``per_query``: each query's dot products less their own mean within :data:`PER_QUERY_REACH`
  positions, then the best query: a broad query (one that scores whole regions high) no
  longer decides the selection alone;
- ``mean``: the mean of the two, so a piece either ranks high is kept (on SmolLM2 the
  per-query reading alone dropped a key sentence from most heads of the later layers where
  the best reading kept it)."""

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


@dataclass(frozen=True)
class Probe:
    """One row's probe for one layer: unit ``queries (1, KV heads, M, D)``, the prompt's
    sentence ``pieces (1, P)`` and whether each token's piece is ``repeated (1, P)``."""

    queries: mx.array
    pieces: mx.array
    repeated: mx.array

    @property
    def nbytes(self) -> int:
        return self.queries.nbytes + self.pieces.nbytes + self.repeated.nbytes


@dataclass(frozen=True)
class ProbeBatch:
    """The probes of a batch's rows stacked (queries and pieces padded): what
    :meth:`Question.score` reads. ``valid (B, 1, 1, M)``: the real queries (None: all)."""

    queries: mx.array
    valid: Optional[mx.array]
    pieces: mx.array
    last: mx.array  # (B, 1): each row's last probed position
    repeated: mx.array

    @classmethod
    def stack(cls, probes: Sequence[Probe]) -> "ProbeBatch":
        if len(probes) == 1:
            p = probes[0]
            return cls(p.queries, None, p.pieces, mx.array([[p.pieces.shape[-1] - 1]]), p.repeated)
        m = max(p.queries.shape[2] for p in probes)
        width = max(p.pieces.shape[-1] for p in probes)
        queries = mx.concatenate([mx.pad(p.queries, [(0, 0), (0, 0), (0, m - p.queries.shape[2]), (0, 0)])
                                  for p in probes])
        valid = mx.array([[i < p.queries.shape[2] for i in range(m)] for p in probes])[:, None, None, :]
        pieces = mx.concatenate([mx.pad(p.pieces, [(0, 0), (0, width - p.pieces.shape[-1])]) for p in probes])
        repeated = mx.concatenate([mx.pad(p.repeated, [(0, 0), (0, width - p.repeated.shape[-1])]) for p in probes])
        last = mx.array([[p.pieces.shape[-1] - 1] for p in probes])
        return cls(queries, valid, pieces, last, repeated)


@dataclass(frozen=True)
class Question(Rule):
    """Keep the document keys the job's instructions would attend to (``keep="question"``):
    minus :func:`question_scores` of the probe (:class:`ProbeBatch`), each token in its
    sentence piece (a position past the probed prompt, a generated token, is a piece of
    its own), a repeated piece lowered by :data:`REPEAT_PENALTY`. Static: a key's score
    depends on the key and the probe only. ``Question(reading="mean", carry=0.25)`` is
    the default layout's."""

    name = "question"
    summary = ("the document keys the instructions after the document would attend to, probed first "
               "(--question-score, --carry)")
    reads_probe = True
    penalty = REPEAT_PENALTY

    reading: str = setting(
        "mean", "How the question rule reads a key's score from the probe: best = the best query's attention "
        "beyond the sentences around it; per_query = each query's beyond its own neighbourhood; mean = the mean "
        "of the two.", key="question_score", choices=READINGS)
    carry: float = setting(
        0.25, "Share of each question-rule layer's rule slots (after the first such layer) kept for the positions "
        "the earlier layers scored best (0 = none).", key="carry", metavar="SHARE")

    def __post_init__(self):
        self.check_choice("reading")
        self.check_share("carry")

    def prepare(self, probes: Sequence[Probe]) -> ProbeBatch:
        return ProbeBatch.stack(probes)

    def score(self, keys: mx.array, positions: mx.array, state: Optional[ProbeBatch] = None) -> mx.array:
        if state is None:
            raise ValueError("keep='question' scores keys against a probe of the job's instructions, and this cache "
                             "has none: run it through generate_with_eviction, answer_questions or knorm-batch, "
                             "which probe first, or probe it with knorm_gen.probe_caches")
        pos = positions[:, 0, :].astype(mx.int64)  # (B, N)
        inside = mx.take_along_axis(state.pieces, mx.minimum(pos, state.last), axis=-1)
        seg = mx.where(pos <= state.last, inside, mx.take_along_axis(state.pieces, state.last, axis=-1) + pos
                       - state.last)
        again = mx.logical_and(pos <= state.last, mx.take_along_axis(state.repeated, mx.minimum(pos, state.last),
                                                                     axis=-1))

        def read(per_query: bool) -> mx.array:
            s = question_scores(keys, state.queries, seg, PER_QUERY_REACH if per_query else BEST_REACH, per_query,
                                state.valid)
            return -mx.where(again[:, None, :], s - REPEAT_PENALTY, s)

        if self.reading == "mean":
            return 0.5 * (read(False) + read(True))
        return read(self.reading == "per_query")


def question_scores(keys: mx.array, queries: mx.array, segments: Optional[mx.array] = None,
                    local: int = BEST_REACH, per_query: bool = False,
                    valid: Optional[mx.array] = None) -> mx.array:
    """``(B, H, N)`` float32 scores (higher: more wanted) of a block of keys ``(B, H, N, D)``
    against unit probe queries ``(B, H, M, D)`` (:func:`probe_queries`; ``valid (B, 1, 1, M)``
    marks the real ones of padded rows); ``segments``: ``(B, N)`` piece numbers of the
    block's tokens (:func:`segment_ids`), nondecreasing along a row; None: each token
    alone. ``local``: the mean score within that many positions is subtracted (0: none);
    ``per_query``: from each query's dot products before the best is taken, not from the best."""
    s = keys.astype(mx.float32) @ mx.swapaxes(queries.astype(mx.float32), -1, -2)  # (B, H, N, M)
    if per_query and local:
        s = s - _local_mean(s, local, axis=2)
        local = 0
    if valid is not None:
        s = mx.where(valid, s, -mx.inf)
    s = mx.max(s, axis=-1)
    b, h, n = s.shape
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


def _probe_caches(model: Any) -> list:
    """The model's own caches with every attention layer (plain or sliding-window) a
    :class:`~knorm_gen.platform.mlx_compat.ProbeCache`; state-space layers keep their own."""
    out = []
    for i, c in enumerate(make_prompt_cache(model)):
        if isinstance(c, (KVCache, RotatingKVCache)):
            probe = ProbeCache(i)
            probe.full = is_full_attention(c)  # the layers eviction may compress: the ones whose queries it needs
            c = probe
        out.append(c)
    return out


def _run_probe(model: Any, ids: list, start: int, end: int, after: list, draft: int,
               one_by_one: bool) -> tuple[dict, set, list, set]:
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
    return seen.queries, seen.other, caches, seen.by_rope


def attention_paths(model: Any) -> tuple[set, set]:
    """``(by_rope, other)``: the layers whose queries a probe pass in blocks reads from their
    rope module (the model computes attention itself), and those whose attention uses keys
    other than the ones their cache stores (multi-head latent attention's prefill form)."""
    ids = list(range(1, 13))
    _, other, _, by_rope = _run_probe(model, ids, 2, 9, ids[9:] + [3, 4], 1, one_by_one=False)
    return by_rope, other


def probe_queries(model: Any, ids: Sequence[int], start: int, end: int, question_ids: Sequence[int] = (),
                  draft: int = PROBE_DRAFT) -> list[Optional[mx.array]]:
    """Per layer, ``(1, KV heads, group x probe tokens, head dim)`` unit-length float32
    queries of the prompt's tokens after the document (``ids[end:]``) and
    ``question_ids``, at their true positions, then of ``draft`` greedy tokens;
    ``ids[:start]`` (before the document) is attended but not recorded, and the
    document ``ids[start:end]`` is not run at all. None for a layer without attention.
    A model whose prefill attends with keys other than those its cache stores
    (multi-head latent attention) is probed one token at a time, the form in which it
    attends with them; :class:`~knorm_gen.platform.mlx_compat.UnsupportedModelError` when no
    layer's queries can be read."""
    ids = [int(t) for t in ids]
    if not 0 <= start <= end <= len(ids):
        raise ValueError(f"the document's span [{start}, {end}) does not lie in a prompt of {len(ids)} tokens")
    after = ids[end:] + [int(t) for t in question_ids]
    if not after:
        raise ValueError("nothing after the document to probe: the instructions or a question must follow it")
    queries, other, caches, _ = _run_probe(model, ids, start, end, after, draft, one_by_one=False)
    # the full-attention layers that attend at all (a block that replaces attention never feeds its cache)
    attention = [c.layer for c in caches if isinstance(c, ProbeCache) and c.full and c.keys is not None]
    if other or any(len(queries.get(i, ())) != 1 + draft for i in attention):
        queries, other, caches, _ = _run_probe(model, ids, start, end, after, draft, one_by_one=True)
    missing = [i for i in attention if not queries.get(i)]
    if missing:
        raise UnsupportedModelError(
            f"{architecture(model)}: the question probe cannot read the queries of layers {missing} (its attention "
            f"goes neither through mlx_lm's scaled_dot_product_attention nor through a rope module with the keys "
            f"its cache stores); choose a layout that needs no probe, e.g. --preset intrinsic")
    out: list[Optional[mx.array]] = []
    for c in caches:
        if not isinstance(c, ProbeCache) or not queries.get(c.layer):
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
               questions: Sequence[Sequence[int]] = ()) -> list[Optional[Probe]]:
    """Per layer, the :class:`Probe` of a prompt ``ids`` whose document lies in ``spans``
    (the evictable positions; everything else is the job's), None for a layer without
    attention: the probe queries of the text after the document and of each of
    ``questions`` (token ids asked after ``ids``; one probe pass each, their queries
    joined), and the prompt's sentence pieces. Without ``questions`` the probe also reads
    the last paragraph (:func:`last_paragraph`) of the document's last :data:`PROMPT_TAIL`
    tokens, where a question written into the prompt sits (all of them when they hold no
    blank line; a whole prompt evictable, completion style, is probed by its end alone):
    the rest of them is document, and its queries would pull the selection toward the
    text around them."""
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("an empty prompt has nothing to probe")
    spans = [(int(a), min(int(b), len(ids))) for a, b in spans]
    start, end = (spans[0][0], spans[-1][1]) if spans else (0, len(ids))
    asks = [list(q) for q in questions]
    if not asks:  # a prompt: its end holds the question; its first tokens (a BOS, the template's start) are run
        end = last_paragraph(tokenizer, ids, max(start, end - PROMPT_TAIL), end)
        start = min(max(start, PROBE_SINK), end)
        asks = [[]]
    per_ask = [probe_queries(model, ids, start, end, q) for q in asks]
    seg = segment_ids(tokenizer, ids)
    pieces, repeated = mx.array(seg)[None], mx.array(repeated_pieces(ids, seg))[None]
    return [None if per_ask[0][i] is None else
            Probe(mx.concatenate([p[i] for p in per_ask], axis=2) if len(per_ask) > 1 else per_ask[0][i], pieces,
                  repeated)
            for i in range(len(per_ask[0]))]
