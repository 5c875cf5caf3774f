"""knorm-tune and --preset auto: the choice against hand-built tables, the saved
tuning per model, bad input refused before any measurement, and the layout a run
then uses read back from its records."""

import json

import mlx.core as mx
import numpy as np

import pytest
from click.testing import CliRunner

from knorm_gen.cli import batch_command, tune_command
from knorm_gen.config import EvictionConfig
from knorm_gen.models import load_model
from knorm_gen.tune import (CANDIDATES, NoTuningError, choose, load_tuning, model_identity, save_tuning, summarize,
                            tuned_config, with_needle)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KNORM_CACHE_DIR", str(tmp_path / "cache"))


def row(arm, recovered, keys, full_keys=10, ppl=1.1):
    return arm, dict(recovered=recovered, fidelity_docs=4, wins_vs_random=0, keys=keys, keys_total=10,
                     keys_of_full=keys, full_keys=full_keys, ppl_ratio=ppl)


ARMS = {a: CANDIDATES[a] for a in ("keydiff", "low_cov25", "retrieval", "random")}


def test_choose_takes_the_layout_that_meets_both_targets():
    table = dict([row("full", 1.0, 10), row("random", 0.60, 0), row("keydiff", 0.75, 5), row("low_cov25", 0.62, 9),
                  row("retrieval", 0.70, 10)])
    # keydiff misses the keys; retrieval meets both but is unbounded; low_cov25 meets both, bounded
    assert choose(table, "both", ARMS)[0] == "low_cov25"
    assert choose(table, "summarize", ARMS)[0] == "keydiff"
    name, why = choose(dict([row("full", 1, 10), row("random", 0.6, 0), row("keydiff", 0.5, 2),
                             row("low_cov25", 0.55, 3), row("retrieval", 0.4, 4)]), "both", ARMS)
    assert "no candidate met every target" in why and name in ARMS


def test_summarize_counts_keys_only_where_the_full_cache_found_them():
    rows = [dict(task="passkey", doc="d", arm="full", mode="ctq", key="1", ok=True),
            dict(task="passkey", doc="d", arm="low", mode="ctq", key="1", ok=True),
            dict(task="passkey", doc="e", arm="full", mode="ctq", key="2", ok=False),
            dict(task="passkey", doc="e", arm="low", mode="ctq", key="2", ok=True),
            dict(task="fidelity", doc="d", arm="full", nll=1.0), dict(task="fidelity", doc="d", arm="none", nll=3.0),
            dict(task="fidelity", doc="d", arm="low", nll=1.5), dict(task="fidelity", doc="d", arm="random", nll=2.0)]
    table = summarize(rows, ["full", "low", "random"])
    assert table["low"]["keys"] == 2 and table["low"]["keys_of_full"] == 1 and table["low"]["full_keys"] == 1
    assert table["low"]["recovered"] == pytest.approx(0.75) and table["low"]["wins_vs_random"] == 1


def test_needle_lands_at_a_sentence_boundary():
    text = "One. Two three. Four five six. Seven. " * 10
    out = with_needle(text, 0.5, "12345")
    at = out.index(" The pass key is 12345.")
    assert out[at - 2 : at] == ". " or out[at - 1] == "."
    assert out.replace(" The pass key is 12345. Remember it. 12345 is the pass key. ", "") == text


def test_no_tuning_names_the_command_and_a_saved_one_is_used(tiny_model_dir, tmp_path):
    model, _ = load_model(str(tiny_model_dir))
    with pytest.raises(NoTuningError, match="knorm-tune --model"):
        tuned_config(model)
    save_tuning(model, dict(chosen="low_cov25", layout=CANDIDATES["low_cov25"], job="both", ratio=4.0, budget=96,
                            docs=["a"], why="test", model_identity=model_identity(model)))
    assert tuned_config(model) == EvictionConfig(budget=96, keep="low", coverage=0.25, skip_layers=(),
                                                 recent_share=0.125)
    assert tuned_config(model, budget=40).budget == 40
    assert load_tuning(model)["chosen"] == "low_cov25"
    # a tuning saved before recent_share existed was measured with the eighth window, and keeps it
    save_tuning(model, dict(chosen="low_cov25", layout=dict(keep="low", skip_layers=(), coverage=0.25), job="both",
                            ratio=4.0, budget=96, docs=["a"], why="test", model_identity=model_identity(model)))
    assert tuned_config(model).resolved(2).layers == ((96, 12), (96, 12))  # 96 // 8
    save_tuning(model, dict(chosen="blend_cov25_rec50", layout=CANDIDATES["blend_cov25_rec50"], job="both",
                            ratio=4.0, budget=96, docs=["a"], why="test", model_identity=model_identity(model)))
    assert tuned_config(model).resolved(2).layers == ((96, 48), (96, 48))
    # one saved before early_keep existed was measured with its rule in every layer, and keeps it
    save_tuning(model, dict(chosen="blend_cov25_rec50", layout=dict(keep="blend", skip_layers=(), coverage=0.25,
                                                                    recent_share=0.5), job="both", ratio=4.0,
                            budget=96, docs=["a"], why="test", model_identity=model_identity(model)))
    assert tuned_config(model).resolved(10).layer_keep is None
    save_tuning(model, dict(chosen="lev30_blend_cov25_rec50", layout=CANDIDATES["lev30_blend_cov25_rec50"],
                            job="both", ratio=4.0, budget=96, docs=["a"], why="test",
                            model_identity=model_identity(model)))
    assert tuned_config(model).resolved(10).layer_keep == {0: "leverage", 1: "leverage", 2: "leverage"}


def test_preset_auto_uses_the_saved_tuning_and_says_so(tiny_model_dir, tmp_path):
    model, _ = load_model(str(tiny_model_dir))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "text": "The river runs to the sea. " * 4}) + "\n")
    common = [str(docs), "--model", str(tiny_model_dir), "--context-field", "text", "--question", "Sum up.",
              "--budget", "24", "--max-tokens", "3", "--preset", "auto"]
    out = tmp_path / "a.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "no saved tuning for this model" in result.stderr
    default = EvictionConfig()
    assert json.loads(out.read_text())["config"]["keep"] == default.keep
    save_tuning(model, dict(chosen="keydiff_cov25", layout=CANDIDATES["keydiff_cov25"], job="both", ratio=4.0,
                            budget=24, docs=["a"], why="test", model_identity=model_identity(model)))
    out = tmp_path / "b.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "preset auto: keydiff_cov25" in result.stderr
    config = json.loads(out.read_text())["config"]
    assert config["keep"] == "keydiff" and config["coverage"] == 0.25 and config["budget"] == 24
    # a layout field given beside the preset wins over the tuning
    out = tmp_path / "c.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "--keep", "low", "-o", str(out)], catch_exceptions=False)
    config = json.loads(out.read_text())["config"]
    assert config["keep"] == "low" and config["coverage"] == 0.25


@pytest.mark.parametrize("args,message", [
    (["--job", "translate"], "translate"),
    (["--budget", "4000"], "twice the budget"),
    (["--arms", "low,nonsense"], "unknown candidate"),
])
def test_bad_tuning_input_is_refused_before_any_measurement(tiny_model_dir, tmp_path, args, message):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "text": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_documents_without_the_field_name_it(tiny_model_dir, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "body": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir)])
    assert result.exit_code == 2 and "--context-field" in result.output and "body" in result.output


def test_a_quick_tuning_on_the_tiny_model_saves_its_choice(tiny_model_dir, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "text": "The harbor keeps a log of ships and storms. " * 40}) + "\n")
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), "--quick", "--doc-tokens",
                                               "512", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["chosen"] in CANDIDATES and "<- chosen" in result.output
    assert set(record["table"]) == {"full", "question_both_carry_rec25", "lev30_blend_cov25_rec50", "low_cov25", "random"}
    model, _ = load_model(str(tiny_model_dir))
    assert load_tuning(model)["chosen"] == record["chosen"]


def test_when_no_layout_meets_the_keys_target_the_one_with_most_keys_is_chosen():
    # The needles of real prose are lost by every layout at 4x: the choice must still
    # prefer the layout that keeps the filler keys over one that keeps a little more
    # of the summary and no key at all.
    table = dict([row("full", 1.0, 10), row("random", 0.70, 0), row("keydiff", 0.69, 5),
                  row("low_cov25", 0.72, 0), row("retrieval", 0.40, 6)])
    name, why = choose(table, "both", ARMS)
    assert name == "keydiff" and "misses pass keys 50%" in why
    # a layout missing two targets never beats one missing one
    table["keydiff"] = row("keydiff", 0.60, 5)[1]
    assert choose(table, "both", ARMS)[0] == "low_cov25"


def test_summarize_splits_the_keys_found_in_filler_from_those_in_documents():
    rows = [dict(task="passkey", doc="filler:grass", arm=a, mode="ctq", key="1", ok=True) for a in ("full", "low")]
    rows += [dict(task="passkey", doc="d", arm="full", mode="ctq", key="2", ok=True),
             dict(task="passkey", doc="d", arm="low", mode="ctq", key="2", ok=False)]
    table = summarize(rows, ["full", "low"])
    assert (table["low"]["keys_of_full"], table["low"]["filler_keys_of_full"]) == (1, 1)
    assert (table["low"]["full_keys"], table["low"]["filler_full_keys"]) == (2, 1)


def _nll_at(logits, ids, first, last):
    """Mean NLL of ids[first:last] from one full forward pass's logits (a numpy reference)."""
    lg = np.array(logits.astype(mx.float32))[0]
    lp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
    return float(-np.mean([lp[i - 1, ids[i]] for i in range(first, last)]))


def test_one_prefill_per_arm_gives_the_full_caches_nll_of_the_tail_and_of_its_summary(tiny_model_dir, monkeypatch):
    import knorm_gen.tune

    # the random tiny model's summary is one token repeated: keep it whole, so there is one to score
    monkeypatch.setattr(knorm_gen.tune, "cut_repetition", lambda ids: ids)
    from knorm_gen.prompts import context_spans, split_question_prompts
    from knorm_gen.tune import KEY_QUESTION, SUMMARY_QUESTION, Doc, Tuner

    model, tok = load_model(str(tiny_model_dir))
    doc = Doc("d", "The harbor keeps a log of ships and storms. Gulls cry over the pier at noon. " * 30)
    tuner = Tuner(model, tok, {"low_cov25": CANDIDATES["low_cov25"], "random": CANDIDATES["random"]})
    rows = tuner.document(doc, "12345", 0.5, max_tokens=12, tail=64)
    got = {(r["task"], r["arm"]): r for r in rows}
    assert {a for t, a in got if t == "passkey"} == {"full", "low_cov25", "random"}
    assert all(got[("ppl", a)]["budget"] == got[("passkey", a)]["budget"] for a in ("low_cov25", "random"))
    # reference: one plain forward pass of the whole prompt through mlx_lm's own KVCache
    text = with_needle(doc.text, 0.5, "12345")
    prefix, (sum_q, _) = split_question_prompts(tok, text, [SUMMARY_QUESTION, KEY_QUESTION], chat=tuner.chat)
    (start, end), = context_spans(tok, text, prefix, chat=tuner.chat)
    tail = min(64, (end - start) // 4)
    logits = model(mx.array(prefix)[None])
    assert got[("ppl", "full")]["nll"] == pytest.approx(_nll_at(logits, prefix, end - tail, end), rel=1e-4)
    none = got[("fidelity", "none")]
    ref = none["reference_ids"]
    assert len(ref) >= 4
    whole = prefix + sum_q + ref
    want = _nll_at(model(mx.array(whole)[None]), whole, len(prefix) + len(sum_q), len(whole))
    assert got[("fidelity", "full")]["nll"] == pytest.approx(want, rel=1e-4)
    # the compressed arms hold the budget's bytes (and the pinned template), not the document's
    low = got[("fidelity", "low_cov25")]
    assert low["kept_bytes"] < 0.5 * low["full_bytes"]


def test_preset_auto_with_a_tuning_made_at_another_ratio_says_so_and_runs_the_default(tiny_model_dir, tmp_path):
    import warnings

    from knorm_gen import generate_with_eviction

    model, tok = load_model(str(tiny_model_dir))
    text = "The river runs to the sea. " * 14
    n = len(tok.encode(text, add_special_tokens=False))
    save_tuning(model, dict(chosen="keydiff_cov25", layout=CANDIDATES["keydiff_cov25"], job="both", ratio=4.0,
                            budget=24, docs=["a"], why="test", model_identity=model_identity(model)))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "text": text}) + "\n")
    common = [str(docs), "--model", str(tiny_model_dir), "--context-field", "text", "--question", "Sum up.",
              "--max-tokens", "3", "--preset", "auto"]
    # near the tuned ratio: the tuning runs
    out = tmp_path / "near.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "--budget", str(n // 4), "-o", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0 and json.loads(out.read_text())["config"]["keep"] == "keydiff"
    # four times the compression it was tuned at: the default, and the line says why
    out = tmp_path / "far.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "--budget", str(n // 16), "-o", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "measured at 4x" in result.stderr and "--ratio 16" in result.stderr
    assert json.loads(out.read_text())["config"]["keep"] == EvictionConfig().keep
    # the Python call warns the same way
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = generate_with_eviction(model, tok, text, budget=n // 16, preset="auto", max_tokens=2, chat=False)
    assert r.config["keep"] == EvictionConfig().keep
    assert any("measured at 4x" in str(w.message) for w in seen)


def test_no_documents_and_no_shipped_corpus_is_a_usage_error(tiny_model_dir, monkeypatch):
    import knorm_gen.corpus

    monkeypatch.setattr(knorm_gen.corpus, "pydoc_sections", lambda min_chars=0: [])
    result = CliRunner().invoke(tune_command, ["--model", str(tiny_model_dir)])
    assert result.exit_code == 2 and "no documents to tune on" in result.output and "DOCS" in result.output


def test_the_arms_help_names_every_candidate():
    arms = next(p for p in tune_command.params if p.name == "arms")
    assert set(arms.help.split("All: ")[1].split(",")) == set(CANDIDATES) | {"mix"}


def test_the_budget_sweep_reports_the_smallest_budget_meeting_both_targets():
    from knorm_gen.tune import budget_sweep

    points = [dict(ratio=8.0, budget=192, recovered=0.95, keys_of_full=3, full_keys=5),  # keys miss
              dict(ratio=6.0, budget=256, recovered=0.91, keys_of_full=5, full_keys=5),  # meets both
              dict(ratio=4.0, budget=384, recovered=0.89, keys_of_full=5, full_keys=5),  # not monotone: misses
              dict(ratio=2.0, budget=768, recovered=0.97, keys_of_full=5, full_keys=5)]
    sweep = budget_sweep("blend_cov25", points, 0.9, 0.9)
    assert [p["meets"] for p in sweep["points"]] == [False, True, False, True]
    assert sweep["smallest"]["budget"] == 256
    assert budget_sweep("blend_cov25", points, 0.9, None)["smallest"]["budget"] == 192  # fidelity alone
    assert budget_sweep("blend_cov25", points, 0.99, 0.9)["smallest"] is None
    no_keys = [dict(p, keys_of_full=0, full_keys=0) for p in points]  # nothing to judge keys by: never met
    assert budget_sweep("blend_cov25", no_keys, None, 0.5)["smallest"] is None


@pytest.mark.parametrize("sweep", ["8,abc", "1.2", "inf"])
def test_a_bad_sweep_is_refused_before_the_model_loads(tmp_path, sweep):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "text": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tmp_path / "no-such-model"),
                                               "--sweep", sweep])
    assert result.exit_code == 2 and "--sweep" in result.output and "no-such-model" not in result.output, result.output


def test_the_sweep_at_the_tuned_ratio_repeats_the_tuning_and_budgets_follow_the_ratio(tiny_model_dir, tmp_path):
    text = "The harbor keeps a log of ships and storms. " * 40
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "text": text}) + "\n")
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), "--quick", "--doc-tokens",
                                               "512", "--arms", "low_cov25", "--target-keys", "0.5",
                                               "--sweep", "4,2", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    sweep = record["sweep"]
    assert sweep["arm"] == record["chosen"] == "low_cov25" and [p["ratio"] for p in sweep["points"]] == [4.0, 2.0]
    at_2 = sweep["points"][1]["budget"]
    assert sweep["points"][0]["budget"] == record["budget"] and abs(at_2 - 2 * record["budget"]) <= 1
    # a filler's key is asked twice: after the context (question pinned) and inside one prompt as the product
    # runs it; a document's after the context
    asked = {}
    for r in record["rows"]:
        if r["task"] == "passkey":
            asked.setdefault((r["doc"], r["arm"]), set()).add(r["mode"])
    fillers = {d for d, _ in asked if d.startswith("filler:")}
    assert fillers and len(fillers) < len({d for d, _ in asked})
    assert all(m == ({"ctq", "prompt"} if d in fillers else {"ctq"}) for (d, _), m in asked.items())
    at_4 = sweep["points"][0]  # the same cases and seeds as the tuning itself
    assert at_4["recovered"] == pytest.approx(record["table"]["low_cov25"]["recovered"], abs=1e-6)
    assert at_4["keys_of_full"] == record["table"]["low_cov25"]["keys_of_full"]
    assert "budget sweep of low_cov25" in result.output and "meets the targets" in result.output


def test_layer_mix_takes_each_layers_least_error_and_is_none_when_one_rule_wins_all():
    from knorm_gen.tune import MIX_RULES, layer_mix

    arms = {a: CANDIDATES[a] for a in MIX_RULES}
    errors = {"blend_cov25_rec50": {0: 0.3, 1: 0.1, 2: 0.2, 3: 0.1},
              "keydiff_cov25_rec50": {0: 0.2, 1: 0.2, 2: 0.3, 3: 0.3},
              "low_cov25_rec50": {0: 0.4, 1: 0.3, 2: 0.1, 3: 0.2},
              "leverage_cov25_rec50": {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}}
    mix = layer_mix(errors, arms)
    assert mix == {"skip_layers": (), "coverage": 0.25, "recent_share": 0.5, "keep": "blend", "early_keep": "blend",
                   "layer_keep": {0: "keydiff", 2: "low"}}
    assert EvictionConfig(budget=8, **mix).layer_keep == {0: "keydiff", 2: "low"}
    # the layers the mix gives the blend run the blend, the early ones too (no leverage by default)
    assert [EvictionConfig(budget=8, **mix).resolved(4).keep_of(i) for i in range(4)] == [
        "keydiff", "blend", "low", "blend"]
    errors["blend_cov25_rec50"] = {i: 0.0 for i in range(4)}
    assert layer_mix(errors, arms) is None
    with pytest.raises(ValueError, match="keep alone"):
        layer_mix(errors, {"a": CANDIDATES["blend_cov25"], "b": CANDIDATES["low"]})


def test_layer_error_matches_mlx_attention_over_the_kept_positions():
    from knorm_gen.tune import layer_error

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(4, 5, 16)), rng.normal(size=(2, 30, 16)), rng.normal(size=(2, 30, 16))
    kept = np.array([[0, 3, 7, 12, 29], [1, 2, 3, 20, 21]])

    def sdpa(keys, values):  # MLX's own attention, GQA by repeating each kv head for its 2 query heads
        out = mx.fast.scaled_dot_product_attention(mx.array(q[None], dtype=mx.float32),
                                                   mx.array(keys[None], dtype=mx.float32),
                                                   mx.array(values[None], dtype=mx.float32), scale=0.25)
        return np.array(out[0]).astype(np.float64)

    ref = sdpa(k, v)
    sub = sdpa(np.stack([k[h][kept[h]] for h in range(2)]), np.stack([v[h][kept[h]] for h in range(2)]))
    want = np.mean([np.linalg.norm(sub[i] - ref[i]) / np.linalg.norm(ref[i]) for i in range(4)])
    by_head = np.mean([np.linalg.norm(sub[2 * h : 2 * h + 2] - ref[2 * h : 2 * h + 2])
                       / np.linalg.norm(ref[2 * h : 2 * h + 2]) for h in range(2)])
    assert layer_error(q, k, v, 0.25, kept) == pytest.approx(by_head, rel=1e-4)
    assert want > 0.05 and layer_error(q, k, v, 0.25, np.tile(np.arange(30), (2, 1))) < 1e-12


def test_the_tuners_criterion_is_zero_when_nothing_is_evicted_and_grows_as_less_is_kept(tiny_model_dir):
    from knorm_gen.tune import Doc, Tuner

    model, tok = load_model(str(tiny_model_dir))
    doc = Doc("d", "The harbor keeps a log of ships and storms. " * 30)
    arms = {a: CANDIDATES[a] for a in ("blend_cov25", "low_cov25")}
    means = []
    for ratio in (1.0, 4.0, 16.0):
        tuner = Tuner(model, tok, arms, ratio=ratio, modes=("ctq",), log=lambda m: None)
        tuner.errors = {a: {} for a in arms}
        tuner.document(doc, "12345", 0.5)
        assert all(sorted(e) == list(range(len(model.layers))) for e in tuner.errors.values())
        means.append(np.mean([v[0] for e in tuner.errors.values() for v in e.values()]))
    assert means[0] < 1e-6 < means[1] < means[2]


def test_a_tuning_with_a_mix_saves_it_and_preset_auto_runs_each_layers_rule(tiny_model_dir, tmp_path, monkeypatch):
    import knorm_gen.tune as tune_module
    from knorm_gen.cache import make_eviction_cache

    # the criterion is read (every arm of the mix's rules gets errors), then a mix is forced:
    # low in layer 0, blend elsewhere
    seen = {}

    def forced(errors, arms):
        seen.update(errors)
        return {"skip_layers": (), "coverage": 0.25, "keep": "blend", "layer_keep": {0: "low"}}

    monkeypatch.setattr(tune_module, "layer_mix", forced)
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "text": "The harbor keeps a log of ships and storms. " * 40}) + "\n")
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), "--quick", "--doc-tokens",
                                               "512", "--arms", "blend_cov25", "--mix", "--job", "summarize", "--out",
                                               str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    n_layers = len(load_model(str(tiny_model_dir))[0].layers)
    assert set(seen) == set(tune_module.MIX_RULES) and all(sorted(e) == list(range(n_layers)) for e in seen.values())
    assert record["mix"]["layout"]["layer_keep"] == {"0": "low"} and "mix" in record["table"]
    assert record["table"]["mix"]["fidelity_docs"] == record["table"]["blend_cov25"]["fidelity_docs"]
    assert "mix: blend in every layer but low in 0" in result.output
    model, _ = load_model(str(tiny_model_dir))
    save_tuning(model, {**record, "chosen": "mix", "layout": record["mix"]["layout"]})
    caches = make_eviction_cache(model, tuned_config(model, budget=16))
    assert [c.keep for c in caches] == ["low"] + ["blend"] * (len(model.layers) - 1)


def test_perplexity_measures_a_question_arm_probed_by_the_end_of_its_text(tiny_model_dir):
    # Raw text has no questions: the question rule is probed by the text's own end, as
    # generate_with_eviction probes a prompt without questions; reference: a hand-probed
    # cache, then the tail through the model in one pass, scored in numpy.
    from knorm_gen.cache import make_eviction_cache, set_probe
    from knorm_gen.rules.question import make_probe
    from knorm_gen.spans import ALL_EVICTABLE
    from knorm_gen.tune import Doc, Tuner

    model, tok = load_model(str(tiny_model_dir))
    doc = Doc("d", "Gulls cry over the pier at noon. The harbor keeps a log of ships and storms. " * 12)
    rows = Tuner(model, tok, {"question": CANDIDATES["question"]}).perplexity(doc, tail=32)
    got = {r["arm"]: r for r in rows}
    assert set(got) == {"full", "question"}
    ids = tok.encode(doc.text, add_special_tokens=True)
    head, rest = ids[:-32], ids[-32:]
    config = EvictionConfig(budget=got["question"]["budget"], **CANDIDATES["question"])
    caches = set_probe(make_eviction_cache(model, config), make_probe(model, tok, head, ALL_EVICTABLE))
    for at in range(0, len(head) - 1, 512):  # the tuner's 512-token blocks
        model(mx.array(head[at : min(at + 512, len(head) - 1)])[None], cache=caches)
    assert caches[0].tokens_kept < caches[0].tokens_seen  # it evicted
    seq = head[-1:] + rest
    lg = model(mx.array(seq[:-1])[None], cache=caches)
    want = _nll_at(lg, seq, 1, len(seq))
    assert got["question"]["nll"] == pytest.approx(want, rel=1e-4)
    full = _nll_at(model(mx.array(ids)[None]), ids, len(head), len(ids))
    assert got["full"]["nll"] == pytest.approx(full, rel=1e-4)


def test_prompt_mode_runs_a_whole_prompt_as_generate_with_eviction_does(tiny_model_dir, monkeypatch):
    # The pass key asked inside one prompt, "prompt" mode: the ids are the chat template's own
    # rendering of the user's text; the template around it is pinned (the user's text is the one
    # evictable span), and under a probed rule the last token too, as the product's Request pins it.
    import knorm_gen.tune
    from knorm_gen.spans import ALL_EVICTABLE
    from knorm_gen.tune import KEY_QUESTION, Tuner, product_prompt

    model, tok = load_model(str(tiny_model_dir))
    text = "Gulls cry over the pier at noon. " * 20 + " The pass key is 12345. " + "Ships come in. " * 20
    prompt = text + "\n\n" + KEY_QUESTION
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
    want_ids = tok.encode(rendered, add_special_tokens=False)
    for arm, pinned_last in (("question_carry_rec25", True), ("question_rec25", True), ("random", False)):
        config = EvictionConfig(budget=64, **CANDIDATES[arm]).resolved(len(model.layers), tuple(range(len(model.layers))))
        ids, spans = product_prompt(tok, prompt, True, config)
        assert ids == want_ids
        (start, end), = spans
        assert tok.decode(ids[start:]).startswith(prompt[:20]) and "<|im_start|>user" in tok.decode(ids[:start])
        assert end == start + len(tok.encode(prompt, add_special_tokens=False))  # the template's end is pinned
        # completion style: every token evictable, but a probed rule's last token (and answer)
        ids, spans = product_prompt(tok, prompt, False, config)
        assert ids == tok.encode(prompt, add_special_tokens=True)
        assert spans == (((0, len(ids) - 1),) if pinned_last else ALL_EVICTABLE)
    # through the tuner: the prompt mode asks the key of the full cache and of each arm
    seen = []
    real = knorm_gen.tune.prefill
    monkeypatch.setattr(knorm_gen.tune, "prefill", lambda m, ids, caches, step: seen.append(list(ids)) or
                        real(m, ids, caches, step))
    rows = Tuner(model, tok, {"random": CANDIDATES["random"]}, modes=("prompt",)).passkey("d", text, "12345", 0.5)
    assert {(r["arm"], r["mode"]) for r in rows} == {("full", "prompt"), ("random", "prompt")}
    assert seen == [want_ids[:-1], want_ids[:-1]]


def test_the_tune_table_keeps_its_columns_with_long_layout_names():
    # Every row's fidelity ends where the header's 'fidelity' ends, whatever the names' lengths.
    from knorm_gen.cli import tune_table

    row = dict(recovered=0.77, ppl_ratio=1.2, wins_vs_random=3, fidelity_docs=4, keys_of_full=5, full_keys=5,
               filler_keys_of_full=4, filler_full_keys=4)
    names = ["question_per_query_carry_rec25", "low", "random", "full"]
    record = dict(table={n: row for n in names}, chosen="low", layout={}, why="a test")
    lines = tune_table(record).splitlines()
    end = lines[0].index("fidelity") + len("fidelity")
    rows = [line for line in lines[1:] if line.split(" ")[0] in names]
    assert len(rows) == 4 and all(line[end - 3 : end] == "77%" for line in rows), lines


def test_a_ctq_pass_key_is_asked_after_the_context_as_mlx_lm_would_answer_it_with_the_full_cache(tiny_model_dir):
    # The ctq case is the chat prompt (context, separator, question) split before the question; the
    # full cache's answer is mlx_lm's own greedy answer from its plain cache fed the same two pieces.
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from knorm_gen.prompts import DEFAULT_QUESTION_SEPARATOR
    from knorm_gen.tune import KEY_QUESTION, Tuner, with_needle

    model, tok = load_model(str(tiny_model_dir))
    text = with_needle("The harbor keeps a log of ships and storms. " * 30, 0.5, "12345")
    tuner = Tuner(model, tok, {"random": CANDIDATES["random"]}, ratio=4.0, modes=("ctq",), log=lambda m: None)
    prefix, q_ids, spans, budget = tuner.ctq_case(text)
    whole = tok.apply_chat_template([{"role": "user", "content": text + DEFAULT_QUESTION_SEPARATOR + KEY_QUESTION}],
                                    add_generation_prompt=True)
    assert prefix + q_ids == list(whole) and budget == len(prefix) // 4
    cache = make_prompt_cache(model)
    for start in range(0, len(prefix), tuner.step):  # the same blocks, so the same floats on any BLAS path
        model(mx.array(prefix[start : start + tuner.step])[None], cache=cache)
    want = []
    for r in stream_generate(model, tok, mx.array(q_ids), max_tokens=16, prompt_cache=cache):
        if r.token in set(tok.eos_token_ids):
            break
        want.append(r.token)
    rows = tuner.passkey("d", text, "12345", 0.5)
    assert {(r["arm"], r["mode"]) for r in rows} == {("full", "ctq"), ("random", "ctq")}
    assert [r["answer"] for r in rows if r["arm"] == "full"] == [tok.decode(want)]
    assert all(r["budget"] == budget for r in rows if r["arm"] == "random")
    # and the caches it answered from hold what mlx_lm's hold, position for position
    _, caches = tuner.ctq_answer("full", "d12345", prefix, q_ids, spans, budget)
    assert [c.offset for c in caches] == [c.offset for c in cache]
    for ours, theirs in zip(caches, cache):
        assert np.allclose(np.array(ours.state[0]), np.array(theirs.state[0]), atol=1e-4)
