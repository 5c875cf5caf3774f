"""knorm-generate --save-prompt-cache / --prompt-cache-file (knorm_gen.generation.prompt_cache): a document
compressed once and saved, then asked many questions, each answer the one answer_questions gives."""

import hashlib
import re
from dataclasses import replace

import mlx.core as mx
import pytest
from click.testing import CliRunner

from knorm_gen import answer_questions
from knorm_gen.cli.generate import generate_command
from knorm_gen.models.load import get_model
from knorm_gen.generation.prompt_cache import PromptCacheError, answer_from, read_document, save_document

DOCUMENT = ("The harbour master logs every ship. The Mary sailed at dawn with forty barrels of salt. "
            "The Anne came in at noon with wool from the north. ") * 3
QUESTIONS = ["Which ship sailed at dawn?", "What did the Anne bring?"]
SAMPLED = {"temperature": 0.9, "seed": 3}  # sampled tokens follow the logits closely: greedy ones of a random model don't


def generate(*args, input=None):
    return CliRunner().invoke(generate_command, [str(a) for a in args], input=input, catch_exceptions=False)


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return get_model(str(tiny_model_dir))


def test_one_saved_document_answers_two_questions_as_answer_questions_does(tmp_path, tiny_model_dir, tiny):
    path = tmp_path / "doc.safetensors"
    saved = generate("--model", tiny_model_dir, "-p", "-", "--budget", "24", "--keep", "keydiff",
                     "--save-prompt-cache", path, input=DOCUMENT)
    assert saved.exit_code == 0 and saved.stdout == "", saved.stderr
    assert f"saved {path}" in saved.stderr and "x compression of the document" in saved.stderr
    before = digest(path)
    model, tok = tiny
    for question in QUESTIONS:
        for sampling in ({}, SAMPLED):
            want = answer_questions(model, tok, DOCUMENT, [question], budget=24, keep="keydiff", max_tokens=8,
                                    **sampling)[0]
            flags = [a for k, v in sampling.items() for a in (f"--{k}", v)]
            # the model and settings are the file's; the question comes from stdin
            result = generate("--prompt-cache-file", path, "-p", "-", "-m", "8", *flags, input=question)
            assert result.exit_code == 0, result.stderr
            assert result.stdout == want.text + "\n"
            line = re.search(r"prompt (\d+) tokens \((\d+) read now after (\d+) saved\), kept (\d+)", result.stderr)
            assert line, result.stderr
            prompt, read, saved_tokens, kept = map(int, line.groups())
            assert (prompt, kept) == (want.prompt_tokens, want.tokens_kept) and read + saved_tokens == prompt
            assert 0 < read < len(tok.encode(question)) + 16  # the question and the template's turn, no document
            got = answer_from(model, tok, path, question, max_tokens=8, **sampling)
            assert got.tokens == want.tokens and got.question == question
            assert (got.kept_bytes, got.tokens_pinned, got.config) == (want.kept_bytes, want.tokens_pinned,
                                                                        want.config)
    assert digest(path) == before  # read, never written
    other = answer_questions(model, tok, DOCUMENT, [QUESTIONS[0]], budget=12, keep="keydiff", max_tokens=8,
                             **SAMPLED)[0]
    assert other.tokens != answer_from(model, tok, path, QUESTIONS[0], max_tokens=8, **SAMPLED).tokens  # it can tell


def test_under_the_question_rule_the_document_is_compressed_for_the_saved_question(tmp_path, tiny):
    model, tok = tiny
    path = tmp_path / "doc.safetensors"
    save_document(model, tok, DOCUMENT, path, eviction=replace(_eviction(), budget=24),
                  generation=_generation(), questions=[QUESTIONS[0]], model_spec="tiny")
    want = answer_questions(model, tok, DOCUMENT, [QUESTIONS[0]], budget=24, max_tokens=8, **SAMPLED)[0]
    saved = read_document(path)
    for _ in range(2):  # a read document is copied for each question: asked twice, the same answer
        assert answer_from(model, tok, saved, QUESTIONS[0], max_tokens=8, **SAMPLED).tokens == want.tokens
    assert saved.questions == [QUESTIONS[0]]


@pytest.mark.parametrize("eviction, generation", [
    ({"ratio": 4.0}, {}),
    ({"budget": 20, "skip_layers": (0,)}, {"chat": False}),
    ({"budget": 24, "kv_bits": 8}, {"system_prompt": "Be brief.", "pin_prefix_chars": 10, "prefill_step_size": 64}),
])
def test_saved_documents_answer_as_answer_questions_across_settings(tmp_path, tiny_model_dir_64, eviction,
                                                                     generation):
    from knorm_gen import EvictionConfig, GenerationConfig

    model, tok = get_model(str(tiny_model_dir_64))  # heads of 64: every kv_group_size fits
    path = tmp_path / "doc.safetensors"
    save_document(model, tok, DOCUMENT, path, eviction=EvictionConfig(**eviction),
                  generation=GenerationConfig(**generation), questions=[QUESTIONS[1]], model_spec="tiny")
    want = answer_questions(model, tok, DOCUMENT, [QUESTIONS[1]], max_tokens=6, **eviction, **generation,
                            **SAMPLED)[0]
    got = answer_from(model, tok, path, QUESTIONS[1], max_tokens=6, **SAMPLED)  # the file's settings, unsaid
    assert (got.tokens, got.kept_bytes, got.compression_ratio, got.config) == \
        (want.tokens, want.kept_bytes, want.compression_ratio, want.config)


def test_a_file_saved_with_other_settings_or_model_is_refused(tmp_path, tiny_model_dir):
    path = tmp_path / "doc.safetensors"
    assert generate("--model", tiny_model_dir, "-p", DOCUMENT, "--budget", "24", "--save-prompt-cache",
                    path).exit_code == 0
    result = generate("--prompt-cache-file", path, "-p", QUESTIONS[0], "--budget", "32")
    assert result.exit_code == 2 and result.stdout == ""
    assert (f"{path} was compressed with other settings (budget: 24 in the file, 32 here): leave those options out "
            "(the file's are used), or save the document again with them") in result.stderr
    result = generate("--prompt-cache-file", path, "-p", QUESTIONS[0], "--question-separator", " ")
    assert result.exit_code == 2 and 'question_separator: "\\n\\n" in the file, " " here' in result.stderr
    result = generate("--prompt-cache-file", path, "-p", QUESTIONS[0], "--model", tmp_path)
    assert result.exit_code == 2 and "leave out --model (the file's are used)" in result.stderr
    # the same settings given again are the file's; -v says what the file holds, in one prompt's words
    result = generate("--prompt-cache-file", path, "-p", QUESTIONS[0], "--budget", "24", "-m", "2", "-v")
    assert result.exit_code == 0, result.stderr
    assert f"prompt cache {path}: a document of " in result.stderr and "compressed for no question" in result.stderr
    assert "pinned tokens held on top of it: the template, question and answer)" in result.stderr
    assert not re.search(r"\b(rows?|records?|batch(es)?)\b", result.stderr, re.IGNORECASE), result.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt-cache-file", "{tmp}/missing.safetensors", "-p", "Why?"],
     "--prompt-cache-file {tmp}/missing.safetensors: no such file; save a document there first"),
    (["--prompt-cache-file", "{tmp}/junk.safetensors", "-p", "Why?"], "save one with knorm-generate -p DOCUMENT"),
    (["--save-prompt-cache", "{tmp}/doc.bin", "-p", "A document."], "does not end in .safetensors"),
    (["--save-prompt-cache", "{tmp}/a.safetensors", "--prompt-cache-file", "{tmp}/junk.safetensors", "-p", "x"],
     "give one of them (save first, then ask)"),
    (["--question", "Why?", "-p", "A document."], "give it with --save-prompt-cache"),
    (["--save-prompt-cache", "{tmp}/a.safetensors", "--long-documents", "truncate", "-p", "A document."],
     "a saved document is read whole"),
])
def test_prompt_cache_usage_errors_exit_2(tmp_path, tiny_model_dir, args, message):
    mx.save_safetensors(str(tmp_path / "junk.safetensors"), {"x": mx.zeros(2)})
    result = generate("--model", tiny_model_dir, *[a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 2 and message.format(tmp=tmp_path) in result.stderr, result.stderr
    assert not (tmp_path / "doc.bin").exists() and not (tmp_path / "a.safetensors").exists()


def test_a_question_that_retokenizes_the_document_is_refused(tmp_path, tiny):
    model, tok = tiny
    path = tmp_path / "doc.safetensors"
    save_document(model, tok, DOCUMENT, path, eviction=replace(_eviction(), budget=24, keep="low"),
                  generation=_generation(), model_spec="tiny")
    saved = read_document(path)
    # the byte-level tiny tokenizer merges nothing: stand in for a document whose last token a question joins
    # (the whole prompt shares less of the document than the file holds)
    joined = replace(saved, ids=saved.ids + [saved.ids[-1]])
    with pytest.raises(PromptCacheError, match="start the question with a space or a new line"):
        answer_from(model, tok, joined, QUESTIONS[0], max_tokens=2)
    # and for a tokenizer or template that reads the document otherwise
    other = replace(saved, ids=[saved.ids[0] + 1] + saved.ids[1:])
    with pytest.raises(PromptCacheError, match="the tokenizer or chat template reads the document otherwise"):
        answer_from(model, tok, other, QUESTIONS[0], max_tokens=2)


def _eviction():
    from knorm_gen import EvictionConfig

    return EvictionConfig()


def _generation():
    from knorm_gen import GenerationConfig

    return GenerationConfig()
