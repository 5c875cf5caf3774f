"""Does the paper's signal hold for a model? Key norm vs attention received.

L2Norm eviction only helps where low-norm keys really draw attention. For each
layer and KV head this measures the Spearman correlation between a key's L2
norm and the attention it receives from the last ``window`` queries (averaged
over the query heads of its group), from one full-cache forward pass over real
text. Eviction bets on what *later* queries will read, so keys inside that
window (whose attention is mostly local) are left out. Negative = the paper's finding holds. Layers where it does not hold are
suggested as ``skip_layers`` (kept uncompressed).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .corpus import text_of_tokens

DEFAULT_THRESHOLD = -0.1


@dataclass
class LayerSignal:
    layer: int
    rho_mean: float
    rho_min: float
    rho_max: float
    rho_heads: list[float]


@dataclass
class ProbeReport:
    """Per-layer Spearman correlations and the ``skip_layers`` they suggest."""

    tokens: int
    threshold: float
    layers: list[LayerSignal] = field(default_factory=list)

    @property
    def suggested_skip_layers(self) -> list[int]:
        """Layers whose mean correlation is above ``threshold`` (weak or wrong sign)."""
        return [s.layer for s in self.layers if s.rho_mean > self.threshold]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["suggested_skip_layers"] = self.suggested_skip_layers
        d["negative_layers"] = sum(s.rho_mean < 0 for s in self.layers)
        return d

    def format_table(self) -> str:
        rows = ["layer  mean rho   min    max   heads"]
        for s in self.layers:
            mark = "  <- skip" if s.layer in self.suggested_skip_layers else ""
            heads = " ".join(f"{r:+.2f}" for r in s.rho_heads)
            rows.append(f"{s.layer:5d}  {s.rho_mean:+.3f}  {s.rho_min:+.2f}  {s.rho_max:+.2f}   {heads}{mark}")
        neg = sum(s.rho_mean < 0 for s in self.layers)
        rows.append(f"negative mean correlation in {neg} of {len(self.layers)} layers "
                    f"({self.tokens} tokens of pydoc text)")
        rows.append(f"suggested skip_layers (mean rho > {self.threshold:+.2f}): {self.suggested_skip_layers}")
        return "\n".join(rows)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation with average ranks for ties."""

    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x), dtype=np.float64)
        r[order] = np.arange(len(x), dtype=np.float64)
        _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=r)
        return sums[inv] / counts[inv]

    ra, rb = ranks(a), ranks(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom else 0.0


@contextmanager
def _record_attention(model: Any, calls: list):
    """Record (queries, keys, scale) at every attention call of the model's module."""
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    original = module.scaled_dot_product_attention

    def recording(queries, keys, values, cache, scale, mask, **kwargs):
        calls.append((queries, keys, scale))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    module.scaled_dot_product_attention = recording
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original


def layer_signal(queries: np.ndarray, keys: np.ndarray, scale: float, n_sink: int, window: int) -> list[float]:
    """Per KV head Spearman(key norm, attention from the last ``window`` queries)."""
    _, n_q, t, _ = queries.shape
    n_kv = keys.shape[1]
    group = n_q // n_kv
    rows = np.arange(t - window, t)[:, None]
    visible = np.arange(t)[None, :] <= rows
    span = slice(n_sink, t - window)
    out = []
    for h in range(n_kv):
        k = keys[0, h].astype(np.float32)
        received = np.zeros(t, dtype=np.float64)
        for g in range(group):
            q = queries[0, h * group + g, t - window :].astype(np.float32)
            s = np.where(visible, (q @ k.T) * scale, -np.inf)
            s -= s.max(axis=1, keepdims=True)
            w = np.exp(s)
            w /= w.sum(axis=1, keepdims=True)
            received += w.sum(axis=0)
        norms = np.linalg.norm(k.astype(np.float64), axis=-1)
        out.append(spearman(norms[span], received[span]))
    return out


def probe_model(
    model: Any,
    tokenizer: Any,
    *,
    tokens: Optional[list[int]] = None,
    n_tokens: int = 1024,
    n_sink: int = 4,
    window: int = 128,
    threshold: float = DEFAULT_THRESHOLD,
) -> ProbeReport:
    """Measure the key-norm / attention correlation of every attention layer.

    ``tokens`` defaults to ``n_tokens`` of pydoc prose. The first ``n_sink``
    positions (attention sinks) are left out of the correlation.
    """
    ids = [int(t) for t in tokens] if tokens is not None else text_of_tokens(tokenizer, n_tokens)
    if len(ids) <= n_sink + window + 2:
        raise ValueError(f"need more than {n_sink + window + 2} tokens to probe, got {len(ids)}")
    calls: list = []
    with _record_attention(model, calls):
        model(mx.array(ids)[None], cache=make_prompt_cache(model))
    report = ProbeReport(tokens=len(ids), threshold=threshold)
    for layer, (q, k, scale) in enumerate(calls):
        rhos = layer_signal(np.array(q.astype(mx.float32)), np.array(k.astype(mx.float32)), scale, n_sink, window)
        report.layers.append(LayerSignal(layer, float(np.mean(rhos)), float(np.min(rhos)), float(np.max(rhos)),
                                         [round(r, 4) for r in rhos]))
    return report


def probe_cli(argv: Optional[list[str]] = None) -> None:
    """``knorm-probe``: print the per-layer table and the suggested skip_layers."""
    import click

    @click.command(name="knorm-probe")
    @click.option("--model", "model_spec", default="default", show_default=True,
                  help="'default' (embedded SmolLM2), a GGUF path, or an mlx_lm model path/id.")
    @click.option("--tokens", "n_tokens", default=1024, show_default=True, type=click.IntRange(min=128),
                  help="Tokens of pydoc prose to probe with.")
    @click.option("--threshold", default=DEFAULT_THRESHOLD, show_default=True, type=float,
                  help="Suggest skipping layers whose mean correlation is above this.")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
                  help="Also write the report as JSON ('-': stdout, and the table goes to stderr).")
    def command(model_spec: str, n_tokens: int, threshold: float, json_path: Optional[str]) -> None:
        from .models import load_model

        model, tokenizer = load_model(None if model_spec == "default" else model_spec)
        report = probe_model(model, tokenizer, n_tokens=n_tokens, threshold=threshold)
        # With --json -, stdout carries only the JSON so a script can parse it.
        click.echo(report.format_table(), err=json_path == "-")
        if json_path:
            text = json.dumps({"model": model_spec, **report.to_dict()}, indent=2)
            if json_path == "-":
                click.echo(text)
            else:
                with open(json_path, "w", encoding="utf-8") as f:
                    f.write(text + "\n")

    command.main(args=argv, prog_name="knorm-probe")
