"""A row's budget is worked out in one place: the product, the memory estimate and the
measuring harness give a document of every length the same budget."""

import math

import pytest

from knorm_gen.eviction.config import MIN_RATIO_BUDGET, EvictionConfig, GenerationConfig
from knorm_gen.tuning.evaluate import KEY_QUESTION, Evaluator
from knorm_gen.generation.generate import question_request
from knorm_gen.eviction.layouts import CANDIDATES
from knorm_gen.eviction.memory import kv_memory
from knorm_gen.models.load import load_model

WORDS = "harbor log ships storms gulls pier noon tide rope sail".split()


def _context(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words)) + "."


@pytest.mark.parametrize("ratio, cap", [(4.0, None), (2.5, None), (4.0, 40)])
def test_the_harness_gives_every_document_the_budget_the_product_runs(tiny_model_dir, ratio, cap):
    model, tok = load_model(str(tiny_model_dir))
    evaluator = Evaluator(model, tok, {"random": CANDIDATES["random"]}, ratio=ratio, cap=cap)
    resolved = EvictionConfig(ratio=ratio, budget=cap).for_model(model)
    for n_words in (1, 5, 20, 31, 64, 65, 150, 333):
        context = _context(n_words)
        harness = evaluator.ctq_case(context)[3]
        request = question_request(model, tok, 0, context, [KEY_QUESTION], resolved, GenerationConfig())
        product = {p[0] for p in request.eviction.layers if p is not None}
        # independent reference: the document's positions over the ratio, the sinks outside it on top
        doc = sum(b - a for a, b in request.spans)
        outside = sum(1 for i in range(EvictionConfig.n_sink) if not any(a <= i < b for a, b in request.spans))
        want = max(MIN_RATIO_BUDGET, math.ceil(doc / ratio) + outside)
        want = want if cap is None else min(want, cap)
        assert product == {want}, n_words
        assert harness == want, n_words


def test_the_memory_estimate_under_a_ratio_bounds_every_row_of_that_length(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    config = EvictionConfig(ratio=4.0)
    resolved = config.for_model(model)
    for n_words in (40, 200):
        request = question_request(model, tok, 0, _context(n_words), [KEY_QUESTION], resolved, GenerationConfig())
        doc = sum(b - a for a, b in request.spans)
        budget = {p[0] for p in request.eviction.layers if p is not None}.pop()
        estimate = kv_memory(model, config, doc_tokens=doc)
        assert min(cap for _, cap in estimate.layers if cap is not None) >= budget
