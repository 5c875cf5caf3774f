"""Summarizing a corpus: plain documents with one job question, decoded together,
each answer what answer_questions gives for that document alone; the sampling
options and the system prompt (issue 18). KV memory that cannot run out:
tests/test_admission.py."""

import json

import pytest
from click.testing import CliRunner

from knorm_gen import answer_questions, generate_with_eviction
from knorm_gen.cli.batch import batch_command
from knorm_gen.models.load import load_model

QUESTION = "Summarize the text above in one sentence."
TEXTS = [
    "The river rises in the mountains and flows north through three valleys before it reaches the sea. " * 6,
    "Bees visit flowers for nectar, and on the way they carry pollen from one plant to the next. " * 8,
    "A lighthouse keeper climbs the stairs each evening to light the lamp above the rocks. " * 5,
    "Bread rises because yeast turns sugar into gas, which the dough traps in small bubbles. " * 7,
    "The library opens at nine, and the reading room stays quiet until the children arrive. " * 4,
    "Glaciers move slowly downhill, grinding the rock beneath them into fine silt and sand. " * 9,
]
FAST = dict(budget=24, max_tokens=6)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def invoke(*args):
    return CliRunner().invoke(batch_command, [str(a) for a in args], catch_exceptions=False)


def corpus(tmp_path, texts=TEXTS, field="text"):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", field: t, "source": "test"}) + "\n" for i, t in enumerate(texts)))
    return path


def records(path):
    return {r["id"]: r for r in (json.loads(line) for line in open(path))}


def test_documents_with_a_job_question_decode_together_as_each_alone(tmp_path, tiny, tiny_model_dir):
    model, tok = tiny
    inp, out = corpus(tmp_path), tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, "--model", tiny_model_dir, "--context-field", "text", "--question", QUESTION,
                    "--budget", FAST["budget"], "--max-tokens", FAST["max_tokens"], "--batch-size", 8, "-q")
    assert result.exit_code == 0, result.stderr
    got = records(out)
    assert len(got) == len(TEXTS)
    for i, text in enumerate(TEXTS):
        record = got[f"d{i}"]
        (alone,) = answer_questions(model, tok, text, [QUESTION], **FAST)
        (answer,) = record["answers"]
        assert answer["question"] == QUESTION and answer["answer"] == alone.text
        assert (answer["tokens_seen"], answer["tokens_kept"], answer["generated_tokens"]) == (
            alone.tokens_seen, alone.tokens_kept, alone.generated_tokens)
        assert record["tokens_seen"] > FAST["budget"] > 0  # the document was really compressed
        assert record["meta"] == {"source": "test"} and record["config"]["questions"] == [QUESTION]
        assert record["config"]["context_field"] == "text"


def test_a_row_keeps_its_own_question_and_prompt_rows_mix_in(tmp_path, tiny, tiny_model_dir):
    model, tok = tiny
    inp = tmp_path / "mixed.jsonl"
    rows = [{"id": "own", "text": TEXTS[0], "question": "Where does the river flow?"},
            {"id": "job", "text": TEXTS[1]},
            {"id": "p", "prompt": "Say hello."}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, "--model", tiny_model_dir, "--context-field", "text", "--question", QUESTION,
                    "--budget", 24, "--max-tokens", 6, "-q")
    assert result.exit_code == 0, result.stderr
    got = records(out)
    assert [a["question"] for a in got["own"]["answers"]] == ["Where does the river flow?"]
    assert [a["question"] for a in got["job"]["answers"]] == [QUESTION]
    assert got["p"]["completion"] == generate_with_eviction(model, tok, "Say hello.", **FAST).text


def test_changing_the_job_question_is_a_settings_change_on_resume(tmp_path, tiny_model_dir):
    inp, out = corpus(tmp_path, TEXTS[:2]), tmp_path / "out.jsonl"
    base = [inp, "-o", out, "--model", tiny_model_dir, "--context-field", "text", "--budget", 24, "--max-tokens", 4,
            "-q"]
    assert invoke(*base, "--question", QUESTION).exit_code == 0
    assert "2 skipped" in invoke(*base, "--question", QUESTION).stderr
    changed = invoke(*base, "--question", "Now list the nouns.")
    assert changed.exit_code == 2 and "other settings" in changed.stderr


def test_bad_rows_and_bad_options(tmp_path, tiny_model_dir):
    inp = tmp_path / "bad.jsonl"
    # the first row holds its document where --context-field says (a first row without it is a usage error)
    inp.write_text(json.dumps({"id": "ok", "text": TEXTS[2]}) + "\n"
                   + json.dumps({"id": "missing", "body": "no text field"}) + "\n"
                   + json.dumps({"id": "list", "text": ["a", "b"]}) + "\n"
                   + json.dumps({"id": "object", "text": {"a": 1}}) + "\n"
                   + json.dumps({"id": "long", "text": "word " * 5000}) + "\n")
    out = tmp_path / "out.jsonl"
    args = [inp, "-o", out, "--model", tiny_model_dir, "--context-field", "text", "--question", QUESTION,
            "--budget", 24, "--max-tokens", 4, "-q"]
    result = invoke(*args)
    assert result.exit_code == 1
    got = records(out)
    assert got["missing"]["error"]["type"] == "invalid_row" and "'text'" in got["missing"]["error"]["message"]
    assert got["list"]["error"]["type"] == "invalid_row" and "field 'text' must be text" in got["list"]["error"]["message"]
    assert got["object"]["error"]["type"] == "invalid_row"
    assert got["long"]["error"]["type"] == "prompt_too_long"
    assert got["ok"]["error"] is None
    for bad, message in ((["--max-kv-memory", "0"], "more than 0 bytes"), (["--max-kv-memory", "-5MiB"], "2GiB"),
                         (["--max-kv-memory", "lots"], "2GiB"), (["--repetition-penalty", "0"], "repetition_penalty"),
                         (["--repetition-penalty", "nan"], "repetition_penalty"), (["--top-k", "-1"], "top_k"),
                         (["--min-p", "1.5"], "min_p")):
        result = invoke(*args, "-o", tmp_path / "never.jsonl", *bad)
        assert result.exit_code == 2 and message in result.stderr, (bad, result.stderr)
        assert not (tmp_path / "never.jsonl").exists()


def test_repetition_penalty_and_sampling_options_reach_the_sampler(tmp_path, tiny, tiny_model_dir):
    model, tok = tiny
    prompt = "abab abab abab abab"
    plain = generate_with_eviction(model, tok, prompt, budget=None, max_tokens=24, chat=False)
    strict = generate_with_eviction(model, tok, prompt, budget=None, max_tokens=24, chat=False,
                                    repetition_penalty=1e6, repetition_context_size=8)
    window = tok.encode(prompt)[-8:]
    assert len(set(plain.tokens)) < len(plain.tokens)  # unpenalized, the random model repeats itself
    seen = list(window)
    for t in strict.tokens:  # penalized: no token repeats one of the previous 8 (independent check)
        assert t not in seen[-8:]
        seen.append(t)
    assert strict.config["repetition_penalty"] == 1e6 and "repetition_penalty" not in plain.config
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": prompt, "top_k": 1, "temperature": 1.0}) + "\n")
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, "--model", tiny_model_dir, "--budget", "none", "--max-tokens", 24, "--no-chat",
                    "--min-p", "0.05", "-q")
    assert result.exit_code == 0, result.stderr
    (record,) = records(out).values()
    assert record["config"]["top_k"] == 1 and record["config"]["min_p"] == 0.05
    assert record["completion"] == plain.text  # top_k=1 samples the most likely token: greedy


def test_system_prompt_goes_first(tmp_path, tiny):
    model, tok = tiny
    r = generate_with_eviction(model, tok, "Hello.", system_prompt="Be brief.", budget=None, max_tokens=2)
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}],
                                   add_generation_prompt=True, tokenize=True)
    assert r.prompt_tokens == len(want) and r.config["system_prompt"] == "Be brief."
    (a,) = answer_questions(model, tok, TEXTS[0], [QUESTION], system_prompt="Be brief.", budget=None, max_tokens=2)
    whole = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": TEXTS[0] + "\n\n" + QUESTION}],
                                    add_generation_prompt=True, tokenize=True)
    assert a.prompt_tokens == len(whole)
    with pytest.raises(ValueError, match="system_prompt needs the chat template"):
        generate_with_eviction(model, tok, "Hello.", system_prompt="Be brief.", chat=False, max_tokens=2)
