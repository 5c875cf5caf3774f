"""generate_with_eviction and answer_questions on the real embedded model."""

import pytest

from knorm_gen import GenerationResult, answer_questions, generate_with_eviction, stream_with_eviction
from knorm_gen.models import load_model

N_LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 30, 3, 64, 4
ROW_BYTES = KV_HEADS * HEAD_DIM * 2 * FLOAT32  # keys + values of one position in one layer

PROMPT = "List three facts about the moon, one per line."


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model()


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
    assert r.tokens_kept == budget
    full = N_LAYERS * r.tokens_seen * ROW_BYTES
    kept = 2 * r.tokens_seen * ROW_BYTES + (N_LAYERS - 2) * budget * ROW_BYTES
    assert (r.full_bytes, r.kept_bytes) == (full, kept)
    assert r.compression_ratio == pytest.approx(full / kept)
    assert r.prefill_s > 0 and r.decode_s > 0 and r.peak_memory_gb > 0
    assert r.config["budget"] == budget and r.config["skip_layers"] == [0, 1]


def test_same_seed_same_output_and_no_shared_state(model_and_tokenizer):
    model, tok = model_and_tokenizer
    kw = dict(budget=32, max_tokens=16, temperature=0.9, seed=7)
    a = generate_with_eviction(model, tok, PROMPT, **kw)
    other = generate_with_eviction(model, tok, "Name a colour.", **kw)
    b = generate_with_eviction(model, tok, PROMPT, **kw)
    assert a.text == b.text and a.tokens_seen == b.tokens_seen
    assert other.prompt_tokens != a.prompt_tokens


def test_prompt_forms_agree(model_and_tokenizer):
    model, tok = model_and_tokenizer
    kw = dict(budget=64, max_tokens=8)
    text = generate_with_eviction(model, tok, PROMPT, **kw)
    msgs = generate_with_eviction(model, tok, [{"role": "user", "content": PROMPT}], **kw)
    ids = generate_with_eviction(model, tok, chat_ids(tok, PROMPT), **kw)
    assert text.text == msgs.text == ids.text
    raw = generate_with_eviction(model, tok, PROMPT, chat=False, **kw)
    assert raw.prompt_tokens == len(tok.encode(PROMPT, add_special_tokens=False))


def test_stream_pieces_join_to_result(model_and_tokenizer):
    model, tok = model_and_tokenizer
    items = list(stream_with_eviction(model, tok, PROMPT, budget=32, max_tokens=10))
    assert isinstance(items[-1], GenerationResult)
    assert "".join(items[:-1]) == items[-1].text
    assert items[-1].to_dict()["text"] == items[-1].text


def test_answer_questions_matches_full_prompt_without_eviction(model_and_tokenizer):
    model, tok = model_and_tokenizer
    context = "Ada keeps her bicycle in the blue shed. Ben keeps his kayak in the red barn."
    questions = ["Where is the bicycle?", "Where is the kayak?"]
    got = answer_questions(model, tok, context, questions, budget=None, max_tokens=12)
    for q, r in zip(questions, got):
        want = generate_with_eviction(model, tok, context + "\n\n" + q, budget=None, max_tokens=12)
        assert r.text == want.text
        assert r.prompt_tokens == want.prompt_tokens == len(chat_ids(tok, context + "\n\n" + q))
        assert r.question == q and r.context_prefill_s > 0


def test_answer_questions_protects_question_and_continues_positions(model_and_tokenizer):
    model, tok = model_and_tokenizer
    context = "Filler sentence about nothing in particular. " * 30
    q = "What is this text about?"
    budget = 40
    (r,) = answer_questions(model, tok, context, [q], budget=budget, max_tokens=6)
    rendered = tok.apply_chat_template([{"role": "user", "content": context + "\n\n" + q}],
                                       add_generation_prompt=True, tokenize=False)
    n_context = len(tok.encode(rendered.split("\n\n" + q)[0], add_special_tokens=False))
    assert r.tokens_seen == r.prompt_tokens + r.generated_tokens
    # the compressed context stays at the budget; question and answer are all kept
    assert r.tokens_kept == budget + (r.tokens_seen - n_context)


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
    with pytest.raises(ValueError, match="longer than the model context of 8192"):
        generate_with_eviction(model, tok, [42] * 8193)
    with pytest.raises(ValueError, match="context is empty"):
        answer_questions(model, tok, "", ["why?"])
