"""knorm_gen.eviction.rules.question: the probe pass, sentence pieces and question scores, each
against an independent reference (float64 numpy loops; mlx_lm's own KVCache)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from knorm_gen.platform.mlx_compat import record_attention
from knorm_gen.eviction.rules.question import (BEST_REACH, PROBE_DRAFT, PROBE_SINK, Probe, ProbeBatch, Question,
                                      probe_queries, question_scores, repeated_pieces, segment_ids)
from knorm_gen.eviction.spans import ALL_EVICTABLE

from .conftest import greedy_with_gaps, tiny_llama


def reference_scores(keys, queries, segments, local):
    k, q = np.asarray(keys, np.float64), np.asarray(queries, np.float64)
    b, h, n, _ = k.shape
    s = np.empty((b, h, n))
    for r in range(b):
        for j in range(h):
            for i in range(n):
                s[r, j, i] = max(float(k[r, j, i] @ qq) for qq in q[r, j])
    if local:
        m = s.copy()
        for i in range(n):
            lo, hi = max(0, i - local), min(n, i + local + 1)
            m[..., i] = s[..., i] - s[..., lo:hi].mean(axis=-1)
        s = m
    if segments is None:
        return s
    out = s.copy()
    for r in range(b):
        for g in set(segments[r]):
            at = [i for i in range(n) if segments[r][i] == g]
            out[r][:, at] = s[r][:, at].max(axis=-1, keepdims=True)
    return out


@pytest.mark.parametrize("local", [0, 3])
def test_question_scores_match_a_float64_reference(local):
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(2, 3, 20, 8)).astype(np.float32)
    queries = rng.normal(size=(2, 3, 5, 8)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=-1, keepdims=True)
    # row 0: pieces of 1 to 7 tokens; row 1 starts mid-prompt (piece numbers offset), one long piece
    segments = [[0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4, 5],
                [40, 40, 41, 41, 41, 41, 41, 41, 41, 41, 41, 41, 41, 41, 41, 41, 41, 42, 42, 42]]
    want = reference_scores(keys, queries, segments, local)
    got = np.array(question_scores(mx.array(keys), mx.array(queries), mx.array(segments), local=local))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    alone = np.array(question_scores(mx.array(keys), mx.array(queries), None, local=local))
    np.testing.assert_allclose(alone, reference_scores(keys, queries, None, local), rtol=1e-4, atol=1e-4)
    # a piece shares one score: its tokens tie, so the position breaks the tie
    assert np.all(got[0, :, 4:11] == got[0, :, 4:5])


def test_per_query_scores_take_each_querys_own_local_mean_first():
    rng = np.random.default_rng(2)
    keys = rng.normal(size=(1, 2, 24, 8)).astype(np.float32)
    queries = rng.normal(size=(1, 2, 4, 8)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=-1, keepdims=True)
    k, q = keys.astype(np.float64), queries.astype(np.float64)
    want = np.empty((1, 2, 24))
    for j in range(2):
        per = k[0, j] @ q[0, j].T  # (N, M), each query its own column
        centred = np.stack([per[i] - per[max(0, i - 3):i + 4].mean(axis=0) for i in range(24)])
        want[0, j] = centred.max(axis=-1)
    got = np.array(question_scores(mx.array(keys), mx.array(queries), None, local=3, per_query=True))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # not the same as the best query's score less its local mean (what per_query=False does)
    assert not np.allclose(got, reference_scores(keys, queries, None, 3), atol=1e-3)


class _Tok:
    def __init__(self, words):
        self.words = words

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


def test_segment_ids_end_at_sentence_ends_and_at_the_longest_piece():
    tok = _Tok([" The", " pass", " key", " is", " 8", "1", ".", " Remember", " it", "!\n", " x"])
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10, 10, 10]
    assert segment_ids(tok, ids, longest=16).tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert segment_ids(tok, ids, longest=3).tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 4, 4, 4, 5, 5]
    with pytest.raises(ValueError, match="at least one token"):
        segment_ids(tok, ids, longest=0)


def test_repeated_pieces_mark_later_copies_of_pieces_long_enough():
    # pieces: [the filler x4 tokens] [the filler again] ["\n" x1] ["\n" again] [the key] [the filler a third time]
    words = [" It", " rained", " all", " day", ".", "\n", " key", " 81313", "."]
    tok = _Tok(words)
    filler, newline, key = [0, 1, 2, 3, 4], [5], [6, 7, 8]
    ids = filler + filler + newline + newline + key + filler
    pieces = segment_ids(tok, ids, longest=16)
    want = [False] * 5 + [True] * 5 + [False, False] + [False] * 3 + [True] * 5  # the line break is too short
    assert repeated_pieces(ids, pieces, shortest=4).tolist() == want
    assert not repeated_pieces(ids, pieces, shortest=6).any()  # a 5-token piece is not long enough for 6


def test_a_repeated_piece_ranks_after_every_piece_that_is_not():
    rng = np.random.default_rng(3)
    keys = rng.normal(size=(1, 2, 12, 8)).astype(np.float32)
    queries = rng.normal(size=(1, 2, 3, 8)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=-1, keepdims=True)
    segments = [[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]]
    repeated = np.array([[False, False, False, True, True, True, False, False, False, True, True, True]])
    plain = reference_scores(keys, queries, segments, BEST_REACH)[0]  # (H, N), higher kept first
    positions = mx.arange(12)[None, None, :]
    best = Question("best")
    probe = ProbeBatch.stack([Probe(mx.array(queries), mx.array(segments), mx.array(repeated))])
    got = -np.array(best.score(mx.array(keys), positions, probe))[0]
    for h in range(2):
        assert got[h, ~repeated[0]].min() > got[h, repeated[0]].max()
        # within each group the order is the plain score's
        for group in (~repeated[0], repeated[0]):
            assert np.argsort(got[h, group], kind="stable").tolist() == np.argsort(plain[h, group], kind="stable").tolist()
    # nothing repeated: the plain scores
    none = ProbeBatch.stack([Probe(mx.array(queries), mx.array(segments), mx.zeros((1, 12), dtype=mx.bool_))])
    alone = -np.array(best.score(mx.array(keys), positions, none))[0]
    np.testing.assert_allclose(alone, plain, rtol=1e-4, atol=1e-4)


def _recorded_queries(model, blocks, draft):
    """Queries per layer of an ordinary run through mlx_lm's KVCache: the blocks, then greedy tokens."""
    caches = [KVCache() for _ in model.layers]
    calls: list = []
    with record_attention(model, calls):
        for i, block in enumerate(blocks):
            if i == len(blocks) - 1:
                calls.clear()  # only the last block and the draft are probe tokens
            logits = model(mx.array(block)[None], cache=caches)
        for _ in range(draft):
            logits = model(mx.array([[int(mx.argmax(logits[0, -1]).item())]]), cache=caches)
    n = len(model.layers)
    out = []
    for i in range(n):
        q = np.concatenate([np.array(calls[j][0].astype(mx.float32)) for j in range(i, len(calls), n)], axis=2)
        b, hq, m, d = q.shape
        hk = calls[i][1].shape[1]
        q = q.reshape(b, hk, (hq // hk) * m, d)
        out.append(q / np.linalg.norm(q, axis=-1, keepdims=True))
    return out


def test_probe_queries_with_no_document_are_an_ordinary_runs_queries():
    model = tiny_llama(layers=2)
    ids = [5, 6, 7, 8, 9, 10]  # the template (3 tokens), no document, then the instructions
    question = [11, 12, 13]
    got = probe_queries(model, ids, 3, 3, question, draft=2)
    want = _recorded_queries(model, [ids[:3], ids[3:] + question], draft=2)
    assert len(got) == 2
    for g, w in zip(got, want):
        assert g.shape == (1, 2, 2 * (3 + 3 + 2), 16)  # KV heads, group 2 x (instructions, question, draft)
        np.testing.assert_allclose(np.array(g), w, rtol=1e-4, atol=1e-5)


def test_probe_queries_skip_the_document_but_keep_its_positions():
    model = tiny_llama(layers=2)
    doc_a = [1, 2, 3, 4, 5, 6, 7, 8]
    doc_b = [9, 9, 9, 9, 9, 9, 9, 9]
    a = probe_queries(model, [20, 21] + doc_a + [30, 31], 2, 10, [40], draft=1)
    b = probe_queries(model, [20, 21] + doc_b + [30, 31], 2, 10, [40], draft=1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.array(x), np.array(y))  # the document's tokens are never run
    # RoPE: the instructions sit at positions 10.., not right after the template
    near = probe_queries(model, [20, 21, 30, 31], 2, 2, [40], draft=1)
    assert max(float(np.abs(np.array(x) - np.array(y)).max()) for x, y in zip(a, near)) > 1e-3


def test_probe_queries_refuse_a_bad_span_and_an_empty_probe():
    model = tiny_llama(layers=1)
    with pytest.raises(ValueError, match="does not lie in a prompt of 4 tokens"):
        probe_queries(model, [1, 2, 3, 4], 2, 9)
    with pytest.raises(ValueError, match="nothing after the document"):
        probe_queries(model, [1, 2, 3, 4], 0, 4)


# ---- the rule in the product: the engine, the Python calls, the batch path ----------------

CONTEXT = ("Ada keeps her bicycle in the blue shed. Ben keeps his kayak in the red barn! "
           "The pass key is 48213. Remember it. Cleo waters the garden on Sundays.\nDan reads.")
QUESTION = "What is the pass key?"
BUDGET = 40


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    from knorm_gen.models.load import load_model

    return load_model(str(tiny_model_dir))


def _plain_keys(model, ids):
    """Every layer's keys after an ordinary one-block prefill through mlx_lm's KVCache."""
    caches = [KVCache() for _ in model.layers]
    model(mx.array(ids)[None], cache=caches)
    return [np.array(c.keys[..., : len(ids), :].astype(mx.float32)) for c in caches]


def test_a_compressed_context_keeps_the_numpy_ranking_of_its_probe(tiny_loaded):
    # One block (the prompt is under 512 tokens), so every layer's keys are those of an
    # ordinary prefill; the kept set is then the float64 ranking of the question scores
    # (pieces from the prompt's text) with sinks, the recent window and the pinned
    # template protected.
    from knorm_gen.eviction.config import PRESETS, EvictionConfig
    from knorm_gen.generation.engine import BatchEngine
    from knorm_gen.generation.generate import question_request
    from knorm_gen.eviction.rules.question import make_probe
    from knorm_gen.eviction.config import GenerationConfig

    from .test_rules import assert_best_up_to_near_ties

    model, tok = tiny_loaded
    fields = {k: v for k, v in PRESETS["question"].items()}
    eviction = EvictionConfig(budget=BUDGET, **fields).for_model(model)
    request = question_request(model, tok, "k", CONTEXT, [QUESTION], eviction, GenerationConfig(max_tokens=4))
    ids, (start, end) = request.context_ids, request.spans[0]
    engine = BatchEngine(model, tok, eviction)
    caches, _ = engine.prefill_context(request.eviction, ids, request.spans, request.question_ids)
    probe = make_probe(model, tok, ids, request.spans, request.question_ids)
    pieces = [int(x) for x in np.array(probe[0].pieces)[0]]
    # independent pieces: split the decoded tokens at sentence ends and line breaks (16 at most)
    want_pieces, piece, run = [], 0, 0
    for t in ids:
        want_pieces.append(piece)
        run += 1
        if run == 16 or any(c in tok.decode([t]) for c in ".!?\n"):
            piece, run = piece + 1, 0
    assert pieces == want_pieces
    keys = _plain_keys(model, ids)
    n_sink, recent = 4, caches[0].recent
    protected = set(range(n_sink)) | set(range(len(ids) - recent, len(ids))) | set(range(start)) | \
        set(range(end, len(ids)))
    for layer, (c, k) in enumerate(zip(caches, keys)):
        assert c.keep == "question" and c.probe is not None
        scores = -reference_scores(k, np.array(probe[layer].queries), [pieces], BEST_REACH)
        got = np.array(c.ordered_state()[2])[0]
        for h in range(got.shape[0]):
            scored = {p: float(scores[0, h, p]) for p in range(len(ids))}
            assert_best_up_to_near_ties(list(got[h]), scored, protected, c.limit, (layer, h))


def _greedy_alone(model, tok, prompt, max_tokens):
    """A single-row greedy loop through caches probed by hand (make_probe, set_probe),
    keeping each step's top-2 logit gap: the reference every product path is held to."""
    from knorm_gen.eviction.cache import make_eviction_cache, set_probe
    from knorm_gen.eviction.config import PRESETS, EvictionConfig
    from knorm_gen.generation.prompts import encode_with_spans
    from knorm_gen.eviction.rules.question import make_probe

    ids, spans = encode_with_spans(tok, prompt, None, None)
    config = EvictionConfig(budget=BUDGET, **PRESETS["question"])
    caches = set_probe(make_eviction_cache(model, config, spans), make_probe(model, tok, ids, spans))
    model(mx.array(ids[:-1])[None], cache=caches)
    return greedy_with_gaps(model, caches, ids[-1], max_tokens, set(tok.eos_token_ids))


def assert_follows(got, want, gaps, what):
    """``got`` is ``want`` token for token, or first leaves it where the reference's top-2
    logits were within 0.05 (batch shapes round differently; DESIGN.md section 4)."""
    if got != want:
        i = next(k for k in range(min(len(got), len(want))) if got[k] != want[k])
        assert gaps[i] < 0.05, f"{what}: diverged at token {i} with a top-2 gap of {gaps[i]:.3f}"


def test_question_rule_through_the_python_calls(tiny_loaded):
    from knorm_gen import answer_questions, generate_batch_with_eviction, generate_with_eviction

    model, tok = tiny_loaded
    prompts = [CONTEXT + "\n\n" + QUESTION, "Eve paints fences. " * 6 + "\n\nWho paints?"]
    refs = [_greedy_alone(model, tok, p, 6) for p in prompts]
    alone = generate_with_eviction(model, tok, prompts[0], preset="question", budget=BUDGET, max_tokens=6)
    assert alone.config["keep"] == "question" and alone.tokens_kept < alone.tokens_seen
    assert alone.kept_bytes <= alone.kv_ceiling_bytes
    assert_follows(alone.tokens, *refs[0], "generate_with_eviction")
    # the batch path prefills a question-aware row alone (after its probe), then decodes it in the batch
    both = generate_batch_with_eviction(model, tok, prompts, preset="question", budget=BUDGET, max_tokens=6,
                                        batch_size=2)
    for i, (r, (want, gaps)) in enumerate(zip(both, refs)):
        assert_follows(r.tokens, want, gaps, f"batch row {i}")
        assert r.config["keep"] == "question" and r.prefill_s > 0 and r.kept_bytes <= r.kv_ceiling_bytes
    assert both[0].tokens_kept == alone.tokens_kept
    (answer,) = answer_questions(model, tok, CONTEXT, [QUESTION], preset="question", budget=BUDGET, max_tokens=6)
    assert answer.config["keep"] == "question" and answer.kept_bytes <= answer.kv_ceiling_bytes
    assert answer.tokens_kept < answer.tokens_seen


def test_a_prompt_without_questions_is_probed_by_its_end(tiny_loaded):
    from knorm_gen import generate_with_eviction
    from knorm_gen.eviction.rules.question import PROMPT_TAIL, make_probe

    model, tok = tiny_loaded
    ids = tok.encode(CONTEXT + " " + QUESTION, add_special_tokens=False)
    # completion style: the whole prompt is evictable; the probe runs its first PROBE_SINK tokens, then its last
    # PROMPT_TAIL tokens and the draft, exactly as if those tokens were instructions after a document that ends
    # before them (the tail holds no blank line)
    probe = make_probe(model, tok, ids, ALL_EVICTABLE)
    assert probe[0].queries.shape == (1, 2, 2 * (PROMPT_TAIL + PROBE_DRAFT), 16)
    assert probe[0].pieces.shape == (1, len(ids))
    cut = len(ids) - PROMPT_TAIL
    as_instructions = probe_queries(model, ids, PROBE_SINK, cut)
    with_document = _recorded_queries(model, [ids[:cut], ids[cut:]], draft=PROBE_DRAFT)
    for p, r, w in zip(probe, as_instructions, with_document):
        np.testing.assert_array_equal(np.array(p.queries), np.array(r))
        assert not np.allclose(np.array(p.queries), w, atol=1e-3)  # the document before the tail is never run
    r = generate_with_eviction(model, tok, CONTEXT + " " + QUESTION, preset="question", budget=BUDGET,
                               max_tokens=2, chat=False)
    assert r.config["keep"] == "question" and r.tokens_kept < r.tokens_seen
    with pytest.raises(ValueError, match="empty prompt"):
        make_probe(model, tok, [], ALL_EVICTABLE)


def test_a_prompt_is_probed_by_the_last_paragraph_of_its_end(tiny_loaded):
    # a question written after a blank line: the probe runs that paragraph alone, exactly as if the
    # text before it were the document (the position found here from the decoded text, not by the code)
    from knorm_gen.eviction.rules.question import PROMPT_TAIL, make_probe

    model, tok = tiny_loaded
    ids = tok.encode(CONTEXT + "\n\n" + QUESTION, add_special_tokens=False)
    assert len(ids) > PROMPT_TAIL  # the tail is the prompt's last PROMPT_TAIL tokens
    cut = next(i for i in range(len(ids)) if tok.decode(ids[:i]).endswith("\n\n"))
    assert tok.decode(ids[cut:]) == QUESTION and len(ids) - cut < PROMPT_TAIL
    probe = make_probe(model, tok, ids, ALL_EVICTABLE)
    as_instructions = probe_queries(model, ids, PROBE_SINK, cut)
    whole_tail = probe_queries(model, ids, PROBE_SINK, len(ids) - PROMPT_TAIL)
    for p, r, w in zip(probe, as_instructions, whole_tail):
        np.testing.assert_array_equal(np.array(p.queries), np.array(r))
        assert p.queries.shape[2] < w.shape[2]


@pytest.mark.parametrize("pieces, want", [
    (["Some", " text", ".\n\n", "What", "?"], 3),          # a blank line inside one token
    (["Some", " text", ".\n", "\n", "What", "?"], 4),        # across two tokens
    (["Some", ".\n", " \n", "Who", "\n\n", "Why", "?"], 5),  # the last blank line wins
    (["Some", " text", ".\n", "What", "?"], 0),             # one line break is no paragraph
    (["Some", " text", ".", "\n\n"], 0),                   # nothing after the blank line
])
def test_last_paragraph_starts_after_the_last_blank_line(pieces, want):
    from knorm_gen.eviction.rules.question import last_paragraph

    class Pieces:  # a tokenizer whose token i decodes to pieces[i]
        def decode(self, ids):
            return "".join(pieces[i] for i in ids)

    assert last_paragraph(Pieces(), list(range(len(pieces))), 0, len(pieces)) == want
    pieces = ["Before.\n\n", *pieces]  # a blank line before the span is not the span's
    assert last_paragraph(Pieces(), list(range(len(pieces))), 1, len(pieces)) == want + 1


def _numpy_low_kept(keys: np.ndarray, budget: int, n_sink: int, recent: int) -> list[list[int]]:
    """Independent reference: per head, the sinks, the recent window, then the lowest
    squared norms of the rest up to the budget (one block, every position evictable)."""
    n = keys.shape[2]
    out = []
    for h in range(keys.shape[1]):
        fixed = set(range(n_sink)) | set(range(n - recent, n))
        norms = (keys[0, h].astype(np.float64) ** 2).sum(-1)
        rest = sorted((p for p in range(n) if p not in fixed), key=lambda p: (norms[p], p))
        out.append(sorted(fixed | set(rest[: budget - len(fixed)])))
    return out


def test_a_cache_without_its_probe_keeps_the_lowest_norms_and_says_so():
    # make_eviction_cache(model) in a plain mlx_lm loop never sees a probe: the default
    # rule then ranks by the paper's key norm, and warns naming the fix
    import warnings

    from knorm_gen.eviction.cache import BatchEvictionKVCache, EvictionKVCache

    raw = np.random.default_rng(0).normal(size=(1, 2, 30, 8)).astype(np.float32)
    keys = mx.array(raw)
    for cache in (EvictionKVCache(12, 2, 2, "question"), BatchEvictionKVCache(12, 2, 2, "question", batch_size=1)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cache.update_and_fetch(keys, keys)
        assert any("probe_caches" in str(w.message) and "keep='low'" in str(w.message) for w in seen)
        _, _, pos = (cache.extract(0) if isinstance(cache, BatchEvictionKVCache) else cache).ordered_state()
        held = [sorted(int(p) for p in np.array(pos)[0, h]) for h in range(2)]
        assert held == _numpy_low_kept(raw, 12, 2, 2)
    # pinned (a question over a compressed context): nothing is evictable, no probe is needed
    pinned = EvictionKVCache(12, 2, 2, "question", spans=())
    pinned.update_and_fetch(keys, keys)
    assert pinned.tokens_kept == 30
    batch = BatchEvictionKVCache(40, 2, 2, "question", batch_size=1, spans=[()])
    batch.update_and_fetch(keys, keys)
    # a batch cache given no probe: its bytes are its buffers, ranks and nothing else
    assert batch.nbytes == 2 * batch.keys.nbytes + batch.rank.nbytes


def test_pinned_question_caches_decode_without_a_probe_or_a_warning():
    # Once a cache pins everything it is fed (every answer of answer_questions), its probe
    # is gone and no score is needed: the fallback's warning (an error in this suite) never runs.
    from knorm_gen.eviction.cache import BatchEvictionKVCache, EvictionKVCache

    keys = mx.array(np.random.default_rng(1).normal(size=(1, 2, 30, 8)).astype(np.float32))
    single = EvictionKVCache(12, 2, 2, "question", spans=((4, 20),))
    single.set_probe([Probe(mx.ones((1, 2, 3, 8)), mx.zeros((1, 30), dtype=mx.int32),
                            mx.zeros((1, 30), dtype=mx.bool_))])
    single.update_and_fetch(keys, keys)
    single.pin()
    assert single.probe is None
    batch = BatchEvictionKVCache(12, 2, 2, "question", batch_size=2, spans=[(), ()])
    batch.update_and_fetch(mx.concatenate([keys[:, :, :20]] * 2), mx.concatenate([keys[:, :, :20]] * 2))
    for t in range(5):
        single.update_and_fetch(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        batch.update_and_fetch(mx.concatenate([keys[:, :, t : t + 1]] * 2), mx.concatenate([keys[:, :, t : t + 1]] * 2))
    assert single.tokens_kept == 12 + 12 + 5  # the budget, positions 2-3 and 20-29, the answer
    assert batch.counts == [25, 25]
    # a cache that may still evict falls back to the key norm, and says so
    open_row = BatchEvictionKVCache(12, 2, 2, "question", batch_size=1)
    with pytest.warns(UserWarning, match="probe_caches"):
        open_row.update_and_fetch(keys, keys)


def test_a_one_token_prompt_under_the_question_rule_decodes_past_its_budget(tiny_loaded):
    # Nothing to prefill alone: the row is pinned anyway (a batch cache holds no probe,
    # so an evictable answer would be refused); it is the full cache's greedy answer.
    from knorm_gen import generate_batch_with_eviction

    model, tok = tiny_loaded
    token = tok.encode("The", add_special_tokens=False)[0]
    eos = set(tok.eos_token_ids)
    want, gaps = greedy_with_gaps(model, [KVCache() for _ in model.layers], token, 12, eos)
    want = want[:-1] if want[-1] in eos else want  # a result's tokens leave out the stop token
    rows = generate_batch_with_eviction(model, tok, [[token], CONTEXT + "\n\n" + QUESTION], preset="question",
                                        budget=8, max_tokens=12, batch_size=2)
    assert rows[0].config["keep"] == "question" and rows[0].kept_bytes <= rows[0].kv_ceiling_bytes
    assert_follows(rows[0].tokens, want, gaps, "one-token row")
    assert len(rows[0].tokens) == 12 or rows[0].finish_reason == "stop"


def test_the_default_is_probed_on_every_product_path_and_by_probe_caches(tiny_loaded):
    # The default rule is the question rule: every product path probes before it prefills,
    # so none of them falls back to the key norm (the fallback warns: here an error).
    import warnings

    from mlx_lm import generate

    from knorm_gen import (EvictionConfig, answer_questions, generate_batch_with_eviction, generate_with_eviction,
                           make_eviction_cache, probe_caches)
    from knorm_gen.eviction.cache import EvictionKVCache

    model, tok = tiny_loaded
    assert (EvictionConfig().keep, EvictionConfig().question_score, EvictionConfig().carry) == ("question", "mean", 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = generate_with_eviction(model, tok, CONTEXT + "\n\n" + QUESTION, budget=16, max_tokens=3)
        assert r.config["keep"] == "question" and r.config["question_score"] == "mean" and r.tokens_kept < r.tokens_seen
        (a,) = answer_questions(model, tok, CONTEXT, [QUESTION], budget=16, max_tokens=3)
        assert a.tokens_kept < a.tokens_seen
        rows = generate_batch_with_eviction(model, tok, [CONTEXT, CONTEXT + " " + QUESTION], budget=16,
                                            max_tokens=3, batch_size=2)
        assert all(x.tokens_kept < x.tokens_seen for x in rows)
        # a plain mlx_lm loop: the caches hold a probe per layer, read from the prompt's own end
        ids = tok.encode(CONTEXT + " " + QUESTION)
        caches = probe_caches(make_eviction_cache(model, EvictionConfig(budget=16)), model, tok, ids)
        assert all(isinstance(c, EvictionKVCache) and c.probe is not None for c in caches)
        generate(model, tok, ids, max_tokens=3, prompt_cache=caches)
        assert caches[0].tokens_kept < caches[0].offset
    # any other rule: the caches come back as they were, with no probe run
    low = make_eviction_cache(model, EvictionConfig(budget=16, keep="low"))
    assert probe_caches(low, model, tok, ids) == low and all(c.probe is None for c in low)


def test_a_completion_prompt_under_the_default_pins_its_answer_alone_as_in_a_batch(tiny_loaded):
    # A batch cache holds no probe, so a probed prompt decodes pinned there; alone it must hold the
    # same: the budget, then its last prompt token and every generated token fed back, on top.
    from knorm_gen import generate_batch_with_eviction, generate_with_eviction

    model, tok = tiny_loaded
    prompt = (CONTEXT + " ") * 3 + QUESTION
    n_prompt = len(tok.encode(prompt))
    alone = generate_with_eviction(model, tok, prompt, budget=16, max_tokens=6, chat=False)
    rows = generate_batch_with_eviction(model, tok, [prompt, prompt], budget=16, max_tokens=6, chat=False,
                                        batch_size=2)
    for r in (alone, *rows):
        assert r.tokens_seen == n_prompt + r.generated_tokens and r.tokens_seen > 16 + 7
        assert r.tokens_pinned == 1 + r.generated_tokens and r.tokens_kept == 16 + 1 + r.generated_tokens
        assert r.kept_bytes <= r.kv_ceiling_bytes
