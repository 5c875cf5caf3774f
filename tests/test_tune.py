"""knorm-tune, --preset auto and knorm-batch --calibrate: the choice against hand-built
tables (never below random eviction beyond its interval), degenerate references left
out, the job's own compression measured, the saved tuning per model, bad input refused
before any measurement, and the layout a run then uses read back from its records; the
measurements through knorm_gen.tuning.evaluate against mlx_lm's own forward passes."""

import json
import math

import mlx.core as mx
import numpy as np

import pytest
from click.testing import CliRunner

from knorm_gen.cli.batch import batch_command

from knorm_gen.cli.tune import tune_command
from knorm_gen.eviction.config import EvictionConfig
from knorm_gen.tuning.evaluate import Evaluator, summarize, with_needle
from knorm_gen.eviction.layouts import CANDIDATES
from knorm_gen.models.load import load_model
from knorm_gen.tuning.tune import QUICK_ARMS, choose, degenerate_references, rank, separation_note
from knorm_gen.generation.tunings import NoTuningError, auto_config, load_tuning, save_tuning, tuned_config
from knorm_gen.models.load import model_fingerprint


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KNORM_CACHE_DIR", str(tmp_path / "cache"))


def row(arm, recovered, keys, full_keys=10, ppl=1.1, interval=None):
    vs = None if interval is None else sum(interval) / 2
    return arm, dict(recovered=recovered, fidelity_docs=4, wins_vs_random=0, keys=keys, keys_total=10,
                     keys_of_full=keys, full_keys=full_keys, ppl_ratio=ppl, vs_random=vs, vs_random_interval=interval)


ARMS = {a: CANDIDATES[a] for a in ("keydiff", "low", "paper", "random")}  # paper leaves layers 0-1 whole


def saved(model, name, layout=None, **kw):
    """A saved tuning for ``model`` choosing ``name`` (its layout, or ``layout``)."""
    record = dict(chosen=name, layout=CANDIDATES[name] if layout is None else layout, job="both", ratio=4.0,
                  budget=96, docs=["a"], why="test", model_identity=model_fingerprint(model))
    return save_tuning(model, {**record, **kw})


# ---- choosing ------------------------------------------------------------------------------


def test_choose_takes_the_layout_that_meets_both_targets():
    table = dict([row("full", 1.0, 10), row("random", 0.60, 0), row("keydiff", 0.75, 5), row("low", 0.62, 9),
                  row("paper", 0.70, 10)])
    # keydiff misses the keys; paper meets both but is unbounded; low meets both, bounded
    assert choose(table, "both", ARMS)[0] == "low"
    assert choose(table, "summarize", ARMS)[0] == "keydiff"
    name, why = choose(dict([row("full", 1, 10), row("random", 0.6, 0), row("keydiff", 0.5, 2),
                             row("low", 0.55, 3), row("paper", 0.4, 4)]), "both", ARMS)
    assert "no candidate met every target" in why and name in ARMS


def test_when_no_layout_meets_the_keys_target_the_one_with_most_keys_is_chosen():
    # The needles of real prose are lost by every layout at 4x: the choice must still
    # prefer the layout that keeps the filler keys over one that keeps a little more
    # of the summary and no key at all.
    table = dict([row("full", 1.0, 10), row("random", 0.70, 0), row("keydiff", 0.69, 5),
                  row("low", 0.72, 0), row("paper", 0.40, 6)])
    name, why = choose(table, "both", ARMS)
    assert name == "keydiff" and "misses pass keys 50%" in why
    # a layout missing two targets never beats one missing one
    table["keydiff"] = row("keydiff", 0.60, 5)[1]
    assert choose(table, "both", ARMS)[0] == "low"


def test_a_layout_below_random_beyond_its_interval_is_never_chosen():
    below, within = (-0.20, -0.05), (-0.10, 0.04)
    # retrieve: low finds every key but keeps less of a summary than random beyond its interval
    table = dict([row("full", 1.0, 10), row("random", 0.70, 2), row("low", 0.40, 10, interval=below),
                  row("keydiff", 0.66, 6, interval=within), row("paper", 0.5, 5, interval=below)])
    name, why = choose(table, "retrieve", ARMS)
    assert name == "keydiff" and "left out, below random eviction beyond the 95% interval: low, paper" in why
    assert rank(table, "retrieve", ARMS) == ["keydiff"]
    # summarize: every candidate below random beyond its interval, so random eviction, and the line says so
    table["keydiff"] = row("keydiff", 0.50, 6, interval=below)[1]
    name, why = choose(table, "summarize", ARMS)
    assert name == "random" and "every candidate (keydiff, low, paper)" in why and "fidelity 70%" in why
    # both: random too, with the pass keys it will lose
    name, why = choose(table, "both", ARMS)
    assert name == "random" and "it finds 2 of the full cache's 10 pass keys, so it will lose 8" in why
    # an interval that reaches 0 is not beyond it: that candidate stays
    table["paper"] = row("paper", 0.69, 10, interval=(-0.05, 0.0))[1]
    assert choose(table, "both", ARMS)[0] == "paper"


def fidelity_rows(recovered: dict[str, list[float]], task: str = "fidelity") -> list[dict]:
    """Hand-made fidelity rows: per arm its recovered share on each document (none at 3, full at 1)."""
    rows = []
    for i in range(len(next(iter(recovered.values())))):
        rows += [dict(task=task, doc=f"d{i}", arm="none", nll=3.0),
                 dict(task=task, doc=f"d{i}", arm="full", nll=1.0)]
        rows += [dict(task=task, doc=f"d{i}", arm=a, nll=3.0 - 2.0 * v[i]) for a, v in recovered.items()]
    return rows


def test_human_written_summaries_judge_the_choice_where_the_documents_carry_them():
    from knorm_gen.cli.tune import tune_table
    from knorm_gen.tuning.tune import decide

    arms = {a: CANDIDATES[a] for a in ("default", "spread50", "random")}
    # against the full cache's own summary the default leads; against the authors' summaries it is
    # 0.2 below random on every document, and spread50 is level with random
    own = fidelity_rows({"random": [0.4] * 4, "default": [0.7] * 4, "spread50": [0.5] * 4})
    human = fidelity_rows({"random": [0.6] * 4, "default": [0.4] * 4, "spread50": [0.6] * 4}, "fidelity_human")
    texts = {f"d{i}": "x " * 50 for i in range(4)}
    record = decide(own, texts, lambda t: t.split(), "summarize", arms)
    assert record["fidelity_measure"] == "fidelity" and record["chosen"] == "default"
    record = decide(own + human, texts, lambda t: t.split(), "summarize", arms)
    assert record["fidelity_measure"] == "fidelity_human" and record["chosen"] == "spread50"
    assert record["table"]["default"]["recovered"] == pytest.approx(0.4)
    assert record["table"]["default"]["vs_random"] == pytest.approx(-0.2)
    assert record["table"]["default"]["recovered_human"] == pytest.approx(0.4)
    assert "the share recovered of the documents' human-written summaries" in tune_table(record)


def test_the_summary_field_of_tuning_documents_is_read_and_a_bad_one_named(tmp_path):
    from knorm_gen.cli.options import UsageFailure
    from knorm_gen.cli.tune import _tune_documents

    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"id": "a", "context": "Body.", "abstract": " The authors' words. "}) + "\n"
                    + json.dumps({"id": "b", "context": "Other body."}) + "\n")
    docs = _tune_documents(str(path), "context", 5, "abstract")
    assert [(d.name, d.summary) for d in docs] == [("a", "The authors' words."), ("b", None)]
    assert [d.summary for d in _tune_documents(str(path), "context", 5)] == [None, None]
    path.write_text(json.dumps({"id": "a", "context": "Body.", "summary": ["a list"]}) + "\n")
    with pytest.raises(UsageFailure, match="line 1: field 'summary' must be the summary's text"):
        _tune_documents(str(path), "context", 5)


def test_the_table_says_when_its_documents_cannot_separate_the_arms():
    arms = {a: CANDIDATES[a] for a in ("default", "spread25", "random")}
    clear = fidelity_rows({"random": [0.5, 0.5, 0.5, 0.5], "default": [0.8, 0.82, 0.79, 0.81],
                           "spread25": [0.6, 0.62, 0.59, 0.61]})
    table = summarize(clear, ["full", *arms])
    assert table["default"]["vs_random_interval"][0] > 0
    assert separation_note(clear, table, rank(table, "summarize", arms), "default") is None
    # as far from random, but the runner-up within noise of the chosen one
    close = fidelity_rows({"random": [0.5, 0.5, 0.5, 0.5], "default": [0.8, 0.7, 0.9, 0.8],
                           "spread25": [0.75, 0.85, 0.8, 0.78]})
    table = summarize(close, ["full", *arms])
    chosen = choose(table, "summarize", arms)[0]
    note = separation_note(close, table, rank(table, "summarize", arms), chosen)
    assert note == "4 documents cannot separate these arms; measure more (--docs-limit)"
    # one document: no interval at all
    one = fidelity_rows({"random": [0.5], "default": [0.8], "spread25": [0.6]})
    table = summarize(one, ["full", *arms])
    assert separation_note(one, table, rank(table, "summarize", arms), "default").startswith("1 documents cannot")


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


def test_summarize_splits_the_keys_found_in_filler_from_those_in_documents():
    rows = [dict(task="passkey", doc="filler:grass", arm=a, mode="ctq", key="1", ok=True) for a in ("full", "low")]
    rows += [dict(task="passkey", doc="d", arm="full", mode="ctq", key="2", ok=True),
             dict(task="passkey", doc="d", arm="low", mode="ctq", key="2", ok=False)]
    table = summarize(rows, ["full", "low"])
    assert (table["low"]["keys_of_full"], table["low"]["filler_keys_of_full"]) == (1, 1)
    assert (table["low"]["full_keys"], table["low"]["filler_full_keys"]) == (2, 1)


# ---- degenerate references ------------------------------------------------------------------


def test_a_degenerate_reference_is_named_with_why():
    def encode(text):  # a word per token
        return [hash(w) for w in text.split()]

    docs = {"title": "Attention Is Not All You Need\nWe study how transformers attend when the context grows. " * 3,
            "head": "The harbor keeps a log of ships and storms that pass the pier in winter. More follows. " * 3,
            "short": "Gulls cry over the pier at noon. " * 10, "open": "Boats come in at dawn. " * 10,
            "good": "The ledger lists the entries of the week. Nothing in it is out of the ordinary. " * 5}

    def none_row(doc, reference):
        return dict(task="fidelity", doc=doc, arm="none", nll=3.0, reference=reference,
                    reference_ids=encode(reference))

    rows = [none_row("title", " Attention Is Not All You Need"),  # the title again
            none_row("head", "The harbor keeps a log of ships and storms that pass the sea every day of the year."),
            none_row("short", "Gulls cry."),
            none_row("open", "Boats come in at dawn and leave at dusk while the gulls cry over the pier"),
            none_row("good", "The ledger of a week is summarized: it lists the usual entries and nothing unusual."),
            dict(task="fidelity", doc="good", arm="full", nll=1.0)]
    found = degenerate_references(rows, docs, encode)
    assert found == {"title": "its summary repeats the document's first line",
                     "head": "its summary repeats the document's first line",
                     "short": "its summary is shorter than a sentence (2 tokens)",
                     "open": "its summary has no sentence end"}


def test_a_degenerate_reference_leaves_its_document_out_of_fidelity_and_the_table_says_so():
    from knorm_gen.cli.tune import tune_table
    from knorm_gen.tuning.tune import decide

    arms = {a: CANDIDATES[a] for a in ("default", "random")}
    rows = fidelity_rows({"random": [0.5, 0.5, 0.1], "default": [0.8, 0.4, 1.0]})
    for r in rows:
        if r["arm"] == "none":
            r["reference"] = "A good summary of it. It says what the document says." if r["doc"] != "d2" else "Doc 2"
            r["reference_ids"] = list(range(12 if r["doc"] != "d2" else 2))
    record = decide(rows, {"d0": "x " * 50, "d1": "y " * 50, "d2": "Doc 2\nz " * 50}, lambda t: t.split(),
                    "summarize", arms)
    assert record["left_out"] == {"d2": "its summary repeats the document's first line"}
    assert record["table"]["default"]["fidelity_docs"] == 2
    assert record["table"]["default"]["recovered"] == pytest.approx(0.6)
    record.update(compression={"d0": 4.0, "d1": 4.2, "d2": 3.9}, budget=512)
    text = tune_table(record)
    assert "left out of fidelity: d2: its summary repeats the document's first line" in text
    assert "measured at 4.03x" in text and "2 documents cannot separate these arms" in text


# ---- the saved tuning and --preset auto ---------------------------------------------------------


def test_no_tuning_names_the_command_and_a_saved_one_is_used(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    with pytest.raises(NoTuningError, match="knorm-tune --model"):
        tuned_config(model)
    saved(model, "low")
    assert tuned_config(model) == EvictionConfig(budget=96, **CANDIDATES["low"])
    assert tuned_config(model, budget=40).budget == 40
    assert load_tuning(model)["chosen"] == "low"
    # a tuning saved before recent_share existed was measured with the eighth window, and keeps it
    saved(model, "low", layout=dict(keep="low", skip_layers=(), coverage=0.25))
    assert tuned_config(model).resolved(2).layers == ((96, 12), (96, 12))  # 96 // 8
    saved(model, "intrinsic")
    assert tuned_config(model).resolved(2).layers == ((96, 48), (96, 48))
    assert tuned_config(model).resolved(10).layer_keep == {0: "leverage", 1: "leverage", 2: "leverage"}
    # one saved before early_keep existed was measured with its rule in every layer, and keeps it
    saved(model, "intrinsic", layout=dict(keep="blend", skip_layers=(), coverage=0.25, recent_share=0.5))
    assert tuned_config(model).resolved(10).layer_keep is None
    # a plain keep="question" saved before its settings was the best reading without carry; an old rule
    # name is read by the translator
    saved(model, "question", layout=dict(keep="question", skip_layers=()))
    assert (tuned_config(model).question_score, tuned_config(model).carry) == ("best", 0.0)
    from knorm_gen.eviction.legacy import OLD_RULE_NAMES

    old = next(n for n, f in OLD_RULE_NAMES.items() if (f["question_score"], f["carry"]) == ("mean", 0.25))
    saved(model, "default", layout=dict(keep=old, skip_layers=(), recent_share=0.25))
    config = tuned_config(model)
    assert (config.keep, config.question_score, config.carry) == ("question", "mean", 0.25)


def test_preset_auto_refuses_a_tuning_below_random_and_uses_an_older_one_without_an_interval(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    default = EvictionConfig(budget=96)
    saved(model, "keydiff", table={"keydiff": dict(vs_random=-0.1, vs_random_interval=[-0.2, -0.03])})
    config, note = auto_config(model, default, ratio=4.0)
    assert config == default
    assert "kept less of a summary than random eviction beyond its 95% interval" in note and "default" in note
    saved(model, "keydiff", table={"keydiff": dict(vs_random=-0.1, vs_random_interval=[-0.2, 0.01])})
    assert auto_config(model, default, ratio=4.0)[0].keep == "keydiff"
    saved(model, "keydiff")  # an older tuning: no table interval
    config, note = auto_config(model, default, ratio=4.0)
    assert config.keep == "keydiff" and note.startswith("preset auto: keydiff (")


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
    saved(model, "intrinsic", budget=24)
    out = tmp_path / "b.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "preset auto: intrinsic (" in result.stderr
    config = json.loads(out.read_text())["config"]
    assert config["keep"] == "blend" and config["coverage"] == 0.25 and config["budget"] == 24
    # a layout field given beside the preset wins over the tuning
    out = tmp_path / "c.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "--keep", "low", "-o", str(out)], catch_exceptions=False)
    config = json.loads(out.read_text())["config"]
    assert config["keep"] == "low" and config["coverage"] == 0.25


def test_preset_auto_with_a_tuning_made_at_another_ratio_says_so_and_runs_the_default(tiny_model_dir, tmp_path):
    import warnings

    from knorm_gen import generate_with_eviction

    model, tok = load_model(str(tiny_model_dir))
    text = "The river runs to the sea. " * 14
    n = len(tok.encode(text, add_special_tokens=False))
    saved(model, "keydiff", budget=24)
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


# ---- knorm-tune on the command line ------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--task", "translate"], "translate"),
    (["--budget", "4000"], "twice the budget"),
    (["--arms", "low,nonsense"], "unknown candidate"),
    (["--arms", "random"], "only random eviction"),
])
def test_bad_tuning_input_is_refused_before_any_measurement(tiny_model_dir, tmp_path, args, message):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "context": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_documents_without_the_field_name_it(tiny_model_dir, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "body": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir)])
    assert result.exit_code == 2 and "--context-field" in result.output and "body" in result.output


def test_no_documents_and_no_shipped_corpus_is_a_usage_error(tiny_model_dir, monkeypatch):
    import knorm_gen.tuning.corpus

    monkeypatch.setattr(knorm_gen.tuning.corpus, "pydoc_sections", lambda min_chars=0: [])
    result = CliRunner().invoke(tune_command, ["--model", str(tiny_model_dir)])
    assert result.exit_code == 2 and "no documents to tune on" in result.output and "DOCS" in result.output


def test_the_arms_help_names_every_candidate():
    arms = next(p for p in tune_command.params if p.name == "arms")
    assert set(arms.help.split("All: ")[1].split(",")) == set(CANDIDATES)
    assert not any(p.name == "with_mix" for p in tune_command.params)


def test_a_quick_tuning_measures_three_documents_and_saves_its_choice(tiny_model_dir, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "context": f"Log {i}. The harbor keeps a log of ships and storms. " * 12})
                            + "\n" for i in range(4)))
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), "--quick", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["chosen"] in CANDIDATES and "<- chosen" in result.output
    assert set(record["table"]) == {"full", *QUICK_ARMS} and record["docs"] == ["0", "1", "2"]
    assert "vs random [95%]" in result.output and "measured at" in result.output
    model, _ = load_model(str(tiny_model_dir))
    assert load_tuning(model)["chosen"] == record["chosen"]
    assert load_tuning(model)["layout"] == json.loads(json.dumps(CANDIDATES[record["chosen"]]))


def test_the_tuner_measures_the_jobs_compression_at_its_budget(tiny_model_dir, tmp_path):
    # documents of about 2,000 tokens, longer than the 1,024 tokens --quick used to cut them to: each is
    # measured whole, and every arm keeps the job's 256 tokens of it (about 8x, not 4x)
    model, tok = load_model(str(tiny_model_dir))
    text = "The harbor keeps a log of ships and storms. Gulls cry over the pier at noon. " * 26
    n = len(tok.encode(text, add_special_tokens=False))
    assert 1900 < n < 2200
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "long", "context": text}) + "\n")
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), "--budget", "256",
                                               "--arms", "default", "--quick", "--no-save", "--out",
                                               str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    rows = [r for r in record["rows"] if r["doc"] == "long" and r["arm"] not in ("full", "none")]
    assert rows and all(r["budget"] == 256 for r in rows)
    assert all(n < r["doc_tokens"] < n + 80 for r in rows)  # the whole document and its key sentence
    assert record["compression"]["long"] == pytest.approx(rows[0]["doc_tokens"] / 256)
    assert record["budget"] == 256 and record["ratio"] == pytest.approx(record["compression"]["long"])
    assert f"measured at {record['ratio']:.2f}x" in result.output and record["ratio"] > 7.5


def test_the_tune_table_keeps_its_columns_with_long_layout_names():
    # Every row's fidelity ends where the header's 'fidelity' ends, whatever the names' lengths.
    from knorm_gen.cli.tune import tune_table

    entry = dict(recovered=0.77, ppl_ratio=1.2, wins_vs_random=3, fidelity_docs=4, keys_of_full=5, full_keys=5,
                 filler_keys_of_full=4, filler_full_keys=4, vs_random=0.031, vs_random_interval=(-0.01, 0.07))
    names = ["a_long_candidate_name_of_30_chars", "low", "random", "full"]
    record = dict(table={n: entry for n in names}, chosen="low", layout={"keep": "low"}, why="a test")
    lines = tune_table(record).splitlines()
    end = lines[0].index("fidelity") + len("fidelity")
    rows = [line for line in lines[1:] if line.split(" ")[0] in names]
    assert len(rows) == 4 and all(line[end - 3 : end] == "77%" for line in rows), lines
    vs = lines[0].index("vs random [95%]") + len("vs random [95%]")
    assert all(line[vs - 10 : vs] == "[-1%, +7%]" for line in rows), lines


def test_the_budget_sweep_reports_the_smallest_budget_meeting_both_targets():
    from knorm_gen.tuning.tune import budget_sweep

    points = [dict(ratio=8.0, budget=192, recovered=0.95, keys_of_full=3, full_keys=5),  # keys miss
              dict(ratio=6.0, budget=256, recovered=0.91, keys_of_full=5, full_keys=5),  # meets both
              dict(ratio=4.0, budget=384, recovered=0.89, keys_of_full=5, full_keys=5),  # not monotone: misses
              dict(ratio=2.0, budget=768, recovered=0.97, keys_of_full=5, full_keys=5)]
    sweep = budget_sweep("keydiff", points, 0.9, 0.9)
    assert [p["meets"] for p in sweep["points"]] == [False, True, False, True]
    assert sweep["smallest"]["budget"] == 256
    assert budget_sweep("keydiff", points, 0.9, None)["smallest"]["budget"] == 192  # fidelity alone
    assert budget_sweep("keydiff", points, 0.99, 0.9)["smallest"] is None
    no_keys = [dict(p, keys_of_full=0, full_keys=0) for p in points]  # nothing to judge keys by: never met
    assert budget_sweep("keydiff", no_keys, None, 0.5)["smallest"] is None


@pytest.mark.parametrize("sweep", ["8,abc", "1.2", "inf"])
def test_a_bad_sweep_is_refused_before_the_model_loads(tmp_path, sweep):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "context": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tmp_path / "no-such-model"),
                                               "--sweep", sweep])
    assert result.exit_code == 2 and "--sweep" in result.output and "no-such-model" not in result.output, result.output


def test_the_sweep_at_the_tuned_ratio_repeats_the_tuning_and_budgets_follow_the_ratio(tiny_model_dir, tmp_path):
    text = "The harbor keeps a log of ships and storms. " * 16
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "context": text}) + "\n")
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(tune_command, [str(docs), "--model", str(tiny_model_dir), "--quick", "--arms", "low",
                                               "--target-keys", "0.5", "--sweep", "4,2", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    sweep = record["sweep"]
    assert sweep["arm"] == record["chosen"] == "low" and [p["ratio"] for p in sweep["points"]] == [4.0, 2.0]
    at_2 = sweep["points"][1]["budget"]
    # the document's share doubles at 2x; the four sinks before it are held on top at either ratio
    assert sweep["points"][0]["budget"] == record["budget"] and abs((at_2 - 4) - 2 * (record["budget"] - 4)) <= 1
    # at --ratio each document's arms keep its tokens / ratio, as the product runs it: the template's first
    # four tokens (the sinks, before the document) are held in the budget's slots on top
    assert all(r["budget"] == math.ceil(r["doc_tokens"] / 4) + 4 for r in record["rows"]
               if r["task"] == "ppl" and r["arm"] != "full")
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
    assert at_4["recovered"] == record["table"]["low"]["recovered"]
    assert at_4["keys_of_full"] == record["table"]["low"]["keys_of_full"]
    assert "budget sweep of low" in result.output and "meets the targets" in result.output


# ---- knorm-batch --calibrate ---------------------------------------------------------------------


def test_calibrate_chooses_saves_and_names_the_layout_in_every_record(tiny_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "text": f"Log {i}. The harbor keeps a log of ships. " * 9, "src": i})
                            + "\n" for i in range(3)))
    common = [str(rows), "--model", str(tiny_model_dir), "--context-field", "text", "--question", "Sum up.",
              "--budget", "64", "--max-tokens", "2"]
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    result = CliRunner().invoke(batch_command, [*common, "--calibrate", "2", "-o", str(out), "--summary-json",
                                                str(summary)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    layout = json.loads(summary.read_text())["layout"]
    assert layout["name"] in QUICK_ARMS and layout["why"].startswith("calibrated on 2 of the first rows' documents")
    assert all(r["meta"] == {"layout": layout, "src": r["id"]} for r in records) and len(records) == 3
    assert all(r["config"]["keep"] == CANDIDATES[layout["name"]]["keep"] for r in records)
    assert f"layout: {layout['name']}: calibrated" in result.stderr
    model, _ = load_model(str(tiny_model_dir))
    tuning = load_tuning(model)
    assert tuning["chosen"] == layout["name"] and tuning["calibrated"]["rows"] == ["row 1", "row 2"]
    # a rerun finds the saved tuning: no calibration, the same layout, and every record already done
    result = CliRunner().invoke(batch_command, [*common, "--calibrate", "2", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0 and "saved tuning, so no calibration" in result.stderr, result.output
    assert "3 skipped" in result.stderr
    # a layout set by the user is not calibrated, and its records say so
    other = tmp_path / "low.jsonl"
    result = CliRunner().invoke(batch_command, [*common, "--calibrate", "2", "--keep", "low", "-o", str(other)],
                                catch_exceptions=False)
    assert result.exit_code == 0 and "the layout was set (keep=low)" in result.stderr
    assert json.loads(other.read_text().splitlines()[0])["meta"]["layout"]["name"] == "given"
    # and a run without --calibrate keeps its records' meta as the rows gave it
    plain = tmp_path / "plain.jsonl"
    CliRunner().invoke(batch_command, [*common, "-o", str(plain)], catch_exceptions=False)
    assert json.loads(plain.read_text().splitlines()[0])["meta"] == {"src": 0}


def test_calibrate_must_be_a_number_of_rows():
    from knorm_gen.batch.job import BatchOptions, BatchUsageError

    for bad in (0, True, "3"):
        with pytest.raises(BatchUsageError, match="calibrate"):
            BatchOptions(calibrate=bad).check()


# ---- what the tuner measures, against mlx_lm's own forward passes ------------------------------


def _nll_at(logits, ids, first, last):
    """Mean NLL of ids[first:last] from one full forward pass's logits (a numpy reference)."""
    lg = np.array(logits.astype(mx.float32))[0]
    lp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
    return float(-np.mean([lp[i - 1, ids[i]] for i in range(first, last)]))


def test_one_prefill_per_arm_gives_the_full_caches_nll_of_the_tail_and_of_its_summary(tiny_model_dir, monkeypatch):
    import knorm_gen.tuning.evaluate

    # the random tiny model's summary is one token repeated: keep it whole, so there is one to score
    monkeypatch.setattr(knorm_gen.tuning.evaluate, "cut_repetition", lambda ids: ids)
    from knorm_gen.tuning.evaluate import KEY_QUESTION, SUMMARY_QUESTION, Doc
    from knorm_gen.generation.prompts import context_spans, split_question_prompts

    model, tok = load_model(str(tiny_model_dir))
    doc = Doc("d", "The harbor keeps a log of ships and storms. Gulls cry over the pier at noon. " * 30)
    evaluator = Evaluator(model, tok, {"low": CANDIDATES["low"], "random": CANDIDATES["random"]})
    rows = evaluator.document(doc, "12345", 0.5, max_tokens=12, tail=64)
    got = {(r["task"], r["arm"]): r for r in rows}
    assert {a for t, a in got if t == "passkey"} == {"full", "low", "random"}
    assert all(got[("ppl", a)]["budget"] == got[("passkey", a)]["budget"] for a in ("low", "random"))
    # reference: one plain forward pass of the whole prompt through mlx_lm's own KVCache
    text = with_needle(doc.text, 0.5, "12345")
    prefix, (sum_q, _) = split_question_prompts(tok, text, [SUMMARY_QUESTION, KEY_QUESTION], chat=evaluator.chat)
    (start, end), = context_spans(tok, text, prefix, chat=evaluator.chat)
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
    low = got[("fidelity", "low")]
    assert low["kept_bytes"] < 0.5 * low["full_bytes"]


def test_prompt_mode_runs_a_whole_prompt_as_generate_with_eviction_does(tiny_model_dir, monkeypatch):
    # The pass key asked inside one prompt, "prompt" mode: the ids are the chat template's own
    # rendering of the user's text; the template around it is pinned (the user's text is the one
    # evictable span), and under a probed rule the last token too, as the product's Request pins it.
    import knorm_gen.tuning.evaluate
    from knorm_gen.tuning.evaluate import KEY_QUESTION, product_prompt
    from knorm_gen.eviction.spans import ALL_EVICTABLE

    model, tok = load_model(str(tiny_model_dir))
    text = "Gulls cry over the pier at noon. " * 20 + " The pass key is 12345. " + "Ships come in. " * 20
    prompt = text + "\n\n" + KEY_QUESTION
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
    want_ids = tok.encode(rendered, add_special_tokens=False)
    for arm, pinned_last in (("default", True), ("question", True), ("random", False)):
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
    # through the evaluator: the prompt mode asks the key of the full cache and of each arm
    seen = []
    real = knorm_gen.tuning.evaluate.prefill
    monkeypatch.setattr(knorm_gen.tuning.evaluate, "prefill", lambda m, ids, caches, step: seen.append(list(ids)) or
                        real(m, ids, caches, step))
    rows = Evaluator(model, tok, {"random": CANDIDATES["random"]}, modes=("prompt",)).passkey("d", text, "12345", 0.5)
    assert {(r["arm"], r["mode"]) for r in rows} == {("full", "prompt"), ("random", "prompt")}
    assert seen == [want_ids[:-1], want_ids[:-1]]


def test_a_ctq_pass_key_is_asked_after_the_context_as_mlx_lm_would_answer_it_with_the_full_cache(tiny_model_dir):
    # The ctq case is the chat prompt (context, separator, question) split before the question; the
    # full cache's answer is mlx_lm's own greedy answer from its plain cache fed the same two pieces.
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from knorm_gen.tuning.evaluate import KEY_QUESTION
    from knorm_gen.generation.prompts import DEFAULT_QUESTION_SEPARATOR

    model, tok = load_model(str(tiny_model_dir))
    text = with_needle("The harbor keeps a log of ships and storms. " * 30, 0.5, "12345")
    evaluator = Evaluator(model, tok, {"random": CANDIDATES["random"]}, ratio=4.0, modes=("ctq",), log=lambda m: None)
    prefix, q_ids, spans, budget = evaluator.ctq_case(text)
    whole = tok.apply_chat_template([{"role": "user", "content": text + DEFAULT_QUESTION_SEPARATOR + KEY_QUESTION}],
                                    add_generation_prompt=True)
    # the budget as the product's: a quarter of the document, the template's four sinks before it on top
    assert prefix + q_ids == list(whole) and spans[0][0] >= 4
    assert budget == math.ceil(sum(b - a for a, b in spans) / 4) + 4
    cache = make_prompt_cache(model)
    for start in range(0, len(prefix), evaluator.step):  # the same blocks, so the same floats on any BLAS path
        model(mx.array(prefix[start : start + evaluator.step])[None], cache=cache)
    want = []
    for r in stream_generate(model, tok, mx.array(q_ids), max_tokens=16, prompt_cache=cache):
        if r.token in set(tok.eos_token_ids):
            break
        want.append(r.token)
    rows = evaluator.passkey("d", text, "12345", 0.5)
    assert {(r["arm"], r["mode"]) for r in rows} == {("full", "ctq"), ("random", "ctq")}
    assert [r["answer"] for r in rows if r["arm"] == "full"] == [tok.decode(want)]
    assert all(r["budget"] == budget for r in rows if r["arm"] == "random")
    # and the caches it answered from hold what mlx_lm's hold, position for position
    _, caches = evaluator.ctq_answer("full", "d12345", prefix, q_ids, spans, budget)
    assert [c.offset for c in caches] == [c.offset for c in cache]
    for ours, theirs in zip(caches, cache):
        assert np.allclose(np.array(ours.state[0]), np.array(theirs.state[0]), atol=1e-4)


def test_run_ratio_follows_the_ratio_and_its_budget_cap():
    from knorm_gen.generation.tunings import run_ratio

    from .zoo import tiny_tokenizer

    docs = [list(range(400)), list(range(4000))]  # documents of 400 and 4,000 token ids
    assert run_ratio(tiny_tokenizer(), docs, EvictionConfig(budget=200)) == pytest.approx((400 / 200 + 4000 / 200) / 2)
    assert run_ratio(tiny_tokenizer(), docs, EvictionConfig(ratio=4, budget=None)) == 4
    # 1/4, at most 500 tokens: the long one is kept at 500 (8x), the short one at 100 (4x)
    assert run_ratio(tiny_tokenizer(), docs, EvictionConfig(ratio=4, budget=500)) == pytest.approx((4 + 8) / 2)
    assert run_ratio(tiny_tokenizer(), docs, EvictionConfig(budget=None)) is None


def test_another_draw_gives_random_eviction_other_draws_and_the_same_ones_again():
    def draws(draw, name="paper:AER/AER"):
        ev = Evaluator.__new__(Evaluator)  # only the seeding is under test
        ev.draw = draw
        ev.seed(name)
        return mx.random.uniform(shape=(16,)).tolist()

    assert draws(0) == draws(0) and draws(1) == draws(1)  # each draw is reproducible
    assert draws(1) != draws(0) and draws(2) != draws(1)
    # from draw 1 on, the whole name seeds: documents that share their first 8 characters differ
    assert draws(0, "paper:RcppA") == draws(0, "paper:RcppB") and draws(1, "paper:RcppA") != draws(1, "paper:RcppB")
