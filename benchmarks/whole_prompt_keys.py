"""Pass keys asked inside one whole prompt: where the question rule loses them, and why.

    python benchmarks/whole_prompt_keys.py --model default --split tune --docs 11
    python benchmarks/whole_prompt_keys.py --model gemma-3-270m --split tune --docs 11 --arms full,strict,oracle

Per case (a document of the split cut to ``--key-doc-tokens`` tokens, the key
sentence at each depth, the pass-key question written after it in the same
prompt, budget = prompt / ``--ratio``), the layout ``--layout`` (a
:data:`knorm_gen.tune.CANDIDATES` name) runs as:

- ``full``: no eviction;
- ``strict``: :class:`knorm_gen.tune.Tuner`'s ``whole`` mode: every token of the
  prompt evictable, the chat template's too (the sinks aside);
- ``product``: the prompt as ``generate_with_eviction`` encodes it
  (:func:`knorm_gen.prompts.encode_with_spans`: through a chat template the
  template is pinned and the user's text, document and question, is evictable;
  completion style it is ``strict``), probed as the product probes;
- ``oracle``: ``strict`` with the key sentence's tokens pinned (it knows where the
  key is): a key lost here is lost by a fragmentary context, not by selection.

Results: results/whole_prompt_keys-<model>-<split>.json (one row per case and arm).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
from knorm_gen.cache import make_eviction_cache, probe_caches
from knorm_gen.config import DEFAULT_QUESTION_SEPARATOR, EvictionConfig
from knorm_gen.engine import prefill
from knorm_gen.models import load_model
from knorm_gen.mlx_compat import full_attention_layers
from knorm_gen.prompts import as_tokenizer, encode_with_spans, has_chat_template, split_question_prompts
from knorm_gen.evaluate import KEY_CUE, KEY_QUESTION, Doc, head_tokens, needle, passkey_cases
from knorm_gen.evaluate import greedy_ids as _greedy
from knorm_gen.layouts import CANDIDATES

from documents import documents, installed_readmes  # benchmarks/documents.py

RESULTS = Path(__file__).parent / "results"


def token_range(tok, ids: list[int], text_start: int, text_end: int, offset: int) -> tuple[int, int]:
    """The token positions of ``ids`` whose text covers characters [text_start, text_end)
    of the text that starts at token ``offset``."""
    lo = hi = None
    for i in range(offset, len(ids) + 1):
        n = len(tok.decode(ids[offset:i]))
        if lo is None and n > text_start:
            lo = i - 1
        if n >= text_end:
            hi = i
            break
    return lo, hi


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--split", choices=("tune", "heldout"), default="tune")
    ap.add_argument("--docs", type=int, default=11)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--readmes", default="", help="instead of the split's documents, the READMEs of these installed "
                    "packages, comma-separated")
    ap.add_argument("--key-doc-tokens", type=int, default=1536)
    ap.add_argument("--depths", default="0.25,0.5,0.75")
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--layout", default="question_rec25")
    ap.add_argument("--arms", default="full,strict,product,oracle")
    ap.add_argument("--tail", type=int, default=0, help="a prompt without questions is probed by its last N "
                    "tokens (0: knorm_gen.question.PROMPT_TAIL)")
    ap.add_argument("--prompt-probe", choices=("paragraph", "tail"), default="paragraph", help="a prompt without "
                    "questions is probed by the last paragraph of its last tokens (paragraph, since 0.8) or by all "
                    "of them (tail, 0.7)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.tail or args.prompt_probe == "tail":
        import functools

        import knorm_gen.cache
        from knorm_gen.question import PROMPT_TAIL, make_probe
        knorm_gen.cache.make_probe = functools.partial(make_probe, tail=args.tail or PROMPT_TAIL,
                                                       paragraph=args.prompt_probe == "paragraph")
    model, tok = load_model(None if args.model == "default" else args.model)
    tok = as_tokenizer(tok)
    chat = has_chat_template(tok)
    if args.readmes:
        split = installed_readmes(args.readmes.split(","))
    else:
        split = documents(tok)[0::2] if args.split == "tune" else documents(tok)[1::2]
    docs = [Doc(d.name, head_tokens(tok, d.text, args.key_doc_tokens)) for d in split[args.skip: args.skip + args.docs]]
    cases = passkey_cases(docs, (), tok, [float(x) for x in args.depths.split(",")], seed=0)
    n_layers, full_layers = len(model.layers), full_attention_layers(model)
    question = KEY_QUESTION if chat else KEY_CUE
    out = Path(args.out or RESULTS / f"whole_prompt_keys-{args.model}-{args.split}.json")
    rows = []
    for name, context, key, depth in cases:
        prefix, (q_ids,) = split_question_prompts(tok, context, [question], chat=chat)
        whole = prefix + q_ids
        budget = max(8, int(len(prefix) / args.ratio))
        cfg = EvictionConfig(budget=budget, **CANDIDATES[args.layout]).resolved(n_layers, full_layers)
        # the key sentence's tokens: the context starts after the template's head
        at = context.index(needle(key))
        head = len(split_question_prompts(tok, "x", [question], chat=chat)[0]) - 1 if chat else 0
        lo, hi = token_range(tok, whole, at, at + len(needle(key)), head)
        if key not in tok.decode(whole[lo:hi]):
            raise SystemExit(f"the key sentence was not found in the tokens: {tok.decode(whole[lo:hi])!r}")
        for arm in args.arms.split(","):
            if arm == "full":
                caches = make_eviction_cache(model, EvictionConfig(budget=None).resolved(n_layers, full_layers))
                ids = whole
            elif arm == "product":
                ids, spans = encode_with_spans(tok, context + DEFAULT_QUESTION_SEPARATOR + question)
                caches = probe_caches(make_eviction_cache(model, cfg, spans), model, tok, ids, spans)
            else:
                spans = ((0, len(whole)),) if arm == "strict" else ((0, lo), (hi, len(whole)))
                ids = whole
                caches = probe_caches(make_eviction_cache(model, cfg, spans), model, tok, ids, spans)
            prefill(model, ids[:-1], caches)
            text = tok.decode(_greedy(model, tok, ids[-1:], caches, 16))
            rows.append(dict(doc=name, depth=depth, key=key, arm=arm, ok=key in text, answer=text,
                             tokens=len(whole), budget=budget, needle=[lo, hi], same_ids=ids == whole))
            print(f"{name:28s} {depth:.2f} {arm:8s} {key in text!s:5s} {text[:40]!r}", file=sys.stderr, flush=True)
        out.write_text(json.dumps(dict(model=args.model, split=args.split, layout=args.layout, rows=rows), indent=1))
    for arm in args.arms.split(","):
        ok = [r for r in rows if r["arm"] == arm]
        full_ok = {(r["doc"], r["key"]) for r in rows if r["arm"] == "full" and r["ok"]}
        print(f"{arm:8s} {sum(r['ok'] for r in ok)}/{len(ok)}; of the full cache's: "
              f"{sum(r['ok'] for r in ok if (r['doc'], r['key']) in full_ok)}/{len(full_ok)}")


if __name__ == "__main__":
    main()
