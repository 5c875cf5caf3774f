"""Does the question rule's selection keep the key sentence in the heads that read it? (no generation)

    python benchmarks/probe_retention.py --readmes tqdm,rich,regex,pydantic,typer,tokenizers --docs 6 \
        --variants base,tail32,tail128,local0,local128,draft0,draft16,seg32,top3,mean,raw,raw_local0,raw_tail32
    python benchmarks/probe_retention.py --readmes tqdm,rich,regex,pydantic,typer,tokenizers --docs 6 \
        --variants base,shared,global,half,half_global,causal,causal_blockz

A quick proxy for choosing among variants of the question rule before measuring
the pass keys themselves (``whole_prompt_keys.py``, ``choose_default.py``). Per case
(each document cut to 1,536 tokens, the key sentence at depths 0.25, 0.5, 0.75,
the question written after it in the same prompt, all of it evictable, budget =
prompt / 4 with the recent quarter and 4 sinks), one plain forward pass of the
whole prompt gives every layer's keys; the heads that read the key are the
``--top`` KV heads whose last-token attention (full cache) puts the most weight on
the key's digits. For each variant, each full-attention layer's KV heads select
their budget by the variant's score from those keys (one selection of the whole
prompt, not block by block), and the case reports the share of all heads, and of
the reading heads, that keep every digit of the key. Variants: the probe's tail
(``tailN``), the local mean's reach (``localN``), the draft tokens (``draftN``), the
longest piece (``segN``), the aggregation over probe queries (``top3``, ``mean``,
``lse``), unnormalised queries at the attention scale (``raw*``), and who selects:
each head alone (``base``), the best standardised score of the layer's heads
(``shared``), of every head of every layer (``global``), of the layers up to this
one (``causal``; ``causal_blockz`` standardised per 512-token block), or half the
scored budget by ``shared``/``global`` and half by the head's own (``half``,
``half_global``). Results: results/key_retention-<model>-<split>.json.
"""
import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx, numpy as np
from knorm_gen.models import load_model
from knorm_gen.mlx_compat import record_attention, full_attention_layers
from knorm_gen.prompts import as_tokenizer, has_chat_template, split_question_prompts
from knorm_gen.evaluate import KEY_CUE, KEY_QUESTION, Doc, head_tokens, needle, passkey_cases
from knorm_gen import question as Q
from documents import documents, installed_readmes
from whole_prompt_keys import token_range

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="default")
ap.add_argument("--readmes", default="")
ap.add_argument("--split", default="tune")
ap.add_argument("--docs", type=int, default=11)
ap.add_argument("--mode", default="whole")
ap.add_argument("--variants", default="base")
ap.add_argument("--top", type=int, default=8, help="reading heads per case")
ap.add_argument("--out", default="")
args = ap.parse_args()
model, tok = load_model(None if args.model == "default" else args.model)
tok = as_tokenizer(tok); chat = has_chat_template(tok)
split = installed_readmes(args.readmes.split(",")) if args.readmes else (documents(tok)[0::2] if args.split == "tune" else documents(tok)[1::2])
docs = [Doc(d.name, head_tokens(tok, d.text, 1536)) for d in split[:args.docs]]
cases = passkey_cases(docs, (), tok, [0.25, 0.5, 0.75], seed=0)
full_layers = full_attention_layers(model)
question = KEY_QUESTION if chat else KEY_CUE

VARIANTS = {
    "base": {},
    "tail32": dict(tail=32), "tail128": dict(tail=128),
    "local0": dict(local=0), "local128": dict(local=128), "local256": dict(local=256),
    "draft0": dict(draft=0), "draft16": dict(draft=16),
    "seg32": dict(longest=32), "seg24": dict(longest=24),
    "raw": dict(raw=True), "raw_local0": dict(raw=True, local=0), "raw_tail32": dict(raw=True, tail=32),
    "shared": dict(sel="shared"), "global": dict(sel="global"), "half": dict(sel="half"),
    "half_global": dict(sel="half_global"), "causal": dict(sel="causal"), "causal_blockz": dict(sel="causal", blockz=True),
    "top3": dict(agg="top3"), "mean": dict(agg="mean"), "lse": dict(agg="lse"),
}

def scores(keys, queries, seg, local, agg):
    s_all = keys.astype(mx.float32) @ mx.swapaxes(queries.astype(mx.float32), -1, -2)  # (1,H,N,M)
    if agg == "max":
        s = mx.max(s_all, -1)
    elif agg == "top3":
        s = mx.mean(mx.sort(s_all, -1)[..., -3:], -1)
    elif agg == "mean":
        s = mx.mean(s_all, -1)
    elif agg == "lse":
        t = 4.0
        s = mx.logsumexp(s_all * t, -1) / t
    b, h, n = s.shape
    if local:
        c = mx.concatenate([mx.zeros((b, h, 1)), mx.cumsum(s, -1)], -1)
        i = mx.arange(n); lo, hi = mx.maximum(i - local, 0), mx.minimum(i + local + 1, n)
        s = s - (mx.take(c, hi, -1) - mx.take(c, lo, -1)) / (hi - lo).astype(mx.float32)
    s = np.array(s)[0]
    seg = np.asarray(seg)
    out = np.empty_like(s)
    for p in np.unique(seg):
        m = seg == p
        out[:, m] = s[:, m].max(-1, keepdims=True)
    return out

import inspect, textwrap
src = inspect.getsource(Q.probe_queries).replace(
    "out.append(q * mx.rsqrt(mx.maximum(mx.sum(q * q, axis=-1, keepdims=True), 1e-30)))",
    "out.append(q * calls[i][2] if RAW else q * mx.rsqrt(mx.maximum(mx.sum(q * q, axis=-1, keepdims=True), 1e-30)))")
Q.RAW = False
exec(compile(src, "probe_raw", "exec"), Q.__dict__)
res = {v: [] for v in args.variants.split(",")}
for name, context, key, depth in cases:
    prefix, (q_ids,) = split_question_prompts(tok, context, [question], chat=chat)
    whole = prefix + q_ids
    at = context.index(needle(key))
    head = len(split_question_prompts(tok, "x", [question], chat=chat)[0]) - 1 if chat else 0
    lo, hi = token_range(tok, whole, at, at + len(needle(key)), head)
    # the key's digits: tokens in [lo,hi) of the first sentence whose text holds a digit
    dig = [i for i in range(lo, hi) if any(c.isdigit() for c in tok.decode([whole[i]]))]
    dig = dig[: len(dig) // 2] if len(dig) > 1 else dig  # first mention
    calls = []
    with record_attention(model, calls):
        model(mx.array(whole)[None])
    n = len(whole) - 1  # the last token is fed at decode
    budget = max(8, int(len(prefix) / 4)); recent = int(round(budget * 0.25)); sinks = 4
    slots = budget - recent - sinks
    # retrieval heads: attention of the last token on the key's digits, full cache
    heat = []
    for li in full_layers:
        q, k, scale = calls[li]
        hq, hk = q.shape[1], k.shape[1]
        ql = q[0, :, -1].astype(mx.float32)  # (Hq, D)
        kk = mx.repeat(k[0].astype(mx.float32), hq // hk, axis=0)  # (Hq,N,D)
        a = mx.softmax((kk @ ql[:, :, None])[..., 0] * scale, -1)
        a = np.array(a).reshape(hk, hq // hk, -1)[:, :, dig].sum(-1).max(-1)
        heat += [(float(a[h]), li, h) for h in range(hk)]
    heat.sort(reverse=True)
    top = {(li, h) for _, li, h in heat[: args.top]}
    for v in res:
        p = VARIANTS[v]
        Q.RAW = p.get("raw", False)
        probe = Q.make_probe(model, tok, whole, ((0, len(whole)),), (), draft=p.get("draft", Q.PROBE_DRAFT),
                             longest=p.get("longest", Q.SEGMENT_TOKENS), tail=p.get("tail", Q.PROMPT_TAIL))
        kept_all = kept_top = total_top = 0
        tot = 0
        S = {}
        for li in full_layers:
            qs, pieces, _ = probe[li]
            k = calls[li][1][:, :, :n]
            S[li] = scores(k, qs, np.array(pieces)[0, :n], p.get("local", Q.LOCAL), p.get("agg", "max"))
        sel = p.get("sel", "own")
        Z = {li: (x - x[:, sinks:].mean(-1, keepdims=True)) / (x[:, sinks:].std(-1, keepdims=True) + 1e-9) for li, x in S.items()}
        G = np.max(np.stack([z.max(0) for z in Z.values()]), 0)
        if p.get("blockz"):  # z over each 512-token block, as a streaming cache sees it
            Z = {}
            for li, x in S.items():
                z = np.empty_like(x)
                for b0 in range(0, n, 512):
                    blk = x[:, max(b0, sinks):b0 + 512]
                    z[:, b0:b0 + 512] = (x[:, b0:b0 + 512] - blk.mean(-1, keepdims=True)) / (blk.std(-1, keepdims=True) + 1e-9)
                Z[li] = z
        run = None
        for li in full_layers:
            own = S[li].copy()
            run = Z[li].max(0) if run is None else np.maximum(run, Z[li].max(0))
            shared = G if sel in ("global", "half_global") else run if sel == "causal" else Z[li].max(0)
            if sel == "causal":
                sel_l = "shared"
            for h in range(own.shape[0]):
                prot = np.zeros(n, bool); prot[:sinks] = True; prot[n - recent:] = True
                if sel == "own":
                    order = np.argsort(-np.where(prot, np.inf, own[h]), kind="stable")
                    keep = set(order[:budget].tolist())
                elif sel in ("shared", "global", "causal"):
                    order = np.argsort(-np.where(prot, np.inf, shared), kind="stable")
                    keep = set(order[:budget].tolist())
                else:
                    keep = set(np.nonzero(prot)[0].tolist())
                    for i in np.argsort(-shared, kind="stable"):
                        if len(keep) >= sinks + recent + slots // 2: break
                        keep.add(int(i))
                    for i in np.argsort(-own[h], kind="stable"):
                        if len(keep) >= budget: break
                        keep.add(int(i))
                kept = all(i in keep for i in dig)
                kept_all += kept; tot += 1
                if (li, h) in top:
                    kept_top += kept; total_top += 1
        res[v].append(dict(doc=name, depth=depth, all=kept_all / tot, top=kept_top / max(total_top, 1)))
    print(name, depth, " ".join(f"{v}:{res[v][-1]['all']:.2f}/{res[v][-1]['top']:.2f}" for v in res), flush=True)
print("MEAN", " ".join(f"{v}:{np.mean([r['all'] for r in res[v]]):.3f}/{np.mean([r['top'] for r in res[v]]):.3f}" for v in res))
print("CASES top>=0.75", " ".join(f"{v}:{sum(r['top']>=0.75 for r in res[v])}/{len(res[v])}" for v in res))
ap_out = Path(args.out or Path(__file__).parent / "results" / f"key_retention-{args.model}-{args.split}.json")
ap_out.write_text(json.dumps(dict(variants=args.variants.split(","), readmes=args.readmes, cases=res), indent=1))
