"""The measurement harness: what a layout keeps of a document, on one model, through the
product's own prefill path (512-token blocks, later blocks attending only to what earlier
ones kept, the template and questions pinned), against the full cache and random eviction
at equal bytes. ``knorm-tune`` and the benchmarks measure through it; docs/results.md
reports it. The three tasks:

- **fidelity**: the full cache's own greedy summary is the reference; each arm's
  teacher-forced NLL of it after its compressed context gives
  ``recovered = (nll_none - nll_arm) / (nll_none - nll_full)``, the share of what the document
  is worth to the summary that the compressed cache still gives (a human-written summary, where
  the document has one, is scored the same way: ``fidelity_human``);
- **pass keys**: a key sentence placed inside the document (and inside repeated filler), asked
  for after the context (``ctq``: the question pinned) and, for fillers, inside one prompt as
  ``generate_with_eviction`` runs it (``prompt``);
- **perplexity**: the document's last tokens after its compressed head.

Each arm's budget is the document's own tokens over the ratio (``ratio``), as ``--ratio`` gives
it, so arms at one ratio hold equal bytes.
"""

from __future__ import annotations

import hashlib
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

from ..eviction.cache import copy_caches, make_eviction_cache, pin_caches, probe_caches
from ..eviction.config import DEFAULT_QUESTION_SEPARATOR, EvictionConfig, row_budget
from ..eviction.memory import cache_stats
from ..eviction.spans import ALL_EVICTABLE, pin_from
from ..generation.engine import needs_probe, prefill
from ..generation.prompts import (
    as_tokenizer,
    context_spans,
    encode_with_spans,
    has_chat_template,
    split_question_prompts,
)
from ..models.support import model_support

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
    """A document to measure on: ``summary`` is a human-written one where there is one
    (its fidelity is reported beside the full cache's own summary's)."""

    name: str
    text: str
    summary: Optional[str] = None


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


def greedy_ids(model, tok, ids: Sequence[int], caches: list, max_tokens: int, penalty: float = 1.0) -> list[int]:
    """Greedy token ids after ``ids`` through ``caches`` (stopped at an end-of-sequence token)."""
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
    """``(ids, spans)`` of a text prompt as the product runs it (:class:`knorm_gen.generation.engine.Request`):
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


class Evaluator:
    """The three tasks for one model: ``arms`` maps a name to :class:`EvictionConfig` layout
    fields; every arm's budget is a case's document tokens over ``ratio``, at most ``cap``."""

    def __init__(self, model: Any, tokenizer: Any, arms: dict[str, dict], ratio: float = 4.0,
                 log: Callable[[str], None] = print, step: int = 512, modes: Sequence[str] = ("ctq",),
                 cap: Optional[int] = None, draw: int = 0):
        self.model, self.tok = model, as_tokenizer(tokenizer)
        self.draw = draw  # 0: the random arms' usual draws; another number, another independent set
        self.modes = tuple(modes)
        self.arms, self.ratio, self.cap, self.log, self.step = arms, ratio, cap, log, step
        self.chat = has_chat_template(self.tok)
        support = model_support(model)
        self.n_layers, self.full_layers = support.n_layers, support.full_layers
        # The full cache's rows per case: they do not depend on the ratio, so evaluators that share
        # this dict (a budget sweep) prefill the full cache once.
        self.full_rows: dict[tuple, tuple[list[int], list[dict]]] = {}

    def config(self, arm: str, budget: Optional[int]):
        fields = {} if arm == "full" else self.arms[arm]
        return EvictionConfig(budget=budget, **fields).resolved(self.n_layers, self.full_layers)

    def budget_for(self, spans: Any, n_ids: int) -> int:
        """The budget of the document ``spans`` mark in a prompt of ``n_ids`` tokens at this
        ratio, at most ``cap``: the product's own (:func:`~knorm_gen.eviction.config.row_budget`, as
        ``--ratio`` with ``--budget`` gives it; no spans: the whole prompt is the document)."""
        return row_budget(self.ratio, self.cap, EvictionConfig.n_sink, spans or ((0, n_ids),), n_ids)

    def caches(self, arm: str, budget: Optional[int], spans=ALL_EVICTABLE, ids: Optional[Sequence[int]] = None,
               questions: Sequence[Sequence[int]] = ()) -> list:
        """Fresh caches for ``arm``; a question-rule arm is probed with the prompt ``ids`` and
        the ``questions`` asked after it, as the product probes."""
        caches = make_eviction_cache(self.model, self.config(arm, None if arm == "full" else budget), spans)
        if ids is not None:
            caches = probe_caches(caches, self.model, self.tok, ids, spans, questions)
        return caches

    def seed(self, name: str) -> None:
        """Seed the random arms: the same draws per document, another set per ``draw``."""
        if not self.draw:
            mx.random.seed(int.from_bytes(name.encode()[:8], "little") % (2**31))
            return
        digest = hashlib.sha256(f"{self.draw}:{name}".encode()).digest()
        mx.random.seed(int.from_bytes(digest[:4], "little") % (2**31))

    def ctq_case(self, context: str) -> tuple[list, list, Any, int]:
        """The pass-key question asked after ``context`` (the chat template when the model
        has one, else completion style): the prompt's ids up to the question, the
        question's ids, the document's spans and the budget at the tuner's ratio."""
        question = KEY_QUESTION if self.chat else KEY_CUE
        prefix, (q_ids,) = split_question_prompts(self.tok, context, [question], chat=self.chat)
        spans = context_spans(self.tok, context, prefix, chat=self.chat)
        return prefix, q_ids, spans, self.budget_for(spans, len(prefix))

    def ctq_answer(self, arm: str, seed: str, prefix: list, q_ids: list, spans: Any,
                   budget: int) -> tuple[str, list]:
        """The greedy answer (16 tokens) to ``q_ids`` after ``prefix`` is prefilled under
        ``arm`` (seeded by ``seed``), and the caches it was answered from."""
        self.seed(seed)
        caches = prefill(self.model, prefix, self.caches(arm, budget, spans, prefix, [q_ids]), self.step)
        return self.tok.decode(greedy_ids(self.model, self.tok, q_ids, caches, 16)), caches

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
                self.seed(name + key)
                caches = prefill(model, whole[:-1], self.caches(arm, budget, ids=whole), self.step)
                answers["whole"] = tok.decode(greedy_ids(model, tok, whole[-1:], caches, 16))
            if "prompt" in modes:  # the whole prompt as generate_with_eviction encodes and pins it
                self.seed(name + key)
                ids, spans = product_prompt(tok, context + DEFAULT_QUESTION_SEPARATOR + question, self.chat,
                                            self.config(arm, budget) if arm != "full" else None)
                caches = prefill(model, ids[:-1], self.caches(arm, budget, spans, ids), self.step)
                answers["prompt"] = tok.decode(greedy_ids(model, tok, ids[-1:], caches, 16))
            for mode, text in answers.items():
                rows.append(dict(task="passkey", doc=name, arm=arm, mode=mode, depth=depth, key=key,
                                 tokens=len(prefix), budget=None if arm == "full" else budget, ok=key in text,
                                 answer=text))
            if arm == "full":
                self.full_rows["passkey", name, key, depth, len(context), modes] = ([], list(rows))
        return rows

    # ---- the three tasks from one prefill per arm ------------------------------------
    def document(self, doc: Doc, key: str, depth: float, max_tokens: int = 64, tail: int = 256) -> list[dict]:
        """Fidelity, a pass key and perplexity on one document from **one** prefill per
        arm: the key sentence is placed at ``depth``; the document's last ``tail`` tokens are
        fed as one block after its compressed head (their NLL is the perplexity task); the
        rest of the prompt follows; then a pinned copy is asked the summary question
        (teacher-forced on the full cache's own summary, and on ``doc.summary`` where there is
        one) and the original the pass-key question."""
        case = self.document_case(doc, key, depth, tail)
        rows: list[dict] = []
        refs: dict[str, list[int]] = {}
        for arm in ["full", *self.arms]:
            cached = self.full_rows.get(("document", doc.name, key, depth, len(doc.text)))
            if arm == "full" and cached is not None:
                refs, full = cached
                rows += full
                continue
            self.seed(doc.name + key)
            rows += self._document_arm(arm, case, refs, max_tokens)
            if arm == "full":
                self.full_rows["document", doc.name, key, depth, len(doc.text)] = (refs, list(rows))
        return rows

    def document_case(self, doc: Doc, key: str, depth: float, tail: int) -> dict:
        """One paper or document as the grid measures it: ``doc`` with the pass key ``key`` at ``depth``,
        its prompt ids (``prefix``), the summary and key questions' ids, the document's spans, the
        perplexity tail's cut (``tail`` tokens at most), the budget at this evaluator's ratio and the
        human-written summary's ids (None without one)."""
        text = with_needle(doc.text, depth, key)
        key_question = KEY_QUESTION if self.chat else KEY_CUE
        prefix, (sum_q, key_q) = split_question_prompts(self.tok, text, [SUMMARY_QUESTION, key_question],
                                                        chat=self.chat)
        spans = context_spans(self.tok, text, prefix, chat=self.chat)
        (start, end), = spans or ((0, len(prefix)),)
        human = self.tok.encode(" " + doc.summary, add_special_tokens=False) if doc.summary else None
        return dict(doc=doc, key=key, depth=depth, prefix=prefix, sum_q=sum_q, key_q=key_q, spans=spans, end=end,
                    cut=end - max(16, min(tail, (end - start) // 4)), budget=self.budget_for(spans, len(prefix)),
                    human=human, doc_tokens=end - start)

    def prefill_case(self, arm: str, c: dict) -> tuple[list, float]:
        """``arm``'s caches with a case's whole prompt read (:meth:`document_case`): the document's
        head prefilled, its last tokens fed as one block, then the rest; and that block's NLL."""
        model, prefix, cut, end = self.model, c["prefix"], c["cut"], c["end"]
        caches = prefill(model, prefix[: cut - 1], self.caches(arm, c["budget"], c["spans"], prefix,
                                                               [c["sum_q"], c["key_q"]]), self.step)
        ppl = answer_nll(model, caches, prefix[cut - 1 : cut], prefix[cut:end])
        if end < len(prefix):
            prefill(model, prefix[end:], caches, self.step)
        return caches, ppl

    def _document_arm(self, arm: str, c: dict, refs: dict, max_tokens: int) -> list[dict]:
        model, tok = self.model, self.tok
        tic = time.perf_counter()
        caches, ppl = self.prefill_case(arm, c)
        seconds = time.perf_counter() - tic
        stats = cache_stats(caches)
        common = dict(doc=c["doc"].name, arm=arm, tokens=len(c["prefix"]), doc_tokens=c["doc_tokens"],
                      budget=None if arm == "full" else c["budget"])
        rows = []
        if arm == "full":
            refs["fidelity"] = cut_repetition(greedy_ids(model, tok, c["sum_q"], copy_caches(caches), max_tokens,
                                                         penalty=1.2))
            if c["human"]:
                refs["fidelity_human"] = c["human"]
            rows += self._no_document_rows(common, refs)
        for task, ref in refs.items():
            if len(ref) >= 4:
                rows.append(dict(task=task, **common, kept_bytes=stats.kept_bytes, full_bytes=stats.full_bytes,
                                 nll=answer_nll(model, pin_caches(copy_caches(caches)), c["sum_q"], ref)))
        rows.append(dict(task="ppl", **common, nll=ppl, seconds=seconds))
        answer = tok.decode(greedy_ids(model, tok, c["key_q"], pin_caches(caches), 16))
        rows.append(dict(task="passkey", **common, mode="ctq", depth=c["depth"], key=c["key"],
                         ok=c["key"] in answer, answer=answer))
        return rows

    def _no_document_rows(self, common: dict, refs: dict) -> list[dict]:
        """Each reference's NLL with no document: what the model guesses unaided."""
        prefix, (q,) = split_question_prompts(self.tok, "(no document)", [SUMMARY_QUESTION], chat=self.chat)
        return [dict(task=task, **{**common, "arm": "none"}, reference=self.tok.decode(ref), reference_ids=ref,
                     nll=answer_nll(self.model, self.caches("full", None), prefix + q, ref))
                for task, ref in refs.items() if len(ref) >= 4]


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


TUNE_MODES = ("ctq", "prompt")
"""How ``knorm-tune`` asks each filler's key: after the context, the question pinned (``ctq``),
and inside one prompt as ``generate_with_eviction`` runs it (``prompt``). A document's key is
asked after the context only (:meth:`Evaluator.document`): asking it inside one prompt too took
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




def measure(evaluator: Evaluator, cases: list, desc: str, progress: bool = True,
            log: Callable[[str], None] = print, on_rows: Optional[Callable[[list], None]] = None) -> list[dict]:
    """The rows of every case of :func:`tuning_cases` for the evaluator's arms, with a progress bar;
    ``on_rows(rows)`` after each case (a checkpoint)."""
    from tqdm import tqdm

    rows: list[dict] = []
    for kind, doc, key, depth in tqdm(cases, desc=desc, unit="case", disable=not progress):
        tic = time.perf_counter()
        new = (evaluator.document(doc, key, depth) if kind == "document"
               else evaluator.passkey(doc.name, with_needle(doc.text, depth, key), key, depth))
        rows += new
        log(f"{doc.name} {time.perf_counter() - tic:.0f}s: keys found by "
            + ",".join(r["arm"] for r in new if r["task"] == "passkey" and r["ok"]))
        if on_rows is not None:
            on_rows(rows)
    return rows


# ---- the table ------------------------------------------------------------------------------


def bootstrap_interval(values: Sequence[float], level: float = 0.95, draws: int = 4000,
                       seed: int = 0) -> Optional[tuple[float, float]]:
    """The percentile bootstrap interval of the mean of ``values`` (paired differences per
    document), resampling documents; None for fewer than two."""
    x = np.asarray(list(values), dtype=np.float64)
    if len(x) < 2:
        return None
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(draws, len(x)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


MIN_GAIN = 0.05
"""A document counts toward fidelity only where the full cache's reference is at least this
much likelier (in mean NLL) with the document than without: else there is nothing to keep."""


def recovered_by_doc(rows: Iterable[dict], arm: str, task: str = "fidelity") -> dict[str, float]:
    """Per document, the share of what it is worth to the reference that ``arm`` keeps."""
    nll: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["task"] == task:
            nll.setdefault(r["doc"], {})[r["arm"]] = r["nll"]
    return {d: (v["none"] - v[arm]) / (v["none"] - v["full"]) for d, v in nll.items()
            if arm in v and "none" in v and "full" in v and v["none"] - v["full"] > MIN_GAIN}


FIDELITY_MEASURES = {"fidelity_human": "the documents' human-written summaries",
                     "fidelity": "the full cache's own summary"}
"""The summary-fidelity measures (a row's ``task``), the first one a reader's: a measure
anchored on what the document says, where the documents carry a human-written summary."""


def fidelity_measure(rows: Iterable[dict]) -> str:
    """The measure to judge by: ``fidelity_human`` where some document carries a human-written
    summary the document makes likelier (:data:`MIN_GAIN`), else ``fidelity``."""
    return "fidelity_human" if recovered_by_doc(rows, "full", "fidelity_human") else "fidelity"


def summarize(rows: Iterable[dict], arms: Sequence[str], measure: str = "fidelity") -> dict[str, dict]:
    """Per arm: the mean recovered share by ``measure`` (a task of :data:`FIDELITY_MEASURES`),
    its paired difference to ``random`` with a bootstrap 95% interval over documents and
    the wins, the share recovered of the human-written summaries, pass keys found (and the
    full cache's), perplexity ratio to the full cache."""
    rows = list(rows)
    rand = recovered_by_doc(rows, "random", measure)
    out: dict[str, dict] = {}
    for arm in arms:
        rec = recovered_by_doc(rows, arm, measure)
        diffs = [rec[d] - rand[d] for d in rec if d in rand]
        human = recovered_by_doc(rows, arm, "fidelity_human")
        out[arm] = dict(recovered=float(np.mean(list(rec.values()))) if rec else None, fidelity_docs=len(rec),
                        vs_random=float(np.mean(diffs)) if diffs and arm != "random" else None,
                        vs_random_interval=bootstrap_interval(diffs) if arm != "random" else None,
                        wins_vs_random=sum(d > 0 for d in diffs) if arm != "random" else 0,
                        recovered_human=float(np.mean(list(human.values()))) if human else None,
                        human_docs=len(human), **_keys_and_ppl(rows, arm))
    return out


def _keys_and_ppl(rows: list[dict], arm: str) -> dict:
    keys = [r for r in rows if r["task"] == "passkey" and r["arm"] == arm]
    full_keys = {(r["doc"], r["key"], r["mode"]) for r in rows if r["task"] == "passkey" and r["arm"] == "full"
                 and r["ok"]}
    found = [r for r in keys if r["ok"] and (r["doc"], r["key"], r["mode"]) in full_keys]
    ppl = {r["doc"]: r["nll"] for r in rows if r["task"] == "ppl" and r["arm"] == arm}
    ppl_full = {r["doc"]: r["nll"] for r in rows if r["task"] == "ppl" and r["arm"] == "full"}
    return dict(keys=sum(r["ok"] for r in keys), keys_total=len(keys), keys_of_full=len(found),
                full_keys=len(full_keys),
                filler_keys_of_full=sum(1 for r in found if r["doc"].startswith("filler:")),
                filler_full_keys=sum(1 for k in full_keys if k[0].startswith("filler:")),
                ppl_ratio=math.exp(sum(ppl[d] - ppl_full[d] for d in ppl) / len(ppl)) if ppl else None)
