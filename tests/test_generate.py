"""generate_with_eviction and answer_questions on the real embedded model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from knorm_gen.models.load import get_model
from knorm_gen import (GenerationResult, PromptTooLongError, answer_questions, generate_with_eviction,
                       stream_with_eviction)

from .conftest import RecordingModel, assert_greedy_agree
from .conftest import document_span, kept_after

ROOT = Path(__file__).resolve().parents[1]

N_LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 30, 3, 64, 4
ROW_BYTES = KV_HEADS * HEAD_DIM * 2 * FLOAT32  # keys + values of one position in one layer

PROMPT = "List three facts about the moon, one per line."


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return get_model("default")  # one load per process, shared with the other end-to-end tests


def chat_ids(tokenizer, text):
    """Independent prompt count: the tokenizer's own chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)


def test_large_budget_equals_full_cache(model_and_tokenizer):
    model, tok = model_and_tokenizer
    full = generate_with_eviction(model, tok, PROMPT, budget=None, max_tokens=24)
    big = generate_with_eviction(model, tok, PROMPT, budget=4096, max_tokens=24)
    assert full.text and full.text == big.text
    assert full.generated_tokens == big.generated_tokens
    assert big.compression_ratio == 1.0 and big.tokens_kept == big.tokens_seen


def test_eviction_accounting_against_independent_counts(model_and_tokenizer):
    model, tok = model_and_tokenizer
    text = "Summarize this: " + "The river flows to the sea and the sea rises to the clouds. " * 12
    budget, max_tokens = 48, 12
    r = generate_with_eviction(model, tok, text, budget=budget, max_tokens=max_tokens, skip_layers=(0, 1))
    n_prompt = len(chat_ids(tok, text))
    assert r.prompt_tokens == n_prompt
    assert r.finish_reason == "length" and r.generated_tokens == max_tokens
    # every generated token, including the last, is fed back through the cache
    assert r.tokens_seen == n_prompt + max_tokens
    # only the user's text is evictable: the chat template around it and the answer are pinned
    held = kept_after(r.tokens_seen, document_span(tok, chat_ids(tok, text), text), budget)
    assert r.tokens_kept == held < r.tokens_seen
    assert r.tokens_pinned == r.tokens_seen - (document_span(tok, chat_ids(tok, text), text)[1]
                                               - document_span(tok, chat_ids(tok, text), text)[0]) - 4
    full = N_LAYERS * r.tokens_seen * ROW_BYTES
    kept = 2 * r.tokens_seen * ROW_BYTES + (N_LAYERS - 2) * held * ROW_BYTES
    assert (r.full_bytes, r.kept_bytes) == (full, kept)
    # the compression is the document's: its own positions, the pinned ones (held whole) left out of both
    start, end = document_span(tok, chat_ids(tok, text), text)
    doc, pinned = end - start, r.tokens_seen - (end - start)
    assert r.compression_ratio == pytest.approx(N_LAYERS * doc / (2 * doc + (N_LAYERS - 2) * (held - pinned)))
    assert r.prefill_s > 0 and r.decode_s > 0 and r.peak_memory_gb > 0
    assert r.config["budget"] == budget and r.config["skip_layers"] == [0, 1]


def test_same_seed_same_sampled_output(model_and_tokenizer):
    model, tok = model_and_tokenizer
    kw = dict(budget=32, max_tokens=16, temperature=0.9, seed=7)
    a = generate_with_eviction(model, tok, PROMPT, **kw)
    b = generate_with_eviction(model, tok, PROMPT, **kw)
    c = generate_with_eviction(model, tok, PROMPT, **{**kw, "seed": 8})
    assert a.tokens == b.tokens and a.text == b.text
    assert c.tokens != a.tokens  # the seed really drives the sampler


FRESH = """
import json, sys, knorm_gen
model, tok = knorm_gen.load_model(sys.argv[2])
r = knorm_gen.generate_with_eviction(model, tok, sys.argv[1], budget=24, max_tokens=20)
print(json.dumps(r.tokens))
"""


def test_a_call_shares_no_state_with_earlier_calls(tiny_model_dir):
    # A fresh process has had no earlier call: the reference for "no leftover state". Leftover
    # state would be the package's, not a model's: the tiny random model loads in well under a second.
    from knorm_gen import load_model

    model, tok = load_model(str(tiny_model_dir))
    generate_with_eviction(model, tok, "Write a long poem about the sea. " * 20, budget=24, max_tokens=20)
    after = generate_with_eviction(model, tok, PROMPT, budget=24, max_tokens=20)
    proc = subprocess.run([sys.executable, "-c", FRESH, PROMPT, str(tiny_model_dir)], capture_output=True, text=True,
                          cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=True)
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    assert after.tokens and after.tokens == fresh  # same machine, same kernels, same shapes: exact


def test_prompt_forms_agree(model_and_tokenizer):
    model, tok = model_and_tokenizer
    kw = dict(budget=64, max_tokens=8)
    text = generate_with_eviction(model, tok, PROMPT, **kw)
    msgs = generate_with_eviction(model, tok, [{"role": "user", "content": PROMPT}], **kw)
    ids = generate_with_eviction(model, tok, chat_ids(tok, PROMPT), **kw)
    assert text.text == msgs.text == ids.text
    raw = generate_with_eviction(model, tok, PROMPT, chat=False, **kw)
    assert raw.prompt_tokens == len(tok.encode(PROMPT, add_special_tokens=False))


def test_stream_pieces_are_the_decoded_tokens(model_and_tokenizer):
    model, tok = model_and_tokenizer
    items = list(stream_with_eviction(model, tok, PROMPT, budget=32, max_tokens=10))
    result = items[-1]
    assert isinstance(result, GenerationResult) and all(isinstance(i, str) for i in items[:-1])
    assert len(result.tokens) == result.generated_tokens == 10 and result.finish_reason == "length"
    assert "".join(items[:-1]) == tok.decode(result.tokens) == result.text
    assert generate_with_eviction(model, tok, PROMPT, budget=32, max_tokens=10).tokens == result.tokens


@pytest.mark.parametrize("chat", [True, False])
def test_answer_questions_feeds_the_whole_prompt_and_matches_it(model_and_tokenizer, chat):
    model, tok = model_and_tokenizer
    context = ("Ada keeps her bicycle in the blue shed. Ben keeps his kayak in the red barn. "
               "The secret pass key is 48213. Remember it. ")  # a trailing space merges with the separator
    questions = ["Where is the bicycle?", "What is the secret pass key? The secret pass key is"]
    # batch_size=1: the questions run one after another, so the fed blocks can be read in order
    recorder = RecordingModel(model)
    got = answer_questions(recorder, tok, context, questions, budget=None, max_tokens=8, chat=chat, batch_size=1)
    together = answer_questions(model, tok, context, questions, budget=None, max_tokens=8, chat=chat, batch_size=2)
    fed = [t for block in recorder.inputs for t in block]
    shared = len(recorder.inputs[0])  # the context prefill comes first, once
    pos = shared
    for q, r, both in zip(questions, got, together):
        whole = context + "\n\n" + q
        want_ids = chat_ids(tok, whole) if chat else tok.encode(whole, add_special_tokens=False)
        # what this answer saw: the shared context, then its own blocks
        n_rest = len(want_ids) - shared
        assert fed[:shared] + fed[pos : pos + n_rest] == want_ids
        pos += r.tokens_seen - shared  # its question, then the generated tokens fed back
        assert r.prompt_tokens == len(want_ids) and r.question == q and r.context_prefill_s > 0
        ref = generate_with_eviction(model, tok, whole, budget=None, max_tokens=8, chat=chat)
        assert_greedy_agree(model, want_ids, r.tokens, ref.tokens)
        assert_greedy_agree(model, want_ids, both.tokens, ref.tokens)
        assert both.tokens_seen == r.tokens_seen and both.prompt_tokens == r.prompt_tokens
    assert pos == len(fed)
    if not chat:  # completion mode: nothing after the question, so the model answers it
        assert "48213" in got[1].text


def test_question_separator_is_used_as_given(model_and_tokenizer):
    model, tok = model_and_tokenizer
    recorder = RecordingModel(model)
    context, q = "The colour of the door is green.", "Q: What colour is the door?\nA:"
    (r,) = answer_questions(recorder, tok, context, [q], budget=None, max_tokens=1, chat=False,
                            question_separator="\n")
    fed = [t for block in recorder.inputs for t in block]
    want = tok.encode(context + "\n" + q, add_special_tokens=False)
    assert fed[: len(want)] == want and len(fed) == r.tokens_seen == len(want) + 1
    with pytest.raises(ValueError, match="question_separator"):
        answer_questions(model, tok, context, [q], question_separator=None)


def test_answer_questions_protects_question_and_continues_positions(model_and_tokenizer):
    model, tok = model_and_tokenizer
    context = ("Filler sentence about nothing in particular. " * 30).strip()
    q = "What is this text about?"
    budget = 40
    (r,) = answer_questions(model, tok, context, [q], budget=budget, max_tokens=6)
    rendered = tok.apply_chat_template([{"role": "user", "content": context + "\n\n" + q}],
                                       add_generation_prompt=True, tokenize=False)
    n_context = len(tok.encode(rendered.split("\n\n" + q)[0], add_special_tokens=False))
    assert r.tokens_seen == r.prompt_tokens + r.generated_tokens
    start, end = document_span(tok, tok.encode(rendered, add_special_tokens=False), context)
    assert end == n_context
    # the document is compressed to the budget; the template before it (past the four
    # sinks, which count inside the budget), the question and the answer are all kept
    assert r.tokens_kept == budget + (r.tokens_seen - n_context) + (start - 4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(budget=0), "budget"),
        (dict(budget=16, n_sink=8, recent=8), "n_sink \\+ recent"),
        (dict(keep="middle"), "keep"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_arguments(model_and_tokenizer, kwargs, match):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match=match):
        generate_with_eviction(model, tok, PROMPT, **kwargs)


def test_empty_and_too_long_prompts(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match="empty"):
        generate_with_eviction(model, tok, "   ")
    with pytest.raises(ValueError, match="empty"):
        generate_with_eviction(model, tok, [])
    with pytest.raises(PromptTooLongError, match="more than the model's context of 8192 tokens: choose --long-documents truncate"):
        generate_with_eviction(model, tok, [42] * 8193)
    with pytest.raises(PromptTooLongError):
        answer_questions(model, tok, "word " * 9000, ["why?"])
    with pytest.raises(ValueError, match="context is empty"):
        answer_questions(model, tok, "", ["why?"])
