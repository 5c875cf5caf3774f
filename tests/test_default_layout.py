"""The default of 0.13 (today's default without its stratified share, ``stratify=0``),
expressed with the question rule's settings, keeps exactly the positions it kept when it was a rule
name of its own (an old name the translator reads): positions saved from the product path of commit
7857212 on fixed prompts, both models (tests/data/default_kept_*.json; Gemma 3's test is in
test_gemma.py, beside its fixture). Today's default, on the same path, gives every stretch of the
document its share, counted here from the kept positions."""

import json
from pathlib import Path

import pytest

from knorm_gen.models.load import get_model
from knorm_gen import EvictionConfig, GenerationConfig
from knorm_gen.eviction.cache import EvictionKVCache
from knorm_gen.tuning.corpus import pydoc_sections
from knorm_gen.generation.engine import BatchEngine, prefill
from knorm_gen.generation.generate import prompt_request, question_request

DATA = Path(__file__).resolve().parent / "data"
CASES = (("question", "with"), ("prompt", "objects"))
"""Of the six saved (a question row and a prompt row on each of three texts): each kind of row once covers both paths."""
QUESTION = "Summarize the documentation above in three sentences."
AGREE = 0.99  # of every (layer, head, position) kept; below it a real change, above it a near-tie or two (DESIGN 4)


def kept_by_the_default(model, tok, **layout) -> list[dict]:
    """Per case of :data:`CASES`, the kept positions of every compressed layer and head, as the
    product prefills that kind of row at budget 128 (the default of 0.13 unless ``layout`` says
    otherwise)."""
    texts = dict(pydoc_sections())
    eviction = EvictionConfig(budget=128, **({"stratify": 0.0} | layout)).for_model(model)
    engine = BatchEngine(model, tok, eviction, batch_size=1)
    out = []
    for kind, name in CASES:
        text = texts[name][:4000]
        if kind == "question":
            req = question_request(model, engine.tok, name, text, [QUESTION], eviction,
                                   GenerationConfig(max_tokens=8))
            caches, _ = engine.prefill_context(req.eviction, req.context_ids, req.spans, req.question_ids)
        else:
            req = prompt_request(model, engine.tok, name, text + "\n\nSummarize the text above.", eviction,
                                 GenerationConfig(max_tokens=8))
            caches = engine.probed_caches(req.eviction, req.ids, req.spans)
            prefill(model, req.ids[:-1], caches, 512)
        out.append({"kind": kind, "name": name, "kept": _kept(caches), "seen": caches[0].offset})
    return out


def _kept(caches) -> dict:
    return {str(i): [sorted(map(int, h)) for h in c.ordered_state()[2][0].tolist()]
            for i, c in enumerate(caches) if isinstance(c, EvictionKVCache)}


def assert_same_as_saved(got: list[dict], which: str) -> None:
    want = [c for c in json.loads((DATA / f"default_kept_{which}.json").read_text())["cases"]
            if (c["kind"], c["name"]) in CASES]
    assert [(c["kind"], c["name"]) for c in got] == [(c["kind"], c["name"]) for c in want]
    same = total = 0
    for g, w in zip(got, want):
        assert g["kept"].keys() == w["kept"].keys()
        for layer in w["kept"]:
            for gh, wh in zip(g["kept"][layer], w["kept"][layer]):
                assert len(gh) == len(wh), (g["kind"], g["name"], layer)
                same += len(set(gh) & set(wh))
                total += len(wh)
    assert same / total >= AGREE, f"{which}: {same} of {total} kept positions as saved"


@pytest.fixture(scope="module")
def smollm2():
    return get_model("default")  # one load per process, shared with the other end-to-end tests


def test_the_default_keeps_what_it_kept_as_a_rule_name_on_smollm2(smollm2):
    assert_same_as_saved(kept_by_the_default(*smollm2), "smollm2")


def test_the_default_gives_every_stretch_of_the_document_its_share(smollm2):
    # Budget 128: 4 sinks, a recent quarter (32), so 92 rule slots, 0.7 of them (64) given out over
    # stretches of the positions seen: the smallest power-of-two width giving at most 16 stretches.
    # Each whole stretch keeps at least its share (64 * width // seen) in every layer and head; the
    # unstratified layout, on the same rows, leaves some stretch below it.
    def short_stretches(cases):
        short = 0
        for case in cases:
            seen = case["seen"]
            width = next(w for w in (2 ** k for k in range(16)) if -(-seen // w) <= 16)
            share = 64 * width // seen
            for heads in case["kept"].values():
                for kept in heads:
                    counts = [sum(1 for p in kept if i * width <= p < (i + 1) * width) for i in range(seen // width)]
                    short += sum(c < share for c in counts)
        return short

    assert short_stretches(kept_by_the_default(*smollm2, stratify=0.7)) == 0
    assert short_stretches(kept_by_the_default(*smollm2)) > 0
