"""Admission by KV memory: the arithmetic against hand counts, and ``--max-kv-memory``
through the command line on the tiny random model (issue 18's corpus)."""

import json
import re

import pytest

from knorm_gen.generation.admission import BATCH_STEP, KVLimit, KVNeed, batch_bytes, parse_size, sequence_need
from knorm_gen.eviction.config import EvictionConfig
from knorm_gen.eviction.memory import KVMemory, kv_memory
from knorm_gen.models.load import load_model

from .conftest import document_span
from .test_summarize import QUESTION, TEXTS, corpus, invoke, records


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.mark.parametrize("text, size", [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000),
                                        (" 64 kib ", 64 * 1024), ("100", 100), (4096, 4096)])
def test_parse_size_reads_binary_and_decimal_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad, message", [("0", "more than 0 bytes"), ("-5MiB", "2GiB"), ("lots", "2GiB"),
                                          ("5 parsecs", "2GiB"), (True, "2GiB"), (0.5, "more than 0 bytes")])
def test_parse_size_refuses_what_is_no_size(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_size(bad)


def test_needs_count_bounded_layers_at_their_cap_and_the_rest_padded_to_the_longest_row():
    memory = KVMemory([(100, 10), (100, 10), (7, None)])  # two layers bounded at 10 positions, one keeps all
    need = sequence_need(memory, 30, pinned=4)  # the last 4 positions (a question, its answer) come on top
    assert need == KVNeed(bounded_bytes=2 * 100 * (10 + 4), unbounded_positions=30)
    short = sequence_need(memory, 5)
    assert short == KVNeed(bounded_bytes=2 * 100 * 5, unbounded_positions=5)
    # the layer that keeps every token: every row padded to the longest, in steps of BATCH_STEP positions
    assert batch_bytes([need, short], 7) == need.bounded_bytes + short.bounded_bytes + 2 * BATCH_STEP * 7
    assert batch_bytes([], 7) == 0
    bounded = KVMemory([(100, 10)])
    assert sequence_need(bounded, 30) == KVNeed(1000, 0)  # nothing grows: no positions to pad


def test_kv_limit_tracks_what_is_in_flight_and_its_peak(tiny):
    from knorm_gen.generation.engine import Request
    from knorm_gen.eviction.config import GenerationConfig

    model, _ = tiny
    eviction = EvictionConfig(budget=8).for_model(model)
    generation = GenerationConfig(max_tokens=4)
    a = Request("a", eviction, generation, ids=list(range(20)))
    b = Request("b", eviction, generation, ids=list(range(30)))
    limit = KVLimit(model, 10**9)
    one = limit.bytes_with(a, alone=True)
    # the default rule probes, so the prompt's last token and 4-token answer are pinned on top of the budget
    assert one == sum(row * min(24, cap + 1 + 4) for row, cap in kv_memory(model, eviction).layers)
    limit.admit(a)
    limit.admit(b)
    assert limit.in_flight == limit.peak == one + limit.bytes_with(b, alone=True)
    limit.release(("a", 0))
    assert limit.in_flight == limit.bytes_with(b, alone=True) and limit.peak > limit.in_flight
    limit.release_request(b)
    assert limit.in_flight == 0


def _need(tiny, text, budget=24, max_tokens=4):
    """Independent count of one document's KV need: every layer's bytes per position
    times what it holds (a compressed layer: its budget plus the pinned template before
    the document, past the four sinks, and the question and answer; a layer that keeps
    every token: everything)."""
    from knorm_gen import EvictionConfig
    from knorm_gen.generation.prompts import question_prompts

    model, tok = tiny
    _, ctx, (q,) = question_prompts(model, tok, text, [QUESTION], chat=None, question_separator="\n\n")
    memory = kv_memory(model, EvictionConfig(budget=budget))
    total = len(ctx) + len(q) + max_tokens
    head = max(document_span(tok, ctx, text)[0] - 4, 0)
    held = [min(len(ctx) - head, cap) + head + len(q) + max_tokens if cap is not None else -(-total // 256) * 256
            for _, cap in memory.layers]
    return sum(row * n for (row, _), n in zip(memory.layers, held))


def test_memory_limit_one_row_at_a_time_and_none_at_all(tmp_path, tiny, tiny_model_dir):
    texts = TEXTS[:4]
    inp = corpus(tmp_path, texts)
    needs = [_need(tiny, t) for t in texts]
    common = ["--model", tiny_model_dir, "--context-field", "text", "--question", QUESTION, "--budget", 24,
              "--max-tokens", 4, "--batch-size", 8, "-q"]
    free = tmp_path / "free.jsonl"
    assert invoke(inp, "-o", free, *common).exit_code == 0
    one = tmp_path / "one.jsonl"
    limit = max(needs) + 1  # any single row fits, no two do
    assert 2 * min(needs) > limit
    summary_path = tmp_path / "one.summary.json"
    result = invoke(inp, "-o", one, *common, "--max-kv-memory", limit, "--summary-json", summary_path)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["kv_limit_bytes"] == limit and 0 < summary["kv_peak_bytes"] <= limit
    assert summary["kv_peak_bytes"] == max(needs)  # one row at a time: the peak is the largest row alone
    assert "KV memory in flight: peak" in result.stderr
    strip = lambda r: {k: v for k, v in r.items() if k not in ("prefill_s", "decode_s", "prompt_tps",
                                                                  "generation_tps", "peak_memory_gb", "answers")}
    answers = lambda r: [a["answer"] for a in r["answers"]]
    for key, record in records(one).items():
        assert strip(record) == strip(records(free)[key]) and answers(record) == answers(records(free)[key])
    none = tmp_path / "none.jsonl"
    result = invoke(inp, "-o", none, *common, "--max-kv-memory", min(needs) - 1)
    assert result.exit_code == 1
    for record in records(none).values():
        assert record["error"]["type"] == "kv_memory_exceeded"
        m = re.search(r"needs [\d.]+ MiB \((\d+) bytes\) of KV memory .* limit of [\d.]+ MiB \((\d+) bytes",
                      record["error"]["message"])
        assert m and int(m[2]) == min(needs) - 1 and int(m[1]) == needs[int(record["id"][1:])]


def test_a_memory_limit_that_fits_nothing_at_batch_size_1(tmp_path, tiny_model_dir):
    inp = corpus(tmp_path, TEXTS[:2])
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, "--model", tiny_model_dir, "--context-field", "text", "--question", QUESTION,
                    "--budget", 24, "--max-tokens", 4, "--batch-size", 1, "--max-kv-memory", "1KiB", "-q")
    assert result.exit_code == 1
    assert [r["error"]["type"] for r in records(out).values()] == ["kv_memory_exceeded"] * 2
