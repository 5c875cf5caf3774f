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
  and as one prompt (``whole``: nothing pinned, completion style, the chat template's
  tokens evictable too; ``prompt``: the prompt as ``generate_with_eviction`` runs it,
  through a chat template the template pinned and the user's text evictable).
  ``knorm-tune`` asks a filler's key both as ``ctq`` and as ``prompt`` (:data:`TUNE_MODES`).
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
import numpy as np
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors

from .cache import EvictionKVCache, copy_caches, make_eviction_cache, pin_caches, probe_caches
from .config import DEFAULT_QUESTION_SEPARATOR, OLD_RECENT_SHARE, EvictionConfig
from .engine import needs_probe, prefill
from .layouts import CANDIDATES
from .memory import cache_stats
from .mlx_compat import full_attention_layers, record_attention
from .prompts import as_tokenizer, context_spans, encode_with_spans, has_chat_template, split_question_prompts
from .spans import ALL_EVICTABLE, pin_from

SUMMARY_QUESTION = "Summarize the text above in three sentences."
KEY_QUESTION = "What is the pass key? Answer with the number only."
KEY_CUE = "What is the pass key? The pass key is"  # completion style: a base model continues it
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


def product_prompt(tok: Any, text: str, chat: bool, config: Any) -> tuple[list[int], tuple]:
    """``(ids, spans)`` of a text prompt as the product runs it (:class:`knorm_gen.engine.Request`):
    through the chat template, the template pinned and the user's text evictable; completion
    style, all of it; under a probed rule the last token and the answer pinned too."""
    ids, spans = encode_with_spans(tok, text, chat)
    if config is not None and needs_probe(config):
        spans = pin_from(spans, len(ids) - 1)
    return ids, spans


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
        # The full cache's rows per case: they do not depend on the ratio, so a budget
        # sweep shares them (Tuner.full_rows) instead of prefilling the full cache again.
        self.full_rows: dict[tuple, tuple[list[int], list[dict]]] = {}
        # With ``errors`` set ({arm: {}}), Tuner.document also records, per arm named and
        # compressed layer, the attention error of its kept head (the per-layer mix's criterion).
        self.errors: Optional[dict[str, dict[int, list[float]]]] = None
        self.held_queries = 64
        # "ctq": the summary question asked after the context (pinned, probed apart);
        # "prompt": written into the prompt after the document (Tuner.fidelity_in_prompt).
        self.fidelity_mode = "ctq"

    def config(self, arm: str, budget: Optional[int]):
        fields = {} if arm == "full" else self.arms[arm]
        return EvictionConfig(budget=budget, **fields).resolved(self.n_layers, self.full_layers)

    def caches(self, arm: str, budget: Optional[int], spans=ALL_EVICTABLE, ids: Optional[Sequence[int]] = None,
               questions: Sequence[Sequence[int]] = ()) -> list:
        """Fresh caches for ``arm``; a question-aware arm (``keep="question"``) is probed
        with the prompt ``ids`` and the ``questions`` asked after it, as the product probes."""
        caches = make_eviction_cache(self.model, self.config(arm, None if arm == "full" else budget), spans)
        if ids is not None:
            caches = probe_caches(caches, self.model, self.tok, ids, spans, questions)
        return caches

    def _seed(self, name: str) -> None:
        mx.random.seed(int.from_bytes(name.encode()[:8], "little") % (2**31))  # random arms: the same draws per doc

    # ---- fidelity ----------------------------------------------------------------
    def fidelity(self, doc: Doc, max_tokens: int = 64) -> list[dict]:
        if self.fidelity_mode == "prompt":
            return self.fidelity_in_prompt(doc, max_tokens)
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
            caches = prefill(model, prefix, self.caches(arm, budget, spans, prefix, [q_ids]), self.step)
            stats = cache_stats(caches)
            rows.append(dict(task="fidelity", doc=doc.name, arm=arm, tokens=len(prefix), budget=budget,
                             nll=answer_nll(model, pin_caches(caches), q_ids, ref), kept_bytes=stats.kept_bytes,
                             full_bytes=stats.full_bytes))
        return rows

    def fidelity_in_prompt(self, doc: Doc, max_tokens: int = 64) -> list[dict]:
        """Fidelity with the summary request written into the prompt after the document,
        the prompt run as ``generate_with_eviction`` runs it (:func:`product_prompt`: the
        user's text evictable, a question-aware arm probed by the prompt's end); rows carry
        ``mode="prompt"``."""
        tok, model = self.tok, self.model
        text = doc.text + DEFAULT_QUESTION_SEPARATOR + SUMMARY_QUESTION
        ids, _ = product_prompt(tok, text, self.chat, None)
        budget = max(8, int(len(ids) / self.ratio))
        full = prefill(model, ids[:-1], self.caches("full", None), self.step)
        ref = cut_repetition(_greedy(model, tok, ids[-1:], copy_caches(full), max_tokens, penalty=1.2))
        if len(ref) < 4:
            return []
        none_ids, _ = product_prompt(tok, "(no document)" + DEFAULT_QUESTION_SEPARATOR + SUMMARY_QUESTION, self.chat,
                                     None)
        rows = [dict(task="fidelity", mode="prompt", doc=doc.name, arm="full", tokens=len(ids), budget=None,
                     nll=answer_nll(model, full, ids[-1:], ref)),
                dict(task="fidelity", mode="prompt", doc=doc.name, arm="none", tokens=len(ids), budget=None,
                     nll=answer_nll(model, self.caches("full", None), none_ids, ref))]
        for arm in self.arms:
            self._seed(doc.name)
            config = self.config(arm, budget)
            arm_ids, spans = product_prompt(tok, text, self.chat, config)
            caches = prefill(model, arm_ids[:-1], self.caches(arm, budget, spans, arm_ids), self.step)
            stats = cache_stats(caches)
            rows.append(dict(task="fidelity", mode="prompt", doc=doc.name, arm=arm, tokens=len(ids), budget=budget,
                             nll=answer_nll(model, pin_caches(caches), arm_ids[-1:], ref),
                             kept_bytes=stats.kept_bytes, full_bytes=stats.full_bytes))
        return rows

    # ---- pass keys ---------------------------------------------------------------
    def ctq_case(self, context: str) -> tuple[list, list, Any, int]:
        """The pass-key question asked after ``context`` (the chat template when the model
        has one, else completion style): the prompt's ids up to the question, the
        question's ids, the document's spans and the budget at the tuner's ratio."""
        question = KEY_QUESTION if self.chat else KEY_CUE
        prefix, (q_ids,) = split_question_prompts(self.tok, context, [question], chat=self.chat)
        spans = context_spans(self.tok, context, prefix, chat=self.chat)
        return prefix, q_ids, spans, max(8, int(len(prefix) / self.ratio))

    def ctq_answer(self, arm: str, seed: str, prefix: list, q_ids: list, spans: Any,
                   budget: int) -> tuple[str, list]:
        """The greedy answer (16 tokens) to ``q_ids`` after ``prefix`` is prefilled under
        ``arm`` (seeded by ``seed``), and the caches it was answered from."""
        self._seed(seed)
        caches = prefill(self.model, prefix, self.caches(arm, budget, spans, prefix, [q_ids]), self.step)
        return self.tok.decode(_greedy(self.model, self.tok, q_ids, caches, 16)), caches

    def passkey(self, name: str, context: str, key: str, depth: float) -> list[dict]:
        """The key asked for after the context: through the chat template when the model
        has one (an instruct model answers a question), else completion style; in each of
        the tuner's ``modes`` (tuners sharing ``full_rows`` share the full cache's rows per modes)."""
        tok, model = self.tok, self.model
        modes = self.modes
        question = KEY_QUESTION if self.chat else KEY_CUE
        prefix, q_ids, spans, budget = self.ctq_case(context)
        whole = prefix + q_ids
        rows = []
        for arm in ["full", *self.arms]:
            if arm == "full" and ("passkey", name, key, depth, len(context), modes) in self.full_rows:
                rows += self.full_rows["passkey", name, key, depth, len(context), modes][1]
                continue
            answers = {}
            if "ctq" in modes:
                answers["ctq"] = self.ctq_answer(arm, name + key, prefix, q_ids, spans, budget)[0]
            if "whole" in modes:  # the whole prompt evictable: a question-aware arm probes its end
                self._seed(name + key)
                caches = prefill(model, whole[:-1], self.caches(arm, budget, ids=whole), self.step)
                answers["whole"] = tok.decode(_greedy(model, tok, whole[-1:], caches, 16))
            if "prompt" in modes:  # the whole prompt as generate_with_eviction encodes and pins it
                self._seed(name + key)
                ids, spans = product_prompt(tok, context + DEFAULT_QUESTION_SEPARATOR + question, self.chat,
                                            self.config(arm, budget) if arm != "full" else None)
                caches = prefill(model, ids[:-1], self.caches(arm, budget, spans, ids), self.step)
                answers["prompt"] = tok.decode(_greedy(model, tok, ids[-1:], caches, 16))
            for mode, text in answers.items():
                rows.append(dict(task="passkey", doc=name, arm=arm, mode=mode, depth=depth, key=key,
                                 tokens=len(prefix), budget=None if arm == "full" else budget, ok=key in text,
                                 answer=text))
            if arm == "full":
                self.full_rows["passkey", name, key, depth, len(context), modes] = ([], list(rows))
        return rows

    # ---- the three tasks from one prefill per arm (knorm-tune) -----------------------
    def document(self, doc: Doc, key: str, depth: float, max_tokens: int = 64, tail: int = 256) -> list[dict]:
        """Fidelity, a pass key and perplexity on one document from **one** prefill per
        arm (what makes a 4-document tuning fit in minutes): the key sentence is placed
        at ``depth``; the document's last ``tail`` tokens are fed as one block after
        its compressed head (their NLL is the perplexity task); the rest of the prompt
        follows; then a pinned copy is asked the summary question (teacher-forced on
        the full cache's own summary) and the original the pass-key question. Every
        block but the tail is the product's 512-token prefill."""
        tok, model = self.tok, self.model
        text = with_needle(doc.text, depth, key)
        key_question = KEY_QUESTION if self.chat else KEY_CUE
        prefix, (sum_q, key_q) = split_question_prompts(tok, text, [SUMMARY_QUESTION, key_question], chat=self.chat)
        spans = context_spans(tok, text, prefix, chat=self.chat)
        (start, end), = spans or ((0, len(prefix)),)
        tail = max(16, min(tail, (end - start) // 4))
        cut = end - tail
        budget = max(8, int(len(prefix) / self.ratio))
        ref: list[int] = []
        rows: list[dict] = []
        measure = self.errors is not None
        held: dict[int, tuple] = {}  # layer -> the full cache's (queries, keys, values, scale) for the criterion
        kept: dict[str, dict[int, np.ndarray]] = {}
        for arm in ["full", *self.arms]:
            if arm == "full" and ("document", doc.name, key, depth, len(doc.text)) in self.full_rows:
                ref, full = self.full_rows["document", doc.name, key, depth, len(doc.text)]
                rows += full
                continue
            self._seed(doc.name + key)
            caches = prefill(model, prefix[: cut - 1], self.caches(arm, budget, spans, prefix, [sum_q, key_q]),
                             self.step)
            if measure and arm in self.errors:
                kept[arm] = {i: np.array(c.ordered_state()[2][0]) for i, c in enumerate(caches)
                             if isinstance(c, EvictionKVCache)}
            if measure and arm == "full":
                calls: list = []
                with record_attention(model, calls):
                    ppl = answer_nll(model, caches, prefix[cut - 1 : cut], prefix[cut:end])
                if len(calls) == len(caches):  # one attention call per layer: the criterion can be read
                    for i, ((q, _, scale), c) in enumerate(zip(calls, caches)):
                        if getattr(c, "keys", None) is not None and not isinstance(c.keys, tuple):
                            held[i] = (np.array(q[0, :, -self.held_queries:].astype(mx.float32)),
                                       np.array(c.keys[0, :, : cut - 1].astype(mx.float32)),
                                       np.array(c.values[0, :, : cut - 1].astype(mx.float32)), scale)
            else:
                ppl = answer_nll(model, caches, prefix[cut - 1 : cut], prefix[cut:end])
            if end < len(prefix):
                prefill(model, prefix[end:], caches, self.step)
            stats = cache_stats(caches)
            common = dict(doc=doc.name, arm=arm, tokens=len(prefix), budget=None if arm == "full" else budget)
            if arm == "full":
                ref = cut_repetition(_greedy(model, tok, sum_q, copy_caches(caches), max_tokens, penalty=1.2))
                if len(ref) >= 4:
                    none_prefix, (none_q,) = split_question_prompts(tok, "(no document)", [SUMMARY_QUESTION],
                                                                    chat=self.chat)
                    rows.append(dict(task="fidelity", **{**common, "arm": "none"}, reference=tok.decode(ref),
                                     reference_ids=ref,
                                     nll=answer_nll(model, self.caches("full", None), none_prefix + none_q, ref)))
            if len(ref) >= 4:
                rows.append(dict(task="fidelity", **common, kept_bytes=stats.kept_bytes, full_bytes=stats.full_bytes,
                                 nll=answer_nll(model, pin_caches(copy_caches(caches)), sum_q, ref)))
            rows.append(dict(task="ppl", **common, nll=ppl))
            answer = tok.decode(_greedy(model, tok, key_q, pin_caches(caches), 16))
            rows.append(dict(task="passkey", **common, mode="ctq", depth=depth, key=key, ok=key in answer,
                             answer=answer))
            if arm == "full":
                self.full_rows["document", doc.name, key, depth, len(doc.text)] = (ref, list(rows))
        for i, (q, k, v, scale) in held.items():
            arms_here = {arm: layers[i] for arm, layers in kept.items() if i in layers}
            for arm, err in (layer_errors(q, k, v, scale, arms_here) if arms_here else {}).items():
                self.errors[arm].setdefault(i, []).append(err)
        return rows

    # ---- perplexity ---------------------------------------------------------------
    def perplexity(self, doc: Doc, tail: int = 256) -> list[dict]:
        ids = self.tok.encode(doc.text, add_special_tokens=True)
        head, rest = ids[:-tail], ids[-tail:]
        budget = max(8, int(len(head) / self.ratio))
        rows = []
        for arm in ["full", *self.arms]:
            self._seed(doc.name)
            # raw text has no questions: a question-aware arm is probed by the head's own end, as the product probes
            caches = prefill(self.model, head[:-1], self.caches(arm, budget, ids=head), self.step)
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
        found = [r for r in keys if r["ok"] and (r["doc"], r["key"], r["mode"]) in full_keys]
        out[arm] = dict(
            recovered=sum(rec.values()) / len(rec) if rec else None, fidelity_docs=len(rec), wins_vs_random=wins,
            keys=sum(r["ok"] for r in keys), keys_total=len(keys),
            keys_of_full=len(found), full_keys=len(full_keys),
            filler_keys_of_full=sum(1 for r in found if r["doc"].startswith("filler:")),
            filler_full_keys=sum(1 for k in full_keys if k[0].startswith("filler:")),
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


# ---- per-layer rule mixes ---------------------------------------------------------------

MIX = "mix"
"""The arm name of the per-layer mix (:func:`layer_mix`): each layer's rule chosen by
its own attention error; measured beside the whole-model layouts, chosen only if it
beats them."""
MIX_RULES = ("blend_cov25_rec50", "keydiff_cov25_rec50", "low_cov25_rec50", "leverage_cov25_rec50")
"""The layouts a mix takes each layer's rule from: the bounded intrinsic rules with
``--preset intrinsic``'s coverage share and recent half, so the mix differs from them in
the rule alone."""


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    s = np.einsum("hqd,hkd->hqk", q, k) * scale
    s -= s.max(-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hqk,hkd->hqd", w, v)


def layer_error(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, kept: np.ndarray) -> float:
    """One layer's attention error on held queries when only some positions are kept:
    ``q`` (query heads, queries, dim), ``k``/``v`` (kv heads, positions, dim) the full
    cache's, ``kept`` (kv heads, n) the positions each kv head keeps; the mean over
    kv heads of ``||o_kept - o_all|| / ||o_all||`` over their query heads (float64)."""
    return layer_errors(q, k, v, scale, {"": kept})[""]


def layer_errors(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                 kept: dict[str, np.ndarray]) -> dict[str, float]:
    """:func:`layer_error` for several kept sets (one per arm) of the same layer: the
    full attention is computed once."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[0] // k.shape[0]
    errs: dict[str, list[float]] = {a: [] for a in kept}
    for h in range(k.shape[0]):
        qh = q[h * group : (h + 1) * group]
        ref = _attend(qh, np.broadcast_to(k[h], (group, *k[h].shape)), np.broadcast_to(v[h], (group, *v[h].shape)),
                      scale)
        for arm, positions in kept.items():
            held = positions[h][positions[h] < k.shape[1]]
            out = _attend(qh, np.broadcast_to(k[h][held], (group, len(held), k.shape[2])),
                          np.broadcast_to(v[h][held], (group, len(held), v.shape[2])), scale)
            errs[arm].append(float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
    return {a: float(np.mean(e)) for a, e in errs.items()}


def layer_mix(errors: dict[str, dict[int, float]], arms: dict[str, dict]) -> Optional[dict]:
    """The mix's layout fields from :func:`layer_errors`: each layer takes the rule of
    the arm with the least error there; ``keep`` is the rule most layers take, and
    ``layer_keep`` names the others. None when one rule wins every layer (the mix
    would be that layout). ``arms`` must share every field but ``keep``."""
    base = {k: v for k, v in next(iter(arms.values())).items() if k not in ("keep", "early_keep")}
    if any({k: v for k, v in f.items() if k not in ("keep", "early_keep")} != base for f in arms.values()):
        raise ValueError("a per-layer mix takes only the rule from each layout: give layouts that differ in keep alone")
    layers = sorted(set().union(*(e.keys() for e in errors.values())))
    best = {i: arms[min(errors, key=lambda a: errors[a].get(i, float("inf")))]["keep"] for i in layers}
    rules = sorted(set(best.values()), key=lambda r: (-list(best.values()).count(r), r))
    if len(rules) <= 1:
        return None
    return {**base, "keep": rules[0], "early_keep": rules[0],
            "layer_keep": {i: r for i, r in best.items() if r != rules[0]}}


# ---- choosing a layout for one model, and remembering it ------------------------------

TUNE_ARMS = ("question_both_carry_rec25", "question_per_query_carry_rec25", "lev30_blend_cov25_rec50", "blend_cov25_rec50",
             "keydiff_cov25_rec50", "low", "low_cov25_rec50", "leverage_cov25_rec50", "random")
"""What ``knorm-tune`` measures by default (``--arms`` for more): the default layout
(``question_both_carry_rec25``: the mean of the question rule's and its per-query form's
scores, carrying the earlier layers' best, the recent quarter; 0.12), 0.11's default
(``question_per_query_carry_rec25``, the per-query form alone so: more of a summary on
SmolLM2's tuning documents, fewer keys on SmolLM2's seven newest fresh READMEs; 0.10's
``question_carry_rec25`` and 0.7-0.9's ``question_rec25`` are left to ``--arms``), 0.6's default
(``lev30_blend_cov25_rec50``, ``--preset intrinsic``: leverage in the first 30% of the
full-attention layers, the blend in the rest), the blend in every layer (0.4's default),
the other bounded rules with that coverage share and recent half, the paper's rule
alone, and random eviction as the control. Each is here for a measured reason (docs/results.md):
the recent half kept more of a document than the eighth window on both models (the
small models measured summarize mostly from a document's end); on SmolLM2 the blend
in every layer kept 74% of the tuning documents where the default kept 66%, on
Gemma 3 it lost three of ten filler keys the default found; ``leverage`` everywhere
kept every filler key on both and the least of SmolLM2's documents: verdicts that flip
with the model are what tuning is for. The question rules (the keys the job's instructions
would attend to, probed first) are the only candidates that found keys planted in real
prose. ``question`` with the recent eighth (``--preset question``, a default arm until 0.10),
the layouts of 0.3 (the eighth window: ``blend_cov25``, ``blend_cov75``, ...) and ``keydiff``
alone (0.2's default) are left to ``--arms``. The per-layer mix (``knorm-tune --mix``) is left out too: on SmolLM2
it kept 59% against the default's 58% on the tuning documents and made the tuning 18
minutes instead of under 15 (docs/results.md)."""
# question_per_query_rec25 (0.9.2: held out, Gemma 3 found 36 of the full cache's 36 keys where the default found
# 34, SmolLM2 39 of 46 where it found 43) is asked for with --arms: as a tenth default arm it took a 4-document
# tuning of the embedded model to 14 min 57 s, at the 15-minute limit.
QUICK_ARMS = ("question_both_carry_rec25", "lev30_blend_cov25_rec50", "low_cov25", "random")
JOBS = ("summarize", "retrieve", "both")
KEYS_TARGET = 0.9  # at least this share of the full cache's pass keys
FIDELITY_SLACK = 0.02  # and summary fidelity no more than this below random eviction's


class NoTuningError(LookupError):
    """No saved tuning for this model (and budget)."""


def bounded(fields: dict) -> bool:
    """Whether a layout bounds every layer (no layer left whole)."""
    return fields.get("skip_layers", ()) == () and fields.get("keep") != "full"


def choose(summary: dict[str, dict], job: str, arms: dict[str, dict]) -> tuple[str, str]:
    """``(arm, why)``: the layout to use for ``job`` from a :func:`summarize` table.
    A candidate qualifies when it finds at least :data:`KEYS_TARGET` of the full
    cache's pass keys (retrieve, both) and keeps at least random eviction's summary
    fidelity less :data:`FIDELITY_SLACK` (summarize, both); bounded layouts first;
    among those that qualify, the most fidelity (the most keys for retrieve). When
    none qualifies: the fewest targets missed, bounded first, then the smallest
    shortfall (so a layout that finds half the keys beats one that finds none,
    whatever its fidelity), and ``why`` says what it misses."""
    rand = summary.get("random", {}).get("recovered")
    full_keys = max(summary.get("full", {}).get("full_keys", 0), 1)

    def keys(a):
        return summary[a]["keys_of_full"] / full_keys

    def fid(a):
        return summary[a]["recovered"] if summary[a]["recovered"] is not None else float("-inf")

    def shortfalls(a) -> list[tuple[float, str]]:
        out = []
        if job in ("retrieve", "both") and keys(a) < KEYS_TARGET:
            out.append((KEYS_TARGET - keys(a), f"pass keys {keys(a):.0%} of the full cache's (target "
                                               f"{KEYS_TARGET:.0%})"))
        if job in ("summarize", "both") and rand is not None and fid(a) < rand - FIDELITY_SLACK:
            out.append((min(rand - FIDELITY_SLACK - fid(a), 1.0), f"fidelity {fid(a):.0%} against random "
                                                                   f"eviction's {rand:.0%}"))
        return out

    names = [a for a in arms if a != "random" and a in summary]
    if not names:
        raise ValueError("no candidate besides random was measured")

    def order(a):
        short = shortfalls(a)
        score = (keys(a), fid(a)) if job == "retrieve" else (fid(a), keys(a))
        return (-len(short), bounded(arms[a]), -sum(x for x, _ in short), *score)

    best = max(names, key=order)
    fidelity = "not measured (no document gave a summary)" if fid(best) == float("-inf") else f"{fid(best):.0%}"
    detail = (f"pass keys {keys(best):.0%} of the full cache's, fidelity {fidelity}"
              + (f" (random eviction {rand:.0%})" if rand is not None else ""))
    if shortfalls(best):
        return best, (f"no candidate met every target; closest: {detail}; misses "
                      f"{'; '.join(m for _, m in shortfalls(best))}")
    return best, f"meets the targets with {detail}" + ("" if bounded(arms[best]) else "; memory grows with the input")


def model_identity(model: Any) -> str:
    """A digest of the model's weights (shapes and a sample of every tensor): a tuning
    is kept per model, whatever path it was loaded from."""
    import hashlib

    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, w in tree_flatten(model.parameters()):
        sample = w.reshape(-1)[:4096]
        if sample.dtype not in (mx.float32, mx.uint32, mx.int32):
            sample = sample.astype(mx.float32)
        h.update(f"{name}{tuple(w.shape)}{w.dtype}".encode())
        h.update(np.array(sample).tobytes())
    return h.hexdigest()[:24]


def tuning_dir() -> "Path":
    from pathlib import Path

    from .gguf import cache_root

    return Path(cache_root()) / "tuned"


def tuning_path(model: Any) -> "Path":
    return tuning_dir() / f"{model_identity(model)}.json"


def save_tuning(model: Any, record: dict) -> "Path":
    """Write ``record`` (what :func:`tune` returns) as this model's saved tuning."""
    import json
    import os

    path = tuning_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return path


def load_tuning(model: Any) -> Optional[dict]:
    import json

    path = tuning_path(model)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def tuned_config(model: Any, budget: Optional[int] = None) -> EvictionConfig:
    """The layout ``knorm-tune`` chose for ``model`` (at ``budget`` when given, else
    the budget it was tuned at). Raises :class:`NoTuningError` naming the command to
    run when this model has none."""
    saved = load_tuning(model)
    if saved is None:
        raise NoTuningError("no saved tuning for this model: run `knorm-tune --model <this model>` (on a few of "
                            "your own documents: `knorm-tune --model M docs.jsonl --context-field text`)")
    return EvictionConfig(**{**saved_layout(saved), "budget": budget if budget is not None else saved["budget"]})


def saved_layout(saved: dict) -> dict:
    """A saved tuning's layout fields; a tuning saved before ``recent_share`` existed
    was measured with the window every layout had then (:data:`OLD_RECENT_SHARE`), and
    one saved before ``early_keep`` with its rule in every layer."""
    layout = saved["layout"]
    old_rule = "blend" if layout.get("keep") == "blend" else "auto"  # auto: the blend alone gets leverage
    return {"recent_share": OLD_RECENT_SHARE, "early_keep": old_rule, **layout}


RATIO_TOLERANCE = 1.5
"""``--preset auto`` uses a tuning for runs that compress within this factor of the
ratio it was measured at (tuned at 4x: 2.7x to 6x); outside it the default runs."""


def run_ratio(tokenizer: Any, texts: Iterable[Any], budget: Optional[int]) -> Optional[float]:
    """A run's compression, as ``knorm-tune`` measures it: the mean tokens of its
    documents (``texts``: strings, token ids or chat messages) per budget token.
    None without a budget or a text."""
    if budget is None:
        return None
    tok = as_tokenizer(tokenizer)
    counts = []
    for t in texts:
        if isinstance(t, str):
            counts.append(len(tok.encode(t, add_special_tokens=False)))
        elif isinstance(t, (list, tuple)) and t and all(isinstance(m, dict) for m in t):
            counts.append(sum(len(tok.encode(str(m.get("content", "")), add_special_tokens=False)) for m in t))
        elif isinstance(t, (list, tuple)) or hasattr(t, "shape"):
            counts.append(len(t))
    return sum(counts) / len(counts) / budget if counts else None


def auto_config(model: Any, eviction: EvictionConfig, given: Sequence[str] = (),
                ratio: Optional[float] = None) -> tuple[EvictionConfig, str]:
    """``--preset auto``: the saved tuning's layout at ``eviction``'s budget (the
    layout fields named in ``given``, set by the user beside the preset, stay), or
    the default layout; and one line saying which and why. ``ratio``: the run's
    compression (:func:`run_ratio`); a tuning measured at a ratio more than
    :data:`RATIO_TOLERANCE` times off it is not used (the line says so and how to
    tune for this ratio). Tunings are kept per model (a digest of its weights), so
    another model's is never found."""
    from dataclasses import replace

    saved = load_tuning(model)
    if saved is None:
        return eviction, ("preset auto: no saved tuning for this model, so the default layout runs (keep="
                          f"{eviction.keep}); run `knorm-tune --model ...` to measure one")
    if ratio is not None and max(ratio / saved["ratio"], saved["ratio"] / ratio) > RATIO_TOLERANCE:
        return eviction, (f"preset auto: this model's tuning was measured at {saved['ratio']:g}x and this run "
                          f"compresses about {ratio:.1f}x, so the default layout runs (keep={eviction.keep}); "
                          f"run `knorm-tune --model ... --ratio {ratio:.1f}` to tune for it")
    fields = {k: v for k, v in saved_layout(saved).items() if k != "budget" and k not in given}
    if "skip_layers" in fields and fields["skip_layers"] is not None:
        fields["skip_layers"] = tuple(fields["skip_layers"])
    return replace(eviction, **fields), (f"preset auto: {saved['chosen']} ({_describe(fields)}), tuned for job "
                                         f"{saved['job']} at {saved['ratio']:g}x on {len(saved['docs'])} documents"
                                         + (f" (this run: about {ratio:.1f}x)" if ratio is not None else ""))


def _describe(fields: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


TUNE_MODES = ("ctq", "prompt")
"""How ``knorm-tune`` asks each filler's key: after the context, the question pinned (``ctq``),
and inside one prompt as ``generate_with_eviction`` runs it (``prompt``). A document's key is
asked after the context only (:meth:`Tuner.document`): asking it inside one prompt too took
a 4-document tuning of the embedded model from 8 to 14.8 minutes on 2 cores."""

TUNE_FILLERS = ("grass", "ledger")
"""The fillers ``knorm-tune`` hides a key in besides the documents (the benchmarks
hold ``harbor`` and ``recipe`` out of every choice)."""


def tuning_cases(docs: Sequence[Doc], tok: Any, *, depths: Sequence[float] = (0.25, 0.75, 0.5),
                 fillers: Sequence[str] = TUNE_FILLERS, filler_tokens: int = 1536, seed: int = 0) -> list[tuple]:
    """``(kind, doc, key, depth)`` per case: each document once, its key at the next
    of ``depths`` in turn; then a key in each filler (at 0.3 and 0.7 in turn)."""
    rng = random.Random(seed)
    cases = [("document", d, str(rng.randint(10000, 99999)), depths[i % len(depths)]) for i, d in enumerate(docs)]
    cases += [("filler", Doc(f"filler:{f}", filler_text(FILLERS[f], tok, filler_tokens)), str(rng.randint(10000, 99999)),
               (0.3, 0.7)[i % 2]) for i, f in enumerate(fillers)]
    return cases


def tune(model: Any, tokenizer: Any, docs: Sequence[Doc], *, ratio: float = 4.0, job: str = "both",
         arms: Sequence[str] = TUNE_ARMS, depths: Sequence[float] = (0.25, 0.75, 0.5),
         fillers: Sequence[str] = TUNE_FILLERS, doc_tokens: int = 1536, progress: bool = True,
         log: Callable[[str], None] = print, sweep: Sequence[float] = (),
         targets: tuple[Optional[float], Optional[float]] = (None, None)) -> dict:
    """Measure ``arms`` (names of :data:`CANDIDATES`) on ``docs`` for this model and
    choose one for ``job``: a record with the table, the chosen layout and why.

    Each document is one case (:meth:`Tuner.document`: fidelity, a pass key inside
    it and perplexity from one prefill per arm); each filler one more (a pass key in
    repeated text, where the needle is the only news). Every task is measured
    whatever the job: the job only weighs them, and the table shows all three.

    ``sweep``: compression ratios at which the chosen layout is measured again on the
    same cases (:func:`budget_sweep`), judged against ``targets`` (fidelity, keys)."""
    if job not in JOBS:
        raise ValueError(f"job must be one of {', '.join(JOBS)}; got {job!r}")
    tok = as_tokenizer(tokenizer)
    docs = [Doc(d.name, head_tokens(tok, d.text, doc_tokens)) for d in docs]
    chosen_arms = {a: CANDIDATES[a] for a in arms if a != MIX}
    tuner = Tuner(model, tok, chosen_arms, ratio=ratio, log=log, modes=TUNE_MODES)
    if MIX in arms:  # the criterion comes free with the rules' own prefills: they must be measured
        chosen_arms.update({a: CANDIDATES[a] for a in MIX_RULES})
        tuner.errors = {a: {} for a in MIX_RULES}
    cases = tuning_cases(docs, tok, depths=depths, fillers=fillers, filler_tokens=doc_tokens)
    rows = _measure(tuner, cases, "knorm-tune", progress, log)
    mix = None
    if MIX in arms:
        errors = {a: {i: float(np.mean(e)) for i, e in v.items()} for a, v in tuner.errors.items()}
        fields = layer_mix(errors, {a: CANDIDATES[a] for a in MIX_RULES}) if any(errors.values()) else None
        mix = dict(errors={a: {str(i): e for i, e in v.items()} for a, v in errors.items()}, layout=fields)
        log(f"per-layer mix: {fields or 'one rule wins every layer (or none could be read), so no mix'}")
        if fields is not None:
            second = Tuner(model, tok, {MIX: fields}, ratio=ratio, log=log, modes=TUNE_MODES)
            second.full_rows = tuner.full_rows
            rows += [r for r in _measure(second, cases, "knorm-tune mix", progress, log) if r["arm"] != "full"
                     and not (r["task"] == "fidelity" and r["arm"] == "none")]
            chosen_arms[MIX] = fields
    table = summarize(rows, ["full", *chosen_arms])
    name, why = choose(table, job, chosen_arms)
    n_tokens = [len(tok.encode(d.text, add_special_tokens=False)) for d in docs]
    mean_tokens = sum(n_tokens) / len(n_tokens)
    record = dict(model_identity=model_identity(model), chosen=name, why=why, layout=dict(chosen_arms[name]),
                  job=job, ratio=ratio, budget=int(mean_tokens / ratio), docs=[d.name for d in docs],
                  fillers=list(fillers), table=table, rows=rows, bounded=bounded(chosen_arms[name]))
    record["mix"], record["sweep"] = mix, None
    if sweep:
        points = []
        for r in sweep:
            again = Tuner(model, tok, {name: chosen_arms[name]}, ratio=r, log=log, modes=TUNE_MODES)
            again.full_rows = tuner.full_rows
            t = summarize(_measure(again, cases, f"sweep {r:g}x", progress, log), ["full", name])[name]
            points.append(dict(ratio=r, budget=int(mean_tokens / r), recovered=t["recovered"],
                               keys_of_full=t["keys_of_full"], full_keys=t["full_keys"]))
        record["sweep"] = budget_sweep(name, points, *targets)
    return record


def _measure(tuner: Tuner, cases: list, desc: str, progress: bool, log: Callable[[str], None]) -> list[dict]:
    """The rows of every case of :func:`tuning_cases` for the tuner's arms, with a progress bar."""
    from tqdm import tqdm

    rows: list[dict] = []
    for kind, doc, key, depth in tqdm(cases, desc=desc, unit="case", disable=not progress):
        tic = time.perf_counter()
        new = (tuner.document(doc, key, depth) if kind == "document"
               else tuner.passkey(doc.name, with_needle(doc.text, depth, key), key, depth))
        rows += new
        log(f"{doc.name} {time.perf_counter() - tic:.0f}s: keys found by "
            + ",".join(r["arm"] for r in new if r["task"] == "passkey" and r["ok"]))
    return rows


SWEEP_RATIOS = (8.0, 6.0, 4.0, 3.0, 2.0)


def budget_sweep(arm: str, points: Sequence[dict], target_fidelity: Optional[float] = None,
                 target_keys: Optional[float] = None) -> dict:
    """The sweep record: each point (``ratio``, ``budget``, ``recovered``, ``keys_of_full``,
    ``full_keys``) marked ``meets`` when its recovered share is at least
    ``target_fidelity`` and it finds at least ``target_keys`` of the full cache's pass
    keys (a target left out is not judged; keys cannot be judged where the full cache
    found none), and ``smallest``: the point with the smallest budget that meets
    both, or None."""
    out = []
    for p in points:
        fid_ok = target_fidelity is None or (p["recovered"] is not None and p["recovered"] >= target_fidelity)
        keys_ok = target_keys is None or (p["full_keys"] > 0 and p["keys_of_full"] / p["full_keys"] >= target_keys)
        out.append({**p, "meets": fid_ok and keys_ok})
    meeting = [p for p in out if p["meets"]]
    return dict(arm=arm, target_fidelity=target_fidelity, target_keys=target_keys, points=out,
                smallest=min(meeting, key=lambda p: p["budget"]) if meeting else None)
