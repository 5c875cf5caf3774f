"""Does the paper's signal hold for a model? Key norm vs attention received.

L2Norm eviction only helps where low-norm keys really draw attention. For each
layer and KV head this measures the Spearman correlation between a key's L2
norm and the attention it receives from the last ``window`` queries (averaged
over the query heads of its group), from one full-cache forward pass over real
text. Eviction bets on what *later* queries will read, so keys inside that
window (whose attention is mostly local) are left out. Negative = the paper's finding holds.
Full-attention layers where it does not hold are suggested as ``skip_layers``
(kept uncompressed), and the report turns the table into advice: which layers
to compress, or that the method does not suit the model. Sliding-window layers
keep their own bounded cache and are not measured.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..platform.mlx_compat import is_full_attention, make_prompt_cache, record_attention
from .corpus import text_of_tokens

DEFAULT_THRESHOLD = -0.1


@dataclass
class LayerSignal:
    """One layer. ``kind`` is ``"full"`` (a full-attention layer, which the
    eviction cache compresses) or ``"sliding"`` (a sliding-window layer, which
    keeps its own bounded cache); sliding layers are not measured."""

    layer: int
    kind: str
    rho_mean: Optional[float]
    rho_min: Optional[float]
    rho_max: Optional[float]
    rho_heads: list[float]
    norm_cv: Optional[float]  # std / mean of the key norms, averaged over KV heads


@dataclass
class ProbeReport:
    """Per-layer Spearman correlations, and the advice they support."""

    tokens: int
    threshold: float
    layers: list[LayerSignal] = field(default_factory=list)

    @property
    def compressible(self) -> list[LayerSignal]:
        return [s for s in self.layers if s.kind == "full"]

    @property
    def suggested_skip_layers(self) -> list[int]:
        """Full-attention layers whose mean correlation is above ``threshold`` (weak or wrong sign)."""
        return [s.layer for s in self.compressible if s.rho_mean > self.threshold]

    @property
    def advice(self) -> str:
        """What to do with this model, in one sentence a user can act on."""
        full = self.compressible
        good = [s.layer for s in full if s.rho_mean <= self.threshold]
        if not full:
            return "no full-attention layer: there is nothing for L2Norm eviction to compress"
        if not good:
            return ("the key-norm signal holds in none of the full-attention layers: L2Norm eviction does not suit "
                    "this model; use keep='keydiff' (the default, which does not rely on it) or the full cache")
        skip = self.suggested_skip_layers
        if len(good) * 2 < len(full):
            return (f"the key-norm signal holds in only {len(good)} of {len(full)} full-attention layers "
                    f"({_ranges(good)}): with keep='low', compress only those (--skip-layers {_ranges(skip)}); the "
                    "default, keep='keydiff', does not rely on the signal; check your own task either way")
        if not skip:
            return (f"the key-norm signal holds in all {len(full)} full-attention layers: every one can be "
                    "compressed; check retrieval on your own task before trusting the early layers")
        return (f"the key-norm signal holds in {len(good)} of {len(full)} full-attention layers; with keep='low', "
                f"leave the others uncompressed: --skip-layers {_ranges(skip)}")

    @property
    def rule_advice(self) -> str:
        """Which rule suits which layers, as far as this probe can tell."""
        full = self.compressible
        if not full:
            return "no full-attention layer: no rule to choose"
        good = [s.layer for s in full if s.rho_mean <= self.threshold]
        bad = [s.layer for s in full if s.rho_mean > self.threshold]
        where = (f"keep='low' (the paper's rule: --preset paper or retrieval) is supported in layers {_ranges(good)}"
                 if good else "keep='low' is supported in no layer")
        if bad:
            where += (f" and not in {_ranges(bad)}, where a low-norm key does not draw more attention than "
                      f"others (mean correlation above {self.threshold:g})")
        return (f"{where}. The probe measures only that signal (a low-norm key draws attention); it cannot tell "
                "which layers a summary needs covered (KeyDiff's criterion is not attention), so it cannot rank "
                "keep='keydiff' per layer, nor the default (keep='question', which reads what the job's own "
                "instructions attend to), chosen by the fidelity, pass-key and perplexity benchmarks, not by this probe")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["suggested_skip_layers"] = self.suggested_skip_layers
        d["negative_layers"] = sum(s.rho_mean < 0 for s in self.compressible)
        d["full_layers"] = [s.layer for s in self.compressible]
        d["advice"] = self.advice
        d["rule_advice"] = self.rule_advice
        return d

    def format_table(self) -> str:
        rows = ["layer  kind     mean rho   min    max   norm CV  heads"]
        for s in self.layers:
            if s.kind != "full":
                rows.append(f"{s.layer:5d}  {s.kind:7s}  (sliding window: kept as the model made it)")
                continue
            mark = "  <- skip" if s.layer in self.suggested_skip_layers else ""
            heads = " ".join(f"{r:+.2f}" for r in s.rho_heads)
            rows.append(f"{s.layer:5d}  {s.kind:7s}  {s.rho_mean:+.3f}  {s.rho_min:+.2f}  {s.rho_max:+.2f}   "
                        f"{s.norm_cv:5.3f}   {heads}{mark}")
        full = self.compressible
        neg = sum(s.rho_mean < 0 for s in full)
        rows.append(f"negative mean correlation in {neg} of {len(full)} full-attention layers "
                    f"({self.tokens} tokens of pydoc text)")
        rows.append(f"suggested skip_layers (mean rho > {self.threshold:+.2f}): {self.suggested_skip_layers}")
        rows.append(f"advice: {self.advice}")
        rows.append(f"rules: {self.rule_advice}")
        return "\n".join(rows)


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the --skip-layers syntax)."""
    if not layers:
        return "none"
    out, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if x is not None:
            start = prev = x
    return ",".join(out)


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
    caches = make_prompt_cache(model)
    kinds = ["full" if is_full_attention(c) else "sliding" for c in caches]
    with record_attention(model, calls):
        model(mx.array(ids)[None], cache=caches)
    report = ProbeReport(tokens=len(ids), threshold=threshold)
    for layer, ((q, k, scale), kind) in enumerate(zip(calls, kinds)):
        if kind != "full":
            report.layers.append(LayerSignal(layer, kind, None, None, None, [], None))
            continue
        keys = np.array(k.astype(mx.float32))
        rhos = layer_signal(np.array(q.astype(mx.float32)), keys, scale, n_sink, window)
        norms = np.linalg.norm(keys[0].astype(np.float64), axis=-1)  # (heads, tokens)
        cv = float(np.mean(norms.std(axis=-1) / norms.mean(axis=-1)))
        report.layers.append(LayerSignal(layer, kind, float(np.mean(rhos)), float(np.min(rhos)), float(np.max(rhos)),
                                         [round(r, 4) for r in rhos], round(cv, 4)))
    return report


def probe_cli(argv: Optional[list[str]] = None) -> None:
    """``knorm-probe``: print the per-layer table and the suggested skip_layers."""
    make_probe_command().main(args=argv, prog_name="knorm-probe")


def make_probe_command() -> Any:
    """The ``knorm-probe`` click command, which :func:`probe_cli` runs (the docs test reads its options)."""
    import click

    @click.command(name="knorm-probe", context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--model", "model_spec", default="default", show_default=True,
                  help="'default' (embedded SmolLM2), a GGUF path, or an mlx_lm model path/id.")
    @click.option("--tokens", "n_tokens", default=1024, show_default=True, type=click.IntRange(min=128),
                  help="Tokens of pydoc prose to probe with.")
    @click.option("--threshold", default=DEFAULT_THRESHOLD, show_default=True, type=float,
                  help="Suggest skipping layers whose mean correlation is above this.")
    @click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
                  help="Also write the report as JSON ('-': stdout, and the table goes to stderr).")
    def command(model_spec: str, n_tokens: int, threshold: float, json_path: Optional[str]) -> None:
        """Inspect a model before running it with eviction: its architecture and context, which
        layers eviction compresses (and what it cannot do on it), and, per full-attention layer,
        how well a low key norm predicts the attention a key draws (the L2Norm rule's signal:
        Spearman correlation per KV head over pydoc prose), with the layers it suggests leaving
        uncompressed for the paper's rule."""
        from ..models.load import get_model
        from ..models.support import describe_model
        from ..platform.mlx_compat import model_context_length

        try:
            model, tokenizer = get_model(model_spec)  # as the other commands load it (one copy per process)
        except ValueError as e:  # ModelUsageError and the loader's own refusals, as the other commands catch them
            raise click.UsageError(str(e)) from None
        click.echo(describe_model(model, model_spec), err=json_path == "-")
        report = probe_model(model, tokenizer, n_tokens=n_tokens, threshold=threshold)
        # With --json -, stdout carries only the JSON so a script can parse it.
        click.echo(report.format_table(), err=json_path == "-")
        if json_path:
            text = json.dumps({"model": model_spec, "context": model_context_length(model), **report.to_dict()},
                              indent=2)
            if json_path == "-":
                click.echo(text)
            else:
                with open(json_path, "w", encoding="utf-8") as f:
                    f.write(text + "\n")

    return command
