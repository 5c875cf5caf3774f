"""What is never evicted (the instructions around a document) and coverage, against
independent references: numpy rankings of the keys fed, token positions found by
searching the document's own tokens in the prompt, and byte counts on disk."""

import json

import mlx.core as mx
import numpy as np
import pytest

from knorm_gen import EvictionConfig, GenerationConfig, answer_questions, generate_with_eviction
from knorm_gen.eviction.cache import BatchEvictionKVCache, EvictionKVCache, make_eviction_cache
from knorm_gen.generation.prompts import context_spans, encode_with_spans, split_question_prompts
from knorm_gen.generation.results import GenerationResult
from knorm_gen.eviction.spans import ALL_EVICTABLE, NO_END

from .test_cache import distinct_norm_keys, feed_keys


def kept(cache, row=0):
    """Positions held per head (sorted), read from the cache."""
    _, _, pos = cache.ordered_state()
    return [sorted(int(p) for p in np.array(pos)[row, h]) for h in range(pos.shape[1])]


def numpy_kept(keys, budget, n_sink, doc, coverage_stride=None):
    """Independent reference for keep="low", recent=0, one block: every position
    outside ``doc`` (a set) and the sinks are kept; coverage positions next; then the
    lowest norms of the rest, up to the budget minus the sinks and coverage."""
    t = keys.shape[2]
    norms = np.linalg.norm(keys[0].astype(np.float64), axis=-1)
    out = []
    for h in range(keys.shape[1]):
        pinned = {p for p in range(t) if p < n_sink or p not in doc}
        covered = set()
        if coverage_stride:
            covered = {p for p in range(t) if p % coverage_stride == 0} - pinned
        room = budget - len({p for p in pinned if p < n_sink}) - len(covered)
        rest = sorted((p for p in range(t) if p not in pinned and p not in covered), key=lambda p: (norms[h, p], p))
        out.append(sorted(pinned | covered | set(rest[:room])))
    return out


@pytest.mark.parametrize("spans", [((6, 30),), ((3, 10), (14, 25)), ((0, 40),), ((5, NO_END),)])
def test_positions_outside_the_document_are_never_evicted(spans):
    keys = distinct_norm_keys(40, np.random.default_rng(3))
    doc = {p for a, b in spans for p in range(a, min(b, 40))}
    cache = EvictionKVCache(12, 2, 0, "low", spans=spans)
    feed_keys(cache, keys, [40])
    assert kept(cache) == numpy_kept(keys, 12, 2, doc)
    pinned_beyond_sinks = len([p for p in range(2, 40) if p not in doc])
    assert cache.count == 12 + pinned_beyond_sinks == cache.tokens_pinned + 12


@pytest.mark.parametrize("keep", ["low", "keydiff", "blend", "random", "recent", "high", "leverage"])
def test_every_rule_holds_the_pinned_positions_through_blocks_and_decode(keep):
    keys = distinct_norm_keys(70, np.random.default_rng(5))
    spans = ((8, 50),)  # 0-7 an instruction, 50 on a question and its answer
    cache = EvictionKVCache(10, 2, 2, keep, spans=spans)
    mx.random.seed(0)
    feed_keys(cache, keys, [17, 20, 13, 1, 1, 1, 17])
    held = kept(cache)
    must = set(range(8)) | set(range(50, 70))
    for h in held:
        assert must <= set(h)
        assert len(h) == 10 + len(must) - 2


def test_batch_rows_with_different_spans_select_as_each_row_alone():
    rng = np.random.default_rng(7)
    keys = [distinct_norm_keys(48, rng) for _ in range(3)]
    spans = [((5, 40),), ALL_EVICTABLE, ((0, 20), (26, 44))]
    singles = []
    for k, s in zip(keys, spans):
        c = EvictionKVCache(9, 2, 1, "low", spans=s)
        feed_keys(c, k[:, :, :20], [20])
        singles.append(c)
    batch = EvictionKVCache.merge(singles)
    assert isinstance(batch, BatchEvictionKVCache)
    both = np.concatenate([k[:, :, 20:] for k in keys])
    for size in (11, 1, 1, 15):
        block, keys_left = both[:, :, :size], both[:, :, size:]
        batch.update_and_fetch(mx.array(block), mx.array(block))
        for c, k in zip(singles, range(3)):
            c.update_and_fetch(mx.array(block[k : k + 1]), mx.array(block[k : k + 1]))
        both = keys_left
    for i, c in enumerate(singles):
        assert kept(batch.extract(i)) == kept(c)
        assert batch.extract(i).spans == c.spans


@pytest.mark.parametrize("coverage,t", [(0.25, 40), (0.5, 64), (0.3, 100)])
def test_coverage_keeps_evenly_spread_positions(coverage, t):
    keys = distinct_norm_keys(t, np.random.default_rng(11))
    budget = 16
    slots = int(coverage * budget)
    stride = 1
    while -(-t // stride) > slots:
        stride *= 2
    cache = EvictionKVCache(budget, 2, 0, "low", coverage=coverage)
    feed_keys(cache, keys, [t])
    assert kept(cache) == numpy_kept(keys, budget, 2, set(range(t)), coverage_stride=stride)


def test_coverage_positions_stay_held_as_the_input_grows():
    keys = distinct_norm_keys(200, np.random.default_rng(2))
    cache = EvictionKVCache(16, 2, 0, "low", coverage=0.25)  # 4 slots: stride 64 at 200 tokens
    feed_keys(cache, keys, [30, 1, 1, 1, 40, 1, 60, 1, 1, 64])
    for h in kept(cache):
        assert {0, 64, 128, 192} <= set(h) and len(h) == 16


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), "half", True])
def test_coverage_validation_names_the_field(bad):
    with pytest.raises(ValueError, match="coverage"):
        EvictionConfig(coverage=bad)


def test_coverage_always_leaves_the_rule_a_slot():
    from knorm_gen.eviction.selection import cover_slots

    assert cover_slots(512, 0.25, 68) == 128
    assert cover_slots(16, 0.9, 6) == 9  # 16 - (4 sinks + 2 recent) - 1
    assert cover_slots(6, 0.5, 4) == 1 and cover_slots(5, 0.5, 4) == 0


def test_spans_and_coverage_survive_save_and_load(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    keys = distinct_norm_keys(60, np.random.default_rng(4))
    from knorm_gen.eviction.rules.keydiff import KeyDiff
    from knorm_gen.eviction.rules.variants import Coverage

    c = EvictionKVCache(12, 2, 1, Coverage(KeyDiff(), 0.25), spans=((4, 50),))
    feed_keys(c, keys[:, :, :45], [45])
    save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert loaded.spans == c.spans and loaded.rule == c.rule == Coverage(KeyDiff(), 0.25)
    for cache in (c, loaded):
        feed_keys(cache, keys[:, :, 45:], [1] * 15)
    assert kept(loaded) == kept(c)


# ---- where the document lies in a real prompt (the embedded model's template) ----


def find(ids, sub):
    """Index of the first occurrence of ``sub`` in ``ids`` (a plain search, no template knowledge)."""
    for i in range(len(ids) - len(sub) + 1):
        if ids[i : i + len(sub)] == sub:
            return i
    raise AssertionError("the document's tokens are not in the prompt")


DOC = ("The harbor master keeps a log of every ship. Each entry names the ship, its cargo and the hour "
       "it arrived. Storms are noted in red ink.")


@pytest.fixture(scope="module")
def smol():
    from knorm_gen.models.load import get_model

    return get_model("default")  # one load per process, shared with the other end-to-end tests


@pytest.mark.parametrize("system", [None, "You are a careful technical writer. Answer in three bullet points."])
def test_document_span_matches_the_documents_own_tokens(smol, system):
    _, tok = smol
    doc_ids = tok.encode(DOC, add_special_tokens=False)
    ids, spans = encode_with_spans(tok, DOC, system_prompt=system)
    start = find(ids, doc_ids)
    assert spans == ((start, start + len(doc_ids)),)
    assert start > 20  # the template's system turn and user header come first
    # context + question: the question and everything after the context is pinned
    prefix, _ = split_question_prompts(tok, DOC, ["Summarize it."], chat=True, system_prompt=system)
    cs = context_spans(tok, DOC, prefix, chat=True, system_prompt=system)
    assert cs[0][0] == start and cs[0][1] == len(prefix) and find(prefix, doc_ids) == start


def test_messages_pin_system_and_template_and_leave_user_and_assistant_text(smol):
    _, tok = smol
    messages = [{"role": "system", "content": "Reply in French."}, {"role": "user", "content": DOC},
                {"role": "assistant", "content": "Noted: ships and storms."}, {"role": "user", "content": "Why red?"}]
    ids, spans = encode_with_spans(tok, messages)
    expect = []
    for text in (DOC, "Noted: ships and storms.", "Why red?"):
        sub = tok.encode(text, add_special_tokens=False)
        at = find(ids, sub)
        expect.append((at, at + len(sub)))
    assert spans == tuple(expect)


def test_pin_prefix_chars_pins_an_instruction_written_before_the_document(smol):
    _, tok = smol
    instruction = "Summarize the following in three sentences.\n\n"
    ids, spans = encode_with_spans(tok, instruction + DOC, pin_prefix_chars=len(instruction))
    ids0, spans0 = encode_with_spans(tok, instruction + DOC)
    assert ids == ids0
    head = tok.encode(instruction.rstrip(), add_special_tokens=False)
    assert spans[0][0] >= find(ids, head) + len(head) > spans0[0][0]
    assert spans[0][1] == spans0[0][1]


def test_completion_style_pins_nothing_beyond_the_sinks(smol):
    _, tok = smol
    assert encode_with_spans(tok, DOC, chat=False)[1] == ALL_EVICTABLE
    assert encode_with_spans(tok, [1, 2, 3])[1] == ALL_EVICTABLE


def capture_caches(monkeypatch):
    """``(prompt_tokens, caches)`` of every result, read from the product's own caches
    at the end of each row."""
    seen = []
    original = GenerationResult.from_caches.__func__

    def spy(cls, caches, *args, **kwargs):
        seen.append((kwargs["prompt_tokens"], list(caches)))
        return original(cls, caches, *args, **kwargs)

    monkeypatch.setattr(GenerationResult, "from_caches", classmethod(spy))
    return seen


def instruction_positions(tok, doc, system, seen):
    """Every position of the prompt that is not the document's own tokens, and every
    position after it (the answer), found by searching the document's tokens."""
    ids = encode_with_spans(tok, doc, system_prompt=system)[0]
    doc_ids = tok.encode(doc, add_special_tokens=False)
    start = find(ids, doc_ids)
    return len(ids), set(range(start)) | set(range(start + len(doc_ids), seen))


@pytest.mark.parametrize("batch", [False, True])
def test_every_layer_still_holds_every_instruction_token(smol, monkeypatch, batch):
    model, tok = smol
    seen = capture_caches(monkeypatch)
    system = "The project code name is Bluefin-42. Always answer in one line."
    docs = [(DOC + " ") * 12 + "End.", DOC, (DOC + " ") * 5 + "Fin."]  # three rows, batch of two: one joins mid-run
    if batch:
        from knorm_gen import generate_batch_with_eviction

        results = generate_batch_with_eviction(model, tok, docs, batch_size=2, budget=32, max_tokens=6,
                                               system_prompt=system)
    else:
        results = [generate_with_eviction(model, tok, d, budget=32, max_tokens=6, system_prompt=system) for d in docs]
    by_length = {n: caches for n, caches in seen}
    assert len(by_length) == 3
    for doc, r in zip(docs, results):
        n, instruction = instruction_positions(tok, doc, system, r.tokens_seen)
        layers = [c for c in by_length[n] if isinstance(c, EvictionKVCache)]
        assert len(layers) == len(model.layers)
        for c in layers:
            for heads in kept(c):
                assert instruction <= set(heads)
        assert r.tokens_pinned == len(instruction) - 4  # the four sinks count inside the budget
        assert r.kept_bytes <= r.kv_ceiling_bytes


def test_a_code_in_the_system_prompt_is_found_at_8x(smol):
    model, tok = smol
    from knorm_gen.tuning.corpus import pydoc_sections

    context = dict(pydoc_sections())["with"]
    system = "You are a helpful assistant. The project code name is Bluefin. Remember it."
    q = ["What is the project code name?"]
    full = answer_questions(model, tok, context, q, budget=None, max_tokens=12, system_prompt=system)[0]
    n = full.prompt_tokens
    ours = answer_questions(model, tok, context, q, budget=n // 8, max_tokens=12, system_prompt=system)[0]
    assert "Bluefin" in full.text
    assert "Bluefin" in ours.text, ours.text
    assert ours.full_bytes / ours.kept_bytes > 4


def test_records_keep_their_memory_promise_for_every_row_shape(tmp_path, tiny_model_dir):
    from knorm_gen.batch.job import BatchOptions, run_batch

    rows = [
        {"id": "p", "prompt": "Count the ships. " * 20},
        {"id": "m", "messages": [{"role": "system", "content": "Be brief. " * 15},
                                 {"role": "user", "content": "Name them. " * 30}]},
        {"id": "q", "context": "The cat is black. " * 25, "questions": ["Which colour?", "And the dog?"]},
        {"id": "o", "prompt": "Short.", "budget": 8, "max_tokens": 5},
        {"id": "s", "messages": [{"role": "system", "content": "Answer briefly. " * 30},
                                 {"role": "user", "content": "Hello. " * 5}], "budget": 6},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for batch_size in (1, 8):
        out = tmp_path / f"out{batch_size}.jsonl"
        opts = BatchOptions(eviction=EvictionConfig(budget=12), generation=GenerationConfig(max_tokens=4),
                            model=str(tiny_model_dir), batch_size=batch_size)
        run_batch(str(inp), str(out), opts, progress=False)
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == len(rows) and all(r["error"] is None for r in records), records
        for r in records:
            assert r["kept_bytes"] <= r["kv_ceiling_bytes"], (batch_size, r["id"])
        s = next(r for r in records if r["id"] == "s")
        assert s["tokens_pinned"] > 6  # the instructions alone are longer than the budget: still held


def test_recent_share_sets_each_layers_window():
    # independent arithmetic: a share of each layer's own budget, leaving the rule a slot beside the sinks
    config = EvictionConfig(budget=64, recent_share=0.5, layer_budgets={1: 20})
    assert config.resolved(3).layers == ((64, 32), (20, 10), (64, 32))
    assert EvictionConfig(budget=64, recent_share=0.3).resolved(1).layers == ((64, 19),)
    assert EvictionConfig(budget=64, recent_share=0.5, recent=3).resolved(2).layers == ((64, 3), (64, 3))
    assert EvictionConfig(budget=6, n_sink=4, recent_share=0.9).resolved(1).layers == ((6, 1),)
    assert EvictionConfig(budget=64, recent_share=0.0).resolved(1).layers == ((64, 0),)


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), "half", True])
def test_recent_share_validation_names_the_field(bad):
    with pytest.raises(ValueError, match="recent_share"):
        EvictionConfig(recent_share=bad)


def test_presets_and_old_records_keep_the_eighth_window():
    from knorm_gen.eviction.config import make_configs

    for preset in ("paper", "retrieval", "summarize"):
        ev, _ = make_configs(preset=preset, budget=512)
        assert ev.resolved(30).recent == 64, preset  # 512 // 8, as before recent_share
        assert "recent_share" not in ev.to_dict()  # so records made before the field keep their fingerprints
    assert EvictionConfig(recent_share=0.25).to_dict()["recent_share"] == 0.25


def test_the_recent_share_of_each_layer_is_kept(tiny_model):
    keys = distinct_norm_keys(48, np.random.default_rng(5))
    caches = make_eviction_cache(tiny_model, EvictionConfig(budget=16, recent_share=0.5, coverage=0.0, keep="low"))
    assert all(c.recent == 8 for c in caches)
    feed_keys(caches[0], keys, [20, 1, 27])
    for h in kept(caches[0]):
        assert set(range(40, 48)) <= set(h) and len(h) == 16


def test_early_keep_rules_the_first_30_percent_of_the_full_attention_layers():
    # by hand: 30 layers -> layers 0-8; Gemma 3's global layers 5, 11, 17 -> at least two, 5 and 11
    blend = EvictionConfig(budget=64, keep="blend")  # auto pairs leverage with the blend (--preset intrinsic)
    assert blend.resolved(30).layer_keep == {i: "leverage" for i in range(9)}
    assert blend.resolved(18, [5, 11, 17]).layer_keep == {5: "leverage", 11: "leverage"}
    assert EvictionConfig(budget=64).resolved(30).layer_keep is None  # the default: the question rule in every layer
    # skipped early layers (--preset retrieval) hold everything: no rule to report
    assert EvictionConfig(budget=64, keep="blend", skip_layers=None).resolved(30).layer_keep is None
    assert EvictionConfig(budget=None).resolved(30).layer_keep is None
    # layer_keep overrides single layers; early_keep names any rule; auto pairs leverage with the blend alone
    assert EvictionConfig(budget=64, keep="blend", layer_keep={2: "low"}).resolved(10).layer_keep == {
        0: "leverage", 1: "leverage", 2: "low"}
    assert EvictionConfig(budget=64, keep="keydiff", early_keep="low").resolved(10).layer_keep == {
        0: "low", 1: "low", 2: "low"}
    assert EvictionConfig(budget=64, keep="keydiff").resolved(10).layer_keep is None


def test_early_keep_validation_and_fingerprints():
    from knorm_gen.eviction.config import make_configs

    with pytest.raises(ValueError, match="early_keep must be auto or one of"):
        EvictionConfig(early_keep="median")
    # what runs is what a record holds: "auto" under the blend is leverage; a rule equal to keep is no field,
    # so a keep-low or preset config made before early_keep keeps its fingerprint
    blend = EvictionConfig(keep="blend")
    assert blend.to_dict()["early_keep"] == "leverage"
    assert EvictionConfig(keep="blend", early_keep="leverage").to_dict() == blend.to_dict()
    for config in (EvictionConfig(), EvictionConfig(keep="low"), EvictionConfig(keep="blend", early_keep="blend"),
                   make_configs(preset="summarize")[0], make_configs(preset="paper")[0]):
        assert "early_keep" not in config.to_dict()
    assert make_configs(preset="retrieval", budget=64)[0].resolved(30).layer_keep is None
