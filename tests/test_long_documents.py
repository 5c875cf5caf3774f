"""Documents of the length users bring: a budget that follows the document (``--ratio``),
the model's context stated, and documents longer than it (``--long-documents``)."""

import json
import math

import pytest
from click.testing import CliRunner

from knorm_gen import EvictionConfig, answer_questions, generate_with_eviction, load_model
from knorm_gen.cli.batch import batch_command
from knorm_gen.eviction.config import MIN_RATIO_BUDGET
from knorm_gen.generation.prompts import PromptTooLongError

from .conftest import document_span, make_tiny_model_dir

SENTENCES = [f"Sentence number {i} says something of its own." for i in range(200)]


def doc(n):
    return " ".join(SENTENCES[:n])


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The tiny model with a context of 600 tokens (its byte tokenizer: a token per character)."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("ctx600"))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 600
    (path / "config.json").write_text(json.dumps(config))
    return path


def invoke(*args):
    return CliRunner().invoke(batch_command, [str(a) for a in args], catch_exceptions=False)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- the ratio


def test_ratio_keeps_a_share_of_each_document_in_one_batch(tiny_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    lengths = [3, 8, 14]  # sentences: documents of about 130, 380 and 670 tokens
    rows.write_text("".join(json.dumps({"id": n, "context": doc(n)}) + "\n" for n in lengths))
    out = tmp_path / "out.jsonl"
    result = invoke(rows, "-o", out, "--model", tiny_model_dir, "--ratio", "4", "--budget", "none", "--question",
                    "Summarize the text above.", "--max-tokens", "3", "--batch-size", "3")
    assert result.exit_code == 0, result.stderr
    model, tok = load_model(str(tiny_model_dir))
    for n, r in zip(lengths, records(out)):
        assert r["config"]["ratio"] == 4.0 and r["config"]["budget"] is None and r["error"] is None
        assert r["kept_bytes"] <= r["kv_ceiling_bytes"]
        # the record's compression is the document's: its tokens over a quarter of them (within a token's rounding)
        tokens = len(tok.encode(doc(n), add_special_tokens=False))
        assert r["compression_ratio"] == pytest.approx(tokens / max(math.ceil(tokens / 4), MIN_RATIO_BUDGET), rel=0.01)
        assert 3.6 <= r["compression_ratio"] <= 4.4
    # the startup line names the model's context and what the ratio means per row
    assert "context 4,096 tokens" in result.stderr and "1/4 of each document's tokens" in result.stderr


def test_a_budget_beside_the_ratio_caps_it(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    capped = generate_with_eviction(model, tok, doc(14) + "\n\nSummarize.", ratio=4, budget=40, max_tokens=2)
    alone = generate_with_eviction(model, tok, doc(14) + "\n\nSummarize.", ratio=4, budget=None, max_tokens=2)
    ids = tok.apply_chat_template([{"role": "user", "content": doc(14) + "\n\nSummarize."}], add_generation_prompt=True)
    start, end = document_span(tok, ids, doc(14) + "\n\nSummarize.")
    outside = capped.tokens_seen - (end - start)
    assert capped.tokens_kept - outside == 40 - 4  # the cap (its four sinks in the template aside), not a quarter
    assert alone.tokens_kept - outside == math.ceil((end - start) / 4)  # a quarter of the document
    assert capped.compression_ratio > alone.compression_ratio


def test_ratio_refuses_what_it_cannot_mean():
    with pytest.raises(ValueError, match="ratio must be a number >= 1"):
        EvictionConfig(ratio=0.5)
    with pytest.raises(ValueError, match="ratio sets each layer's budget from the document"):
        EvictionConfig(ratio=4, layer_budgets={1: 64})
    assert "ratio" not in EvictionConfig(budget=512).to_dict()  # records without it keep their fingerprints
    assert EvictionConfig().to_dict()["ratio"] == 4.0 and EvictionConfig().budget is None  # neither given: 1/4


# ---------------------------------------------------------------- longer than the context


def test_a_document_longer_than_the_context_is_an_error_that_names_the_fixes(short_context, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "long", "context": doc(40)}) + "\n" + json.dumps({"id": "ok", "context": doc(3)})
                    + "\n")
    out = tmp_path / "out.jsonl"
    result = invoke(rows, "-o", out, "--model", short_context, "--question", "Summarize.", "--max-tokens", "2",
                    "--budget", "64")
    assert result.exit_code == 1
    bad, ok = records(out)
    assert bad["error"]["type"] == "prompt_too_long" and ok["error"] is None
    message = bad["error"]["message"]
    assert "more than the model's context of 600 tokens" in message and "--long-documents truncate" in message
    assert "chunk" in message and "context 600 tokens" in result.stderr
    model, tok = load_model(str(short_context))
    with pytest.raises(PromptTooLongError, match="600"):
        answer_questions(model, tok, doc(40), ["Summarize."], budget=64, max_tokens=2)


def test_truncate_keeps_the_start_and_the_end_and_says_what_was_cut(short_context):
    model, tok = load_model(str(short_context))
    text = doc(40)
    (r,) = answer_questions(model, tok, text, ["Summarize."], budget=64, max_tokens=4, long_documents="truncate")
    info = r.long_document
    n = len(tok.encode(text, add_special_tokens=False))
    assert info["mode"] == "truncate" and info["document_tokens"] == n
    assert info["kept_start"] + info["kept_end"] + info["cut"] == n and info["cut"] > 0
    assert abs(info["kept_start"] - info["kept_end"]) <= 1
    assert r.tokens_seen <= 600  # the prompt and the whole answer fit the context
    # what was kept is the document's own start and end (checked on the text, not the code's counts)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[: info["kept_start"]]).startswith("Sentence number 0 says")
    assert text.endswith(tok.decode(ids[-info["kept_end"]:]))
    fits = answer_questions(model, tok, doc(3), ["Summarize."], budget=64, max_tokens=4, long_documents="truncate")
    assert fits[0].long_document is None


def test_chunk_answers_each_piece_then_the_pieces_answers(short_context, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "long", "context": doc(60), "questions": ["Summarize.", "Who?"]}) + "\n")
    out = tmp_path / "out.jsonl"
    result = invoke(rows, "-o", out, "--model", short_context, "--max-tokens", "3", "--ratio", "4", "--budget", "none",
                    "--long-documents", "chunk", "--batch-size", "2")
    assert result.exit_code == 0, result.stderr
    (r,) = records(out)
    info = r["long_document"]
    model, tok = load_model(str(short_context))
    n = len(tok.encode(doc(60), add_special_tokens=False))
    assert info["mode"] == "chunk" and len(info["pieces"]) >= math.ceil(n / 600)
    assert sum(p["tokens"] for p in info["pieces"]) == pytest.approx(n, abs=2 * len(info["pieces"]))
    assert all(p["tokens_seen"] <= 600 for p in info["pieces"]) and r["kept_bytes"] <= r["kv_ceiling_bytes"]
    assert [a["question"] for a in r["answers"]] == ["Summarize.", "Who?"] and r["config"]["long_documents"] == "chunk"
    # the final answers come from a pass over the pieces' answers: a second run of that pass gives them again
    from knorm_gen.generation.long_documents import REDUCE_HEADER

    notes = "\n\n".join(REDUCE_HEADER.format(i=i + 1, n=len(info["pieces"])) + p["answer"].strip()
                        for i, p in enumerate(info["pieces"]))
    (again,) = answer_questions(model, tok, notes, ["Summarize."], ratio=4, budget=None, max_tokens=3)
    assert r["answers"][0]["answer"] == again.text
