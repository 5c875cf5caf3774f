"""run_batch on the tiny random model: records and exit codes against hand-built
records (mlx_lm's own generation, greedy decoding written out here, the positions
kept counted from the prompt's tokens) and the library's own calls."""

import json

import mlx.core as mx
import mlx_lm
import pytest

from knorm_gen import (EvictionConfig, GenerationConfig, answer_questions, generate_batch_with_eviction,
                       make_eviction_cache, probe_caches)
from knorm_gen.batch.job import BatchOptions, BatchUsageError, run_batch
from knorm_gen.models.load import get_model

from .conftest import document_span, kept_after

OPTS = dict(budget=16, max_tokens=2)


def options(**kw):
    """BatchOptions from flat settings, as the CLI builds them."""
    ev = {k: kw.pop(k) for k in list(kw) if k in ("budget", "n_sink", "recent", "keep", "skip_layers")}
    gen = {k: kw.pop(k) for k in list(kw) if k in ("max_tokens", "temperature", "top_p", "seed", "chat")}
    return BatchOptions(eviction=EvictionConfig(**ev), generation=GenerationConfig(**gen), **kw)


@pytest.fixture(scope="module")
def mt(tiny_model_dir):
    MODEL["spec"], MODEL["dir"] = str(tiny_model_dir), tiny_model_dir
    return get_model(MODEL["spec"])


MODEL = {"spec": "default"}  # the tiny model's folder once the fixture ran


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_records(path):
    return [json.loads(line) for line in open(path, "rb")]


def run(tmp_path, rows, name="in.jsonl", **kw):
    # one row at a time unless a test batches: records then follow input order and
    # each equals the single-row library call exactly
    opts = options(**{**OPTS, "batch_size": 1, "model": MODEL["spec"], **kw.pop("options", {})})
    inp = write_rows(tmp_path / name, rows)
    out = str(tmp_path / "out.jsonl")
    return run_batch(inp, out, opts, progress=False, **kw), out


# Every record's keys, in this order (README, "Output records"; tokens_pinned after tokens_kept).
FIELDS = ("id", "completion", "answers", "finish_reason", "prompt_tokens", "generated_tokens", "tokens_seen",
          "tokens_kept", "tokens_pinned", "compression_ratio", "token_ratio", "kept_bytes", "full_bytes", "saved_bytes",
          "kv_ceiling_bytes",
          "prefill_s", "decode_s", "prompt_tps", "generation_tps", "peak_memory_gb", "long_document", "model", "config", "meta",
          "fingerprint", "error")


def position_bytes():
    """KV bytes one position takes over all layers of the tiny model: keys and values, float32."""
    config = json.loads((MODEL["dir"] / "config.json").read_text())
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4


def greedy_by_hand(model, tok, ids, span, budget, max_tokens):
    """The tokens a row generates, decoded here step by step: fresh eviction caches in
    which only ``span`` is evictable, the prompt fed as mlx_lm feeds one (all but its
    last token, then the last), then the most likely token each step until max_tokens
    or an end-of-sequence token."""
    # the default rule reads a probe of the text after the span, made first, as the product makes it
    caches = probe_caches(make_eviction_cache(model, EvictionConfig(budget=budget), (span,)), model, tok, ids, (span,))
    model(mx.array(ids[:-1])[None], cache=caches)
    step, out = ids[-1:], []
    while len(out) < max_tokens and (not out or out[-1] not in tok.eos_token_ids):
        out.append(int(mx.argmax(model(mx.array(step)[None], cache=caches)[0, -1])))
        step = out[-1:]
    return out


def expected_prompt_record(tok, ids, text, tokens, budget):
    """The record of a prompt row whose only evictable tokens are ``text``'s, built by
    hand: mlx_lm feeds every generated token back (the last one too), so the cache has
    seen prompt + generated positions."""
    stop = tokens[-1] in tok.eos_token_ids
    seen = len(ids) + len(tokens)
    kept = kept_after(seen, document_span(tok, ids, text), budget)
    return {"completion": tok.decode(tokens[:-1] if stop else tokens), "answers": None,
            "finish_reason": "stop" if stop else "length", "prompt_tokens": len(ids),
            "generated_tokens": len(tokens), "tokens_seen": seen, "tokens_kept": kept,
            "kept_bytes": kept * position_bytes(), "full_bytes": seen * position_bytes(), "error": None}


def test_records_match_hand_built_records_and_share_one_shape(tmp_path, mt):
    model, tok = mt
    rows = [
        {"id": "p", "prompt": "Name a colour.", "source": "test"},
        {"id": "m", "messages": [{"role": "user", "content": "Say hi."}]},
        {"id": "q", "context": "The cat is black. The dog is white.", "questions": ["What colour is the dog?", "And the cat?"]},
        {"id": "bad", "prompt": 5},
    ]
    summary, out = run(tmp_path, rows)
    p, m, q, bad = read_records(out)
    for r in (p, m, q, bad):
        assert tuple(r) == FIELDS
    # only the user's text is evictable: the template and the answer are pinned
    ids = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    tokens = greedy_by_hand(model, tok, ids, document_span(tok, ids, "Name a colour."), 16, 2)
    want = expected_prompt_record(tok, ids, "Name a colour.", tokens, 16)
    assert want["tokens_kept"] < want["tokens_seen"]  # this row does evict
    assert {k: p[k] for k in want} == want
    # the compression is the document's own: its positions seen over those kept (the pinned ones, held whole, aside)
    start, end = document_span(tok, ids, "Name a colour.")
    outside = want["tokens_seen"] - (end - start)
    assert p["compression_ratio"] == pytest.approx((end - start) / (want["tokens_kept"] - outside))
    assert p["token_ratio"] == pytest.approx(want["tokens_seen"] / want["tokens_kept"])
    assert p["meta"] == {"source": "test"} and p["model"] == MODEL["spec"] and p["error"] is None
    # the default bounds every layer with the question rule, a quarter of the budget recent, no coverage
    assert p["config"]["budget"] == 16 and p["config"]["max_tokens"] == 2 and p["config"]["skip_layers"] == []
    assert (p["config"]["keep"], p["config"]["question_score"], p["config"]["carry"], p["config"]["recent"]) == \
        ("question", "mean", 0.25, 4) and "coverage" not in p["config"]  # 16 / 4
    # "Say hi." is shorter than the budget: nothing is evicted, so mlx_lm's own generation is the reference
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True)
    assert m["tokens_kept"] == m["tokens_seen"] == len(ids) + m["generated_tokens"]
    assert m["completion"] == mlx_lm.generate(model, tok, ids, max_tokens=2)

    refs = answer_questions(model, tok, "The cat is black. The dog is white.", ["What colour is the dog?", "And the cat?"], **OPTS)
    assert q["completion"] is None and [a["answer"] for a in q["answers"]] == [r.text for r in refs]
    assert [a["question"] for a in q["answers"]] == ["What colour is the dog?", "And the cat?"]
    assert q["generated_tokens"] == sum(r.generated_tokens for r in refs)
    assert q["tokens_seen"] == max(r.tokens_seen for r in refs)

    assert bad["id"] == "bad" and bad["error"]["type"] == "invalid_row" and bad["error"]["line"] == 4
    assert all(bad[k] is None for k in ("completion", "answers", "tokens_seen", "compression_ratio"))
    assert bad["config"] == p["config"]
    assert (summary.rows, summary.ok, summary.failed, summary.exit_code) == (4, 3, 1, 1)
    assert summary.compression_min <= summary.compression_mean <= summary.compression_max


def test_per_row_overrides(tmp_path, mt):
    rows = [{"id": 1, "prompt": "Count to five.", "max_tokens": 1},
            {"id": 2, "prompt": "Count to five.", "budget": None, "temperature": 0.0}]
    _, out = run(tmp_path, rows)
    one, full = read_records(out)
    assert one["generated_tokens"] == 1 and one["config"]["max_tokens"] == 1
    assert full["compression_ratio"] == 1.0 and full["config"]["budget"] is None
    assert full["tokens_kept"] == full["tokens_seen"]


def test_prompt_longer_than_context_is_a_record_and_the_run_goes_on(tmp_path, mt):
    rows = [{"id": "huge", "prompt": "word " * 400_000}, {"id": "ok", "prompt": "Say yes."},
            {"id": "conflict", "prompt": "Say no.", "budget": 4}]
    summary, out = run(tmp_path, rows, options={"batch_size": 4})
    by_id = {r["id"]: r for r in read_records(out)}
    huge, ok, conflict = by_id["huge"], by_id["ok"], by_id["conflict"]
    assert huge["error"]["type"] == "prompt_too_long" and "more than the model's context" in huge["error"]["message"]
    assert ok["error"] is None
    assert conflict["error"]["type"] == "invalid_row" and "n_sink + recent must be < budget" in conflict["error"]["message"]
    assert summary.errors == {"prompt_too_long": 1, "invalid_row": 1}


def test_resume_skips_done_retries_failed_and_repairs_torn_line(tmp_path, mt):
    rows = [{"id": i, "prompt": f"Say the number {i}."} for i in range(1, 5)]
    rows[2] = {"id": 3, "prompt": ""}  # fails
    summary, out = run(tmp_path, rows)
    assert (summary.ok, summary.failed) == (3, 1)
    first = open(out, "rb").read().splitlines(keepends=True)
    with open(out, "ab") as f:
        f.write(b'{"id": 9, "completion": "tor')  # a kill mid-write
    rows[2] = {"id": 3, "prompt": "Say three."}  # fixed input
    rows.append({"id": 5, "prompt": "Say five."})
    summary, out = run(tmp_path, rows)
    assert (summary.rows, summary.skipped, summary.ok, summary.failed) == (5, 3, 2, 0)
    lines = open(out, "rb").read().splitlines(keepends=True)
    kept = [line for line in first if json.loads(line)["error"] is None]
    assert lines[:3] == kept  # byte for byte
    ids = [json.loads(line)["id"] for line in lines]
    assert ids == [1, 2, 4, 3, 5] and all(json.loads(line)["error"] is None for line in lines)
    # nothing left to do: the model output is not touched
    summary, out = run(tmp_path, rows)
    assert (summary.skipped, summary.ok) == (5, 0) and open(out, "rb").read().splitlines(keepends=True) == lines


def test_overwrite_limit_stats_log_and_summary(tmp_path, mt):
    rows = [{"id": i, "prompt": f"Secret word {i}: banana."} for i in range(3)]
    stats, summ = tmp_path / "stats.jsonl", tmp_path / "summary.json"
    extra = dict(limit=2, stats_log=str(stats), summary_json=str(summ))
    summary, out = run(tmp_path, rows, options=extra)
    assert summary.rows == 2 and len(read_records(out)) == 2
    summary, out = run(tmp_path, rows, options={**extra, "overwrite": True, "limit": None})
    assert [r["id"] for r in read_records(out)] == [0, 1, 2] and summary.skipped == 0
    entries = read_records(stats)
    assert [e["id"] for e in entries] == [0, 1, 2] and [e["line"] for e in entries] == [1, 2, 3]
    assert "banana" not in stats.read_text()
    data = json.loads(summ.read_text())
    assert data["ok"] == 3 and data["exit_code"] == 0 and data["tokens_seen"] == sum(e["tokens_seen"] for e in entries)


def test_empty_input_is_zero_rows_and_success(tmp_path, mt):
    summary, out = run(tmp_path, [])
    assert (summary.rows, summary.exit_code) == (0, 0) and open(out, "rb").read() == b""
    assert "0 rows" in summary.text()


def test_usage_errors_before_any_work(tmp_path, mt):
    inp = write_rows(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = tmp_path / "sub" / "out.jsonl"
    with pytest.raises(BatchUsageError, match="skip_layers index 4 is out of range"):  # the tiny model has 4 layers
        run_batch(inp, str(out), options(skip_layers=(4,), model=MODEL["spec"]), progress=False)
    assert not out.exists()
    with pytest.raises(BatchUsageError, match="cannot read input"):
        run_batch(str(tmp_path / "missing.jsonl"), str(out), BatchOptions(model=MODEL["spec"]), progress=False)
    with pytest.raises(BatchUsageError, match="cannot write output"):
        run_batch(inp, str(tmp_path / "in.jsonl" / "out.jsonl"), BatchOptions(model=MODEL["spec"]), progress=False)
    (tmp_path / "corrupt.jsonl").write_bytes(b"not a record\n" + b'{"id": 1, "error": null}\n')
    with pytest.raises(BatchUsageError, match="not a knorm-batch record"):
        run_batch(inp, str(tmp_path / "corrupt.jsonl"), BatchOptions(model=MODEL["spec"]), progress=False)
    with pytest.raises(BatchUsageError, match="cannot load model"):
        run_batch(inp, str(out), BatchOptions(model=str(tmp_path / "nope.gguf")), progress=False)


def test_batched_run_equals_the_batch_api_and_bad_rows_stay_out(tmp_path, mt):
    # The runner and generate_batch_with_eviction build the same batches from the
    # same rows, so their outputs agree exactly; bad rows never enter a batch.
    model, tok = mt
    good = [f"Name {n} animals that live in the sea." for n in ("two", "three", "four", "five", "six")]
    rows = [{"id": f"g{i}", "prompt": p} for i, p in enumerate(good)]
    rows.insert(2, {"id": "bad", "prompt": "", "note": "empty"})
    rows.insert(4, {"id": "long", "prompt": "word " * 9000})
    rows.insert(5, {"id": "q", "context": "Ice is cold.", "question": "Is ice hot?"})
    summary, out = run(tmp_path, rows, options={"batch_size": 3})
    records = {r["id"]: r for r in read_records(out)}
    assert set(records) == {r["id"] for r in rows} and summary.ok == 6 and summary.failed == 2
    assert records["bad"]["error"]["type"] == "invalid_row" and records["long"]["error"]["type"] == "prompt_too_long"
    want = generate_batch_with_eviction(model, tok, good, batch_size=3, **OPTS)
    for i, w in enumerate(want):
        r = records[f"g{i}"]
        assert r["completion"] == w.text and r["tokens_seen"] == w.tokens_seen and r["kept_bytes"] == w.kept_bytes
    ref = answer_questions(model, tok, "Ice is cold.", ["Is ice hot?"], **OPTS)
    assert records["q"]["answers"][0]["answer"] == ref[0].text
