"""knorm-probe: Spearman and the per-layer signal against constructed references."""

import json

import numpy as np
import pytest

from knorm_gen.tuning.corpus import pydoc_sections, text_of_tokens
from knorm_gen.tuning.probe import layer_signal, probe_cli, probe_model, spearman

from .conftest import tiny_llama


def brute_spearman(a, b):
    """Textbook formula for data without ties."""
    n = len(a)
    ra = np.argsort(np.argsort(a))
    rb = np.argsort(np.argsort(b))
    return 1 - 6 * np.sum((ra - rb) ** 2) / (n * (n * n - 1))


def test_spearman_matches_textbook_formula():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    assert spearman(a, b) == pytest.approx(brute_spearman(a, b))
    assert spearman(a, 3 * a + 1) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    # ties get average ranks: a constant-with-one-step vector vs itself
    t = np.array([1.0, 1.0, 2.0, 2.0, 3.0])
    assert spearman(t, t) == pytest.approx(1.0)


def test_layer_signal_sees_low_norm_keys_drawing_attention():
    # Keys anti-parallel to a shared query: a smaller norm gives a larger score,
    # so attention received is a strictly decreasing function of the norm.
    rng = np.random.default_rng(1)
    t, d = 200, 8
    q = rng.normal(size=d)
    norms = rng.uniform(0.5, 3.0, size=t)
    keys = (-norms[:, None] * q / np.linalg.norm(q))[None, None]  # (1, 1, t, d)
    queries = np.broadcast_to(q, (1, 2, t, d))  # two query heads share the KV head
    (rho,) = layer_signal(queries, keys, scale=1.0, n_sink=0, window=32)
    assert rho == pytest.approx(-1.0)
    (rho_pos,) = layer_signal(queries, -keys, scale=1.0, n_sink=0, window=32)
    assert rho_pos == pytest.approx(1.0)


def test_probe_model_reports_every_layer():
    model = tiny_llama(layers=3)
    report = probe_model(model, None, tokens=list(np.arange(300) % 97), window=64)
    assert [s.layer for s in report.layers] == [0, 1, 2]
    for s in report.layers:
        assert len(s.rho_heads) == 2 and -1 <= s.rho_min <= s.rho_mean <= s.rho_max <= 1
    d = report.to_dict()
    assert d["suggested_skip_layers"] == [s.layer for s in report.layers if s.rho_mean > report.threshold]
    with pytest.raises(ValueError, match="tokens to probe"):
        probe_model(model, None, tokens=[1] * 50)


def test_probe_cli_on_default_model(tmp_path, capsys):
    out = tmp_path / "probe.json"
    with pytest.raises(SystemExit) as exit_info:
        probe_cli(["--tokens", "256", "--json", str(out)])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "suggested skip_layers" in text and text.count("\n") > 30
    data = json.loads(out.read_text())
    assert len(data["layers"]) == 30 and data["tokens"] == 256


def test_probe_json_to_stdout_is_parseable(capsys):
    with pytest.raises(SystemExit) as exit_info:
        probe_cli(["--tokens", "256", "--json", "-"])
    assert exit_info.value.code == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # stdout holds the JSON and nothing else
    assert len(data["layers"]) == 30 and "suggested skip_layers" in captured.err


def test_corpus_is_real_text_in_order():
    sections = pydoc_sections(min_chars=6000)
    assert len(sections) >= 8
    assert all(len(a[1]) >= len(b[1]) for a, b in zip(sections, sections[1:]))

    class CharTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    ids = text_of_tokens(CharTokenizer(), 500)
    assert len(ids) == 500 and "".join(map(chr, ids)) == (sections[0][1] + "\n\n")[:500]


def report_of(rhos, kinds=None, threshold=-0.1):
    from knorm_gen.tuning.probe import LayerSignal, ProbeReport

    kinds = kinds or ["full"] * len(rhos)
    layers = [LayerSignal(i, k, r if k == "full" else None, r, r, [r], 0.1) for i, (r, k) in enumerate(zip(rhos, kinds))]
    return ProbeReport(tokens=512, threshold=threshold, layers=layers)


def test_advice_follows_the_table():
    assert "--skip-layers 0,3-4" in report_of([0.2, -0.3, -0.4, 0.0, -0.05, -0.5, -0.6]).advice
    assert "does not suit this model" in report_of([0.1, 0.05, -0.02]).advice
    few = report_of([-0.4, 0.1, 0.2, 0.0, 0.3])
    assert "only 1 of 5" in few.advice and "--skip-layers 1-4" in few.advice
    assert "all 3 full-attention layers" in report_of([-0.3, -0.2, -0.4]).advice
    # sliding layers are neither measured nor suggested
    mixed = report_of([0.5, -0.3, 0.5, -0.2], kinds=["sliding", "full", "sliding", "full"])
    assert mixed.suggested_skip_layers == [] and [s.layer for s in mixed.compressible] == [1, 3]
    assert mixed.to_dict()["full_layers"] == [1, 3]


def test_probe_marks_sliding_layers_of_a_hybrid_model():
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    model = tiny_llama(layers=4, layer_types=types, sliding_window=64)
    report = probe_model(model, None, tokens=list(np.arange(300) % 97), window=64)
    assert [s.kind for s in report.layers] == ["sliding", "full", "sliding", "full"]
    assert report.layers[0].rho_mean is None and report.layers[1].rho_mean is not None
    assert 0 < report.layers[1].norm_cv < 1
