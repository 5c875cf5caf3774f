"""Measure eviction layouts on one model, through the product's own prefill path:
summary fidelity, pass keys and perplexity, each at equal budget, against the
full cache and random eviction (the tasks of README, "Choosing a preset").

Every candidate prefills a document exactly as ``knorm-batch`` does (512-token
blocks, later blocks attending only to what earlier ones kept, the template and
question pinned), so a number here is what the product gives on that model.

- **fidelity**: the full cache's own greedy summary is the reference; each arm's
  teacher-forced NLL of it after its compressed context gives
  ``recovered = (nll_none - nll_arm) / (nll_none - nll_full)``.
- **pass keys**: a key sentence placed at several depths inside the document (and
  inside repeated filler), asked for after the context (``ctq``: question pinned)
  and as one prompt (``whole``: nothing pinned, completion style).
- **perplexity**: the last tokens of the document after its compressed head.
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors

from .cache import copy_caches, make_eviction_cache, pin_caches
from .config import EvictionConfig
from .engine import prefill
from .memory import cache_stats
from .mlx_compat import full_attention_layers
from .prompts import as_tokenizer, context_spans, has_chat_template, split_question_prompts
from .scores import ALL_EVICTABLE

CANDIDATES: dict[str, dict] = {
    "keydiff": dict(keep="keydiff", skip_layers=()),
    "low": dict(keep="low", skip_layers=()),
    "blend": dict(keep="blend", skip_layers=()),
    "low_cov25": dict(keep="low", skip_layers=(), coverage=0.25),
    "low_cov50": dict(keep="low", skip_layers=(), coverage=0.5),
    "keydiff_cov25": dict(keep="keydiff", skip_layers=(), coverage=0.25),
    "blend_cov25": dict(keep="blend", skip_layers=(), coverage=0.25),
    "retrieval": dict(keep="low", skip_layers=None),  # the first 30% of layers whole: unbounded
    "paper": dict(keep="low", skip_layers=(0, 1)),  # unbounded
    "random": dict(keep="random", skip_layers=()),  # the control at equal bytes
}
"""Candidate layouts, each a set of :class:`EvictionConfig` fields (the budget is
the task's). ``random`` is every candidate's equal-bytes control."""

SUMMARY_QUESTION = "Summarize the text above in three sentences."
KEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
FILLERS = {
    "grass": "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
    "ledger": "The ledger lists the usual entries for the week. Nothing in it is out of the ordinary. ",
    "harbor": "Boats come into the harbor at dawn and leave again at dusk, as they always have. ",
    "recipe": "Stir the mixture slowly, add a pinch of salt, and let it rest for a few minutes. ",
}


@dataclass
class Doc:
    name: str
    text: str


def needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


def with_needle(text: str, depth: float, key: str) -> str:
    """``text`` with the key sentence placed at the sentence boundary nearest ``depth``."""
    at = int(len(text) * depth)
    ends = [m.end() for m in re.finditer(r"[.!?]\s", text)] or [at]
    cut = min(ends, key=lambda e: abs(e - at))
    return text[:cut] + needle(key) + text[cut:]


def filler_text(filler: str, tok: Any, n_tokens: int) -> str:
    per = max(1, len(tok.encode(filler, add_special_tokens=False)))
    return filler * max(1, n_tokens // per)


def head_tokens(tok: Any, text: str, n_tokens: int) -> str:
    """The text of ``text``'s first ``n_tokens`` tokens (cut at a line or sentence end)."""
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) <= n_tokens:
        return text
    cut = tok.decode(ids[:n_tokens])
    end = max(cut.rfind("\n"), cut.rfind(". "))
    return cut[: end + 1] if end > len(cut) // 2 else cut


def _greedy(model, tok, ids: Sequence[int], caches: list, max_tokens: int, penalty: float = 1.0) -> list[int]:
    eos = set(tok.eos_token_ids)
    processors = make_logits_processors(repetition_penalty=penalty) if penalty != 1.0 else None
    out = []
    for r in stream_generate(model, tok, mx.array(list(ids)), max_tokens=max_tokens, prompt_cache=caches,
                             logits_processors=processors):
        if r.token in eos:
            break
        out.append(r.token)
    return out


def cut_repetition(ids: list[int], n: int = 8) -> list[int]:
    """``ids`` up to their first repeated ``n``-gram (a loop flatters every arm)."""
    seen = set()
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        if gram in seen:
            return ids[:i]
        seen.add(gram)
    return ids


def answer_nll(model, caches: list, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> float:
    """Mean NLL of ``answer_ids`` after ``prompt_ids``, fed as one block through ``caches``."""
    logits = model(mx.array(list(prompt_ids) + list(answer_ids))[None], cache=caches)[0]
    n = len(prompt_ids)
    logits = logits[n - 1 : n - 1 + len(answer_ids)].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logp, mx.array(list(answer_ids))[:, None], axis=-1).mean().item()


class Tuner:
    """The three tasks for one model; ``arms`` maps a name to EvictionConfig fields
    (:data:`CANDIDATES`), ``ratio`` sets each budget to the context's tokens / ratio."""

    def __init__(self, model: Any, tokenizer: Any, arms: dict[str, dict], ratio: float = 4.0,
                 log: Callable[[str], None] = print, step: int = 512, modes: Sequence[str] = ("ctq", "whole")):
        self.model, self.tok = model, as_tokenizer(tokenizer)
        self.modes = tuple(modes)
        self.arms, self.ratio, self.log, self.step = arms, ratio, log, step
        self.chat = has_chat_template(self.tok)
        self.n_layers, self.full_layers = len(model.layers), full_attention_layers(model)

    def config(self, arm: str, budget: Optional[int]):
        fields = {} if arm == "full" else self.arms[arm]
        return EvictionConfig(budget=budget, **fields).resolved(self.n_layers, self.full_layers)

    def caches(self, arm: str, budget: Optional[int], spans=ALL_EVICTABLE) -> list:
        return make_eviction_cache(self.model, self.config(arm, None if arm == "full" else budget), spans)

    def _seed(self, name: str) -> None:
        mx.random.seed(int.from_bytes(name.encode()[:8], "little") % (2**31))  # random arms: the same draws per doc

    # ---- fidelity ----------------------------------------------------------------
    def fidelity(self, doc: Doc, max_tokens: int = 64) -> list[dict]:
        tok, model = self.tok, self.model
        prefix, (q_ids,) = split_question_prompts(tok, doc.text, [SUMMARY_QUESTION], chat=self.chat)
        spans = context_spans(tok, doc.text, prefix, chat=self.chat)
        budget = max(8, int(len(prefix) / self.ratio))
        full = prefill(model, prefix, self.caches("full", None), self.step)
        ref = cut_repetition(_greedy(model, tok, q_ids, copy_caches(full), max_tokens, penalty=1.2))
        if len(ref) < 4:
            return []
        none_prefix, (none_q,) = split_question_prompts(tok, "(no document)", [SUMMARY_QUESTION], chat=self.chat)
        rows = [dict(task="fidelity", doc=doc.name, arm="full", tokens=len(prefix), budget=None,
                     nll=answer_nll(model, copy_caches(full), q_ids, ref)),
                dict(task="fidelity", doc=doc.name, arm="none", tokens=len(prefix), budget=None,
                     nll=answer_nll(model, self.caches("full", None), none_prefix + none_q, ref))]
        for arm in self.arms:
            self._seed(doc.name)
            caches = prefill(model, prefix, self.caches(arm, budget, spans), self.step)
            stats = cache_stats(caches)
            rows.append(dict(task="fidelity", doc=doc.name, arm=arm, tokens=len(prefix), budget=budget,
                             nll=answer_nll(model, pin_caches(caches), q_ids, ref), kept_bytes=stats.kept_bytes,
                             full_bytes=stats.full_bytes))
        return rows

    # ---- pass keys ---------------------------------------------------------------
    def passkey(self, name: str, context: str, key: str, depth: float) -> list[dict]:
        tok, model = self.tok, self.model
        prefix, (q_ids,) = split_question_prompts(tok, context, [KEY_QUESTION.lstrip("\n")], chat=False,
                                                  question_separator="\n\n")
        whole = prefix + q_ids
        budget = max(8, int(len(prefix) / self.ratio))
        rows = []
        for arm in ["full", *self.arms]:
            answers = {}
            if "ctq" in self.modes:
                self._seed(name + key)
                caches = prefill(model, prefix, self.caches(arm, budget, ((0, len(prefix)),)), self.step)
                answers["ctq"] = tok.decode(_greedy(model, tok, q_ids, caches, 8))
            if "whole" in self.modes:
                self._seed(name + key)
                caches = prefill(model, whole[:-1], self.caches(arm, budget), self.step)
                answers["whole"] = tok.decode(_greedy(model, tok, whole[-1:], caches, 8))
            for mode, text in answers.items():
                rows.append(dict(task="passkey", doc=name, arm=arm, mode=mode, depth=depth, key=key,
                                 tokens=len(prefix), budget=None if arm == "full" else budget, ok=key in text,
                                 answer=text))
        return rows

    # ---- perplexity ---------------------------------------------------------------
    def perplexity(self, doc: Doc, tail: int = 256) -> list[dict]:
        ids = self.tok.encode(doc.text, add_special_tokens=True)
        head, rest = ids[:-tail], ids[-tail:]
        budget = max(8, int(len(head) / self.ratio))
        rows = []
        for arm in ["full", *self.arms]:
            self._seed(doc.name)
            caches = prefill(self.model, head[:-1], self.caches(arm, budget), self.step)
            nll = answer_nll(self.model, caches, head[-1:], rest)  # the tail as one block after the compressed head
            rows.append(dict(task="ppl", doc=doc.name, arm=arm, tokens=len(head), budget=budget, nll=nll))
        return rows


def passkey_cases(docs: Sequence[Doc], fillers: Sequence[str], tok: Any, depths: Sequence[float], seed: int,
                  filler_tokens: int = 1500) -> list[tuple[str, str, str, float]]:
    """``(name, context, key, depth)`` per case: a needle in each document and in each filler."""
    rng = random.Random(seed)
    cases = []
    for doc in docs:
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            cases.append((doc.name, with_needle(doc.text, depth, key), key, depth))
    for f in fillers:
        text = filler_text(FILLERS[f], tok, filler_tokens)
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            cases.append((f"filler:{f}", with_needle(text, depth, key), key, depth))
    return cases


def summarize(rows: Iterable[dict], arms: Sequence[str]) -> dict[str, dict]:
    """Per arm: mean recovered share and paired wins against ``random``, pass keys
    found (and the full cache's), perplexity ratio to the full cache."""
    rows = list(rows)
    out: dict[str, dict] = {}
    fid: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["task"] == "fidelity":
            fid.setdefault(r["doc"], {})[r["arm"]] = r["nll"]
    for arm in arms:
        rec = {d: (v["none"] - v[arm]) / (v["none"] - v["full"]) for d, v in fid.items()
               if arm in v and v["none"] - v["full"] > 0.05}
        wins = sum(1 for d in rec if arm != "random" and "random" in fid[d] and fid[d][arm] < fid[d]["random"])
        keys = [r for r in rows if r["task"] == "passkey" and r["arm"] == arm]
        full_keys = {(r["doc"], r["key"], r["mode"]) for r in rows if r["task"] == "passkey" and r["arm"] == "full"
                     and r["ok"]}
        ppl = {r["doc"]: r["nll"] for r in rows if r["task"] == "ppl" and r["arm"] == arm}
        ppl_full = {r["doc"]: r["nll"] for r in rows if r["task"] == "ppl" and r["arm"] == "full"}
        out[arm] = dict(
            recovered=sum(rec.values()) / len(rec) if rec else None, fidelity_docs=len(rec), wins_vs_random=wins,
            keys=sum(r["ok"] for r in keys), keys_total=len(keys),
            keys_of_full=sum(1 for r in keys if r["ok"] and (r["doc"], r["key"], r["mode"]) in full_keys),
            full_keys=len(full_keys),
            ppl_ratio=math.exp(sum(ppl[d] - ppl_full[d] for d in ppl) / len(ppl)) if ppl else None,
        )
    return out


def run(tuner: Tuner, docs: Sequence[Doc], *, tasks: Sequence[str] = ("fidelity", "passkey", "ppl"),
        fillers: Sequence[str] = (), depths: Sequence[float] = (0.2, 0.5, 0.8), seed: int = 0,
        on_rows: Optional[Callable[[list], None]] = None, done: Sequence[dict] = ()) -> list[dict]:
    """Every task over ``docs``; ``on_rows(rows)`` after each unit (a checkpoint);
    units already in ``done`` are not run again."""
    from tqdm import tqdm

    rows = list(done)
    have = {(r["task"], r["doc"], r.get("key")) for r in rows}
    units: list[tuple] = []
    if "fidelity" in tasks:
        units += [("fidelity", d) for d in docs]
    if "ppl" in tasks:
        units += [("ppl", d) for d in docs]
    if "passkey" in tasks:
        units += [("passkey", c) for c in passkey_cases(docs, fillers, tuner.tok, depths, seed)]
    for task, unit in tqdm(units, desc="tuning", unit="case"):
        name, key = (unit.name, None) if task != "passkey" else (unit[0], unit[2])
        if (task, name, key) in have:
            continue
        tic = time.perf_counter()
        new = (tuner.fidelity(unit) if task == "fidelity" else tuner.perplexity(unit) if task == "ppl"
               else tuner.passkey(*unit))
        rows += new
        tuner.log(f"{task} {name} {key or ''} {time.perf_counter() - tic:.0f}s: "
                  + " ".join(f"{r['arm']}{'/' + r['mode'] if 'mode' in r else ''}="
                             + (str(int(r['ok'])) if 'ok' in r else f"{r['nll']:.3f}") for r in new))
        if on_rows:
            on_rows(rows)
    return rows
