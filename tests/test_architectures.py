"""The contract over every architecture the installed mlx_lm ships (tests/zoo.py builds a
tiny random model of each from its own ``ModelArgs``; a new mlx_lm release's architectures
are checked the day it is installed):

- ``budget=None`` gives mlx_lm's own greedy tokens, at batch 1 and 3 (rows of different lengths);
- ``generate_with_eviction`` and a ``knorm-batch`` job (questions decoded together) evict and
  keep every ``kept_bytes <= kv_ceiling_bytes``, or the model is refused with a message that names
  the architecture and the reason;
- a keep-low layout keeps the numpy ranking of each compressed layer's keys;
- docs/models.md's support table says what the model support check found.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from knorm_gen import EvictionConfig, generate_batch_with_eviction, generate_with_eviction
from knorm_gen.eviction.cache import EvictionKVCache, make_eviction_cache
from knorm_gen.eviction.config import GenerationConfig, RowsConfig, make_configs
from knorm_gen.batch.job import BatchOptions, run_batch
from knorm_gen.platform.mlx_compat import UnsupportedModelError
from knorm_gen.models.support import model_support, support_row

from . import zoo
from .test_rules import assert_best_up_to_near_ties

DOCUMENT = ("Ada keeps her bicycle in the blue shed. Ben keeps his kayak in the red barn. The pass key is 48213. "
            "Cleo waters the garden on Sundays. Dan reads the paper at noon.")
QUESTIONS = ["What is the pass key?", "Summarize the text above."]
PROMPTS = ["The sky is blue and the sea is grey.", "Once upon a time", "A list: one, two, three, four, five."]
BUDGET = 12
TABLE = Path(__file__).resolve().parent.parent / "docs" / "models.md"


@pytest.fixture(scope="module")
def tok():
    return zoo.tiny_tokenizer()


def documented_rows() -> dict[str, dict]:
    """The support table in docs/models.md (between its markers), by architecture."""
    text = TABLE.read_text(encoding="utf-8")
    body = text.split("<!-- support table: scripts/support_table.py -->")[1].split("<!-- end of support table -->")[0]
    lines = [line for line in body.strip().splitlines() if line.startswith("|")]
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        rows[cells[0].strip("`")] = dict(zip(names, cells))
    return rows


def mlx_greedy(model, ids, n):
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1),
                                  prompt_cache=make_prompt_cache(model)):
        out.append(int(token))
    return out


def assert_same_greedy(model, ids, result, want, tol=1e-3):
    """Token for token (up to an end-of-sequence token, where ours stops and mlx_lm's loop goes
    on), or first apart where the full model's top two logits were within ``tol`` (batch shapes
    round differently: DESIGN.md section 4)."""
    got = result.tokens
    if got == want[: len(got)]:
        assert len(got) == len(want) or result.finish_reason == "stop"
        return
    i = next(k for k in range(min(len(got), len(want))) if got[k] != want[k])
    logits = model(mx.array(list(ids) + want[:i])[None])[0, -1].astype(mx.float32)
    gap = abs(logits[want[i]].item() - logits[got[i]].item())
    assert gap <= tol, f"token {i}: {got[i]} vs mlx_lm's {want[i]}, a logit gap of {gap:.2e}"


def within_ceiling(result):
    assert result.kv_ceiling_bytes is None or result.kept_bytes <= result.kv_ceiling_bytes


def run_job(model, tok, tmp_path, batch_size, eviction):
    rows = tmp_path / f"rows{batch_size}.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "a", "context": DOCUMENT, "questions": QUESTIONS},
        {"id": "b", "prompt": DOCUMENT + "\n\nWhat is the pass key?"},
        {"id": "c", "context": DOCUMENT[:90]})))
    out = tmp_path / f"out{batch_size}.jsonl"
    options = BatchOptions(eviction=eviction, generation=GenerationConfig(max_tokens=3), batch_size=batch_size,
                           rows=RowsConfig(questions=("Summarize the text above.",)))
    summary = run_batch(str(rows), str(out), options, model=model, tokenizer=tok, progress=False, log=lambda m: None)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary.exit_code == 0 and [r["error"] for r in records] == [None] * 3
    for r in records:
        assert r["kv_ceiling_bytes"] is None or r["kept_bytes"] <= r["kv_ceiling_bytes"]
        assert r["tokens_kept"] < r["tokens_seen"]
    return records


def keep_low_matches_numpy(model, ids):
    config = EvictionConfig(budget=8, keep="low", n_sink=2, recent=0).for_model(model)
    ours, plain = make_eviction_cache(model, config), make_prompt_cache(model)
    model(mx.array(ids)[None], cache=ours)  # one block: every layer's keys are those of a plain prefill
    model(mx.array(ids)[None], cache=plain)
    checked = 0
    for c, p in zip(ours, plain):
        if not isinstance(c, EvictionKVCache) or p.keys is None:  # a block that replaces attention feeds no cache
            continue
        keys = np.array(p.keys[0, :, : len(ids)].astype(mx.float32)).astype(np.float64)
        got = np.array(c.ordered_state()[2])[0]
        for h in range(keys.shape[0]):
            norms = {pos: float((keys[h, pos] ** 2).sum()) for pos in range(len(ids))}
            assert_best_up_to_near_ties(list(got[h]), norms, {0, 1}, 8, h)
        checked += 1
    return checked


@pytest.mark.parametrize("arch", zoo.ARCHITECTURES)
def test_architecture(arch, tok, tmp_path):
    documented = documented_rows()
    assert arch in documented, f"docs/models.md has no row for {arch}: run python scripts/support_table.py"
    if zoo.status(arch):  # cannot be built here: the table says why
        assert documented[arch]["outcome"] == f"not built here: {zoo.status(arch)}"
        return
    model = zoo.tiny_model(arch)
    support = model_support(model)
    row = support_row(support)
    assert {k: v for k, v in documented[arch].items() if k != "architecture"} == \
        {k: v for k, v in row.items() if k != "architecture"}, "the support table is stale"
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    want = [mlx_greedy(model, i, 3) for i in ids]
    for batch_size in (1, 3):
        got = generate_batch_with_eviction(model, tok, ids, budget=None, max_tokens=3, batch_size=batch_size)
        for i, g, w in zip(ids, got, want):
            assert_same_greedy(model, i, g, w)
    if row["outcome"] != "evicts":
        with pytest.raises(UnsupportedModelError, match=re.escape(support.architecture)):
            generate_with_eviction(model, tok, DOCUMENT, budget=BUDGET, max_tokens=2)
        return
    layout = {} if row["question rule"] == "yes" else {"preset": "intrinsic"}
    if layout:
        with pytest.raises(UnsupportedModelError, match=re.escape(support.architecture)):
            generate_with_eviction(model, tok, DOCUMENT, budget=BUDGET, max_tokens=2)
    result = generate_with_eviction(model, tok, DOCUMENT + "\n\nWhat is the pass key?", budget=BUDGET,
                                    max_tokens=3, **layout)
    within_ceiling(result)
    assert result.tokens_kept < result.tokens_seen
    # batch 3: row "a" answers both questions decoded together beside the other rows (answer_questions's
    # engine path); one row at a time is generate_with_eviction's, above
    eviction, _ = make_configs(budget=BUDGET, **layout)
    run_job(model, tok, tmp_path, 3, eviction)
    assert keep_low_matches_numpy(model, tok.encode(DOCUMENT, add_special_tokens=False)) >= 1
