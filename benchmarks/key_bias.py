"""How much of the question rule's score comes from the key projection's bias, per layer.

A model with a key bias (Qwen2) caches ``rope(content + bias, p)`` at position ``p``: the bias
part is the same for every token and depends on the position alone. Per document and layer,
prefilled with the summary question after the document as the product probes it, this prints and
writes: the mean norm of the bias and of the content part of a key; the share of the variance of
the probe's dot products (less their local mean, as the rule reads them) that the bias part
carries; and how much of the top quarter the rule would keep per KV head stays the same when the
bias part is left out (1: the same positions; 0.25: as unrelated as a random draw).

    python benchmarks/key_bias.py --model qwen2.5-0.5b --docs 0:4 --out benchmarks/results/key-bias-qwen2.json
    python benchmarks/key_bias.py --model default --docs 0:1     # no key bias: says so
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (before mlx: it loads OpenBLAS)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from documents import papers  # noqa: E402
from grid import choosing_half_options, model_path  # noqa: E402

from knorm_gen import load_model  # noqa: E402
from knorm_gen.eviction.rules.question import BEST_REACH, _local_mean, make_probe, question_scores  # noqa: E402

QUESTION = "Write the abstract of the paper above."


def bias_part(block, heads: int, dim: int, start: int, end: int):
    """``(1, KV heads, end - start, D)``: the layer's key bias rotated to positions start..end-1 as
    its RoPE rotates the keys (None: the layer's key projection has no bias)."""
    attn = next((getattr(block, a) for a in ("self_attn", "attention", "attn") if hasattr(block, a)), None)
    proj = getattr(attn, "k_proj", None)
    bias = proj.bias if proj is not None and "bias" in proj else None
    if bias is None or getattr(attn, "rope", None) is None or bias.size != heads * dim:
        return None, None
    bias = bias.astype(mx.float32).reshape(1, heads, 1, dim)
    return attn.rope(mx.broadcast_to(bias, (1, heads, end - start, dim)), offset=start), bias


def layer_rows(model, tok, name: str, body: str) -> list[dict]:
    ids = tok.apply_chat_template([{"role": "user", "content": body + "\n\n" + QUESTION}], add_generation_prompt=True,
                                  tokenize=True)
    sub = tok.encode(body, add_special_tokens=False)
    start = next(i for i in range(len(ids)) if ids[i:i + 8] == sub[:8])
    end = start + len(sub) - 4  # the body's last tokens may merge with what follows it
    probes = make_probe(model, tok, ids, [(start, end)])
    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    rows = []
    for layer, (block, c, probe) in enumerate(zip(model.layers, cache, probes)):
        if probe is None:
            continue
        keys = c.state[0][:, :, start:end].astype(mx.float32)
        bias, raw_bias = bias_part(block, keys.shape[1], keys.shape[-1], start, end)
        if bias is None:
            continue
        dots, bias_dots = keys @ mx.swapaxes(probe.queries, -1, -2), bias @ mx.swapaxes(probe.queries, -1, -2)
        centred = lambda s: s - _local_mean(s, BEST_REACH, axis=2)  # noqa: E731
        v_bias, v_content = mx.var(centred(bias_dots)).item(), mx.var(centred(dots - bias_dots)).item()
        with_bias = np.array(question_scores(keys, probe.queries, local=BEST_REACH))[0]
        without = np.array(question_scores(keys - bias, probe.queries, local=BEST_REACH))[0]
        k = (end - start) // 4
        same = [len(set(np.argsort(-a)[:k]) & set(np.argsort(-b)[:k])) / k for a, b in zip(with_bias, without)]
        rows.append(dict(doc=name, layer=layer,
                         bias_norm=round(float(mx.mean(mx.linalg.norm(raw_bias, axis=-1)).item()), 2),
                         content_norm=round(float(mx.mean(mx.linalg.norm(keys - bias, axis=-1)).item()), 2),
                         bias_share=round(v_bias / (v_bias + v_content), 3),
                         top_quarter_same=round(float(np.mean(same)), 3)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    choosing_half_options(ap, docs="0:4")
    args = ap.parse_args()
    path = model_path(args.model)
    model, tok = load_model(path, float32=True) if path else load_model(float32=True)
    a, b = (int(x) for x in args.docs.split(":"))
    rows = []
    for doc in papers(tok, held_out=False)[a:b]:
        body = tok.decode(tok.encode(doc.text, add_special_tokens=False)[:args.tokens])
        rows += layer_rows(model, tok, doc.name, body)
    if not rows:
        print(f"{args.model}: no layer's key projection has a bias; the question rule's scores have no bias part")
    layers = sorted({r["layer"] for r in rows})
    for layer in layers:
        mine = [r for r in rows if r["layer"] == layer]
        print(f"layer {layer:2d}: bias norm {mine[0]['bias_norm']:7.2f}, content norm "
              f"{np.mean([r['content_norm'] for r in mine]):6.2f}, bias share of the score "
              f"{np.mean([r['bias_share'] for r in mine]):.3f}, top quarter the same without it "
              f"{np.mean([r['top_quarter_same'] for r in mine]):.3f}")
    result = dict(meta=dict(model=args.model, docs=args.docs, tokens=args.tokens, question=QUESTION, out=args.out),
                  rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
