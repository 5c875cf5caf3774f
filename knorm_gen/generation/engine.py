"""Several rows decoded together, each evicting exactly as it would alone: the one
scheduler every batched path uses (the batched Python API, ``answer_questions``
and ``knorm-batch``).

This runs on mlx_lm's own ``BatchGenerator`` (continuous batching: each step
decodes the running rows, then prefills a chunk of waiting ones). The eviction
caches join its batch protocol: ``EvictionKVCache.merge`` builds a
:class:`~knorm_gen.eviction.cache.BatchEvictionKVCache`. The one thing the generator cannot
host unaided is the model's shared full-attention mask, so every step runs inside
:func:`~knorm_gen.platform.mlx_compat.own_layer_masks`.

A :class:`Request` is a prompt (one sequence) or a context with questions: the
context is prefilled once through its own eviction cache, in
``prefill_step_size`` blocks, and each question then joins the same continuous
batch as every other row with a pinned copy of it (question and answer never
evicted). :func:`run_jobs` admits requests while fewer than ``batch_size``
sequences are in flight and yields each request as its last sequence finishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from ..eviction.cache import copy_caches, make_eviction_cache, pin_caches, probe_caches, probed
from ..eviction.config import DEFAULT_PREFILL_STEP, GenerationConfig, ResolvedEviction, settings_dict
from ..eviction.rules import RULES
from ..eviction.spans import ALL_EVICTABLE, Spans, pin_from
from ..models.support import model_support
from ..platform.mlx_compat import generator_step, own_layer_masks
from .admission import KVLimit, KVMemoryExceeded
from .prompts import as_tokenizer
from .results import GenerationResult

PREFILL_TOGETHER = False
"""Whether a probed prompt (the question rule) is prefilled with the other rows of its batch
(right-padded, as mlx_lm's batch prefill does) or alone before it joins them: the faster of the
two on the measured machine (benchmarks/cost.py; docs/results.md). A row's result is the same
either way (tests/test_engine.py)."""

DEFAULT_BATCH_SIZE = 8
"""Rows decoded together by default (docs/results.md, "Speed and memory", measures the whole job
at this size; benchmarks/bench_batch.py measures others)."""


def needs_probe(eviction: Any) -> bool:
    """Whether a resolved layout ranks any compressed layer against a probe of the
    instructions (its rule reads one: ``keep="question"``)."""
    return any(RULES[name].reads_probe for name in eviction.rules())


def prefill(model: Any, ids: Sequence[int], caches: list, step: int = DEFAULT_PREFILL_STEP) -> list:
    """Feed ``ids`` through ``caches`` in ``step``-token blocks, as the product
    prefills a context (later blocks attend only to what earlier ones kept)."""
    for start in range(0, len(ids), step):
        model(mx.array(ids[start : start + step])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def make_row_sampler(generation: GenerationConfig):
    """mlx_lm's sampler for a row's settings."""
    return make_sampler(temp=generation.temperature, top_p=generation.top_p if generation.top_p < 1 else 0.0,
                        min_p=generation.min_p, top_k=generation.top_k)


def make_row_processors(generation: GenerationConfig) -> list:
    """mlx_lm's logits processors for a row's settings (the repetition penalty)."""
    if generation.repetition_penalty == 1:
        return []
    return make_logits_processors(repetition_penalty=generation.repetition_penalty,
                                  repetition_context_size=generation.repetition_context_size)


@dataclass
class _Sequence:
    key: Hashable
    config: dict
    prompt_tokens: int
    question: Optional[str] = None
    context_prefill_s: Optional[float] = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    done_prompt: int = 0
    tokens: list[int] = field(default_factory=list)
    max_tokens: Optional[int] = None


class BatchEngine:
    """Sequences in, :class:`GenerationResult` out as they finish, over one
    ``BatchGenerator``. All sequences share one resolved eviction config (a batch
    cache holds one budget) and one ``prefill_step_size``; each has its own
    :class:`GenerationConfig` (``max_tokens``, ``temperature``, ``top_p``).

    Time is shared, so it is attributed: each step's decode time goes in equal
    parts to the sequences it decoded; the rest of the step (prefill chunks, and
    the first forward of sequences entering decode) goes to the sequences
    prefilled in that step in proportion to their tokens, or to the decoded ones
    when none was. Summed over sequences, the attributed times add up to the
    engine's wall time. ``peak_memory_gb`` is the process peak while the
    sequence was in flight, which the whole batch shares.
    """

    def __init__(self, model: Any, tokenizer: Any, eviction: ResolvedEviction, *,
                 batch_size: int = DEFAULT_BATCH_SIZE, prefill_step_size: int = DEFAULT_PREFILL_STEP,
                 seed: Optional[int] = None, prefill_together: bool = PREFILL_TOGETHER):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.model = model
        self.tok = as_tokenizer(tokenizer)
        if not isinstance(eviction, ResolvedEviction):
            eviction = eviction.for_model(model)
        self.eviction = eviction.batch_form()  # what every row of the batch shares (a ratio's budgets are per row)
        self.prefill_step_size = prefill_step_size
        self.prefill_together = prefill_together
        if seed is not None:
            mx.random.seed(seed)
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in self.tok.eos_token_ids],
            completion_batch_size=batch_size,
            prefill_batch_size=batch_size,
            prefill_step_size=prefill_step_size,
        )
        self._rows: dict[int, _Sequence] = {}
        mx.reset_peak_memory()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, key: Hashable, ids: Sequence[int], generation: GenerationConfig, *,
            caches: Optional[list] = None, spans: Spans = ALL_EVICTABLE, prompt_tokens: Optional[int] = None,
            question: Optional[str] = None, context_prefill_s: Optional[float] = None,
            eviction: Optional[ResolvedEviction] = None) -> None:
        """Queue a sequence: ``ids`` to feed (after ``caches``' history, if given;
        else through fresh caches of ``eviction``, the row's own layout, that may evict
        only the positions in ``spans``). A layout that scores against a probe
        (``keep="question"``) prefills the sequence alone here, after probing its
        instructions; the batch decodes it."""
        alone_s = 0.0
        eviction = eviction or self.eviction
        if prompt_tokens is None:
            prompt_tokens = len(ids)
        if caches is None:
            tic = time.perf_counter()
            caches = self.probed_caches(eviction, ids, spans)
            alone_s = time.perf_counter() - tic  # the probe
            if probed(caches) and not self.prefill_together:
                if len(ids) > 1:
                    prefill(self.model, ids[:-1], caches, self.prefill_step_size)
                caches, ids, alone_s = pin_caches(caches), ids[-1:], time.perf_counter() - tic
        (uid,) = self._gen.insert(
            [list(ids)], max_tokens=[generation.max_tokens],
            caches=[caches],
            samplers=[make_row_sampler(generation)], logits_processors=[make_row_processors(generation)],
        )
        self._rows[uid] = _Sequence(key, settings_dict(eviction, generation), prompt_tokens, question,
                                    context_prefill_s, prefill_s=(context_prefill_s or 0.0) + alone_s,
                                    max_tokens=generation.max_tokens)

    def probed_caches(self, eviction: ResolvedEviction, ids: Sequence[int], spans: Spans = ALL_EVICTABLE,
                      questions: Sequence[Sequence[int]] = ()) -> list:
        """Fresh caches of ``eviction`` for a prompt ``ids``; a layer whose rule scores against
        a probe (``keep="question"``) gets one of the text after the document and ``questions``."""
        return probe_caches(make_eviction_cache(self.model, eviction, spans), self.model, self.tok, ids, spans,
                            questions)

    def prefill_context(self, eviction: ResolvedEviction, ids: Sequence[int], spans: Spans = ALL_EVICTABLE,
                        questions: Sequence[Sequence[int]] = ()) -> tuple[list, float]:
        """A context compressed once through a fresh cache list of ``eviction``, in blocks:
        ``(caches, seconds)``; ``questions`` (token ids asked after it) join the probe of a
        question-aware rule (the seconds include the probe)."""
        tic = time.perf_counter()
        caches = self.probed_caches(eviction, ids, spans, questions)
        prefill(self.model, ids, caches, self.prefill_step_size)
        return caches, time.perf_counter() - tic

    def add_questions(self, key: Hashable, context_ids: Sequence[int], questions: Sequence[str],
                      question_ids: Sequence[Sequence[int]], generation: GenerationConfig,
                      spans: Spans = ALL_EVICTABLE, eviction: Optional[ResolvedEviction] = None) -> None:
        """Prefill a context once through ``eviction`` (the row's layout; ``spans``: the
        document's positions in it), then queue one sequence per question (key ``(key, i)``)
        with its own pinned copy: question and answer tokens are never evicted."""
        eviction = eviction or self.eviction
        caches, context_s = self.prefill_context(eviction, context_ids, spans, question_ids)
        for i, (q, ids) in enumerate(zip(questions, question_ids)):
            self.add((key, i), ids, generation, caches=pin_caches(copy_caches(caches)),
                     prompt_tokens=len(context_ids) + len(ids), question=q, context_prefill_s=context_s,
                     eviction=eviction)

    def step(self) -> list[tuple[Hashable, GenerationResult]]:
        """One generator step; the sequences that finished in it."""
        with own_layer_masks(self.model):
            prefilled, decoded, timing = generator_step(self._gen)
        self._attribute(timing, prefilled, decoded)
        finished = []
        for r in decoded:
            row = self._rows[r.uid]
            row.tokens.append(r.token)
            if r.finish_reason is not None:
                del self._rows[r.uid]
                finished.append((row.key, self._result(row, r.finish_reason, r.caches)))
        return finished

    def run(self) -> Iterator[tuple[Hashable, GenerationResult]]:
        """Step until every queued sequence has finished, yielding them as they finish."""
        while self._rows:
            yield from self.step()

    def close(self) -> None:
        """Give back what the generator holds (the wired memory limit it set)."""
        self._gen.close()

    def _attribute(self, timing, prefilled, decoded) -> None:
        rows = [self._rows[r.uid] for r in decoded]
        for row in rows:
            row.decode_s += timing.decode_s / len(rows)
        shares = {}
        for p in prefilled:
            row = self._rows[p.uid]
            shares[p.uid] = max(p.done - row.done_prompt, 0) + (1 if p.entered_decode else 0)
            row.done_prompt = p.done
        rest = max(timing.wall_s - timing.decode_s, 0.0)
        total = sum(shares.values())
        if total:
            for uid, n in shares.items():
                self._rows[uid].prefill_s += rest * n / total
        elif rows:
            for row in rows:
                row.decode_s += rest / len(rows)

    def _result(self, row: _Sequence, finish_reason: str, caches: list) -> GenerationResult:
        text_tokens = row.tokens[:-1] if finish_reason == "stop" else row.tokens
        detok = self.tok.detokenizer
        detok.reset()
        for t in text_tokens:
            detok.add_token(t)
        detok.finalize()
        n = len(row.tokens)
        return GenerationResult.from_caches(
            caches,
            max_tokens=row.max_tokens,
            text=detok.text,
            finish_reason=finish_reason,
            prompt_tokens=row.prompt_tokens,
            generated_tokens=n,
            prefill_s=row.prefill_s,
            decode_s=row.decode_s,
            prompt_tps=row.prompt_tokens / row.prefill_s if row.prefill_s > 0 else 0.0,
            generation_tps=n / row.decode_s if row.decode_s > 0 else 0.0,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            config=row.config,
            question=row.question,
            context_prefill_s=row.context_prefill_s,
            tokens=row.tokens,
        )


# ---- the scheduler ------------------------------------------------------------------


@dataclass
class Request:
    """One unit of work for :func:`run_jobs`: a prompt (``ids``), or a context
    (``context_ids``) with ``questions`` and their ``question_ids``.
    ``tag`` is the caller's (the runner keeps its row there)."""

    key: Hashable
    eviction: ResolvedEviction
    generation: GenerationConfig
    ids: Optional[list[int]] = None
    context_ids: Optional[list[int]] = None
    questions: Sequence[str] = ()
    question_ids: Sequence[Sequence[int]] = ()
    tag: Any = None
    spans: Spans = ALL_EVICTABLE
    """The document's positions in ``ids`` or ``context_ids``; the rest is pinned."""
    long_document: Optional[dict] = None
    """What became of a document longer than the model's context (every result of it says so)."""

    def __post_init__(self):
        if self.ids is None and self.spans == ALL_EVICTABLE:  # the questions and answers are never the document
            self.spans = ((0, len(self.context_ids)),)
        elif self.ids and needs_probe(self.eviction):
            # A probed prompt is prefilled alone and decoded pinned (a batch cache holds no probe), so its last
            # token and answer are pinned alone too, and admission and the ceiling count them.
            self.spans = pin_from(self.spans, len(self.ids) - 1)

    @property
    def sequences(self) -> int:
        return 1 if self.ids is not None else len(self.questions)

    @property
    def batch_key(self) -> tuple:
        """Requests decode together only when their caches can merge: one eviction
        plan (the budgets that follow each document aside) and one prefill step per engine."""
        return (self.eviction.batch_form(), self.generation.prefill_step_size)


Outcome = Union[list[GenerationResult], Exception]


def run_jobs(model: Any, tokenizer: Any, requests: Iterable[Request], *, batch_size: int = DEFAULT_BATCH_SIZE,
             seed: Optional[int] = None, alone: Optional[Callable[[Request], list[GenerationResult]]] = None,
             kv_limit: Optional[KVLimit] = None) -> Iterator[tuple[Request, Outcome]]:
    """Run ``requests`` through one continuous batch, yielding ``(request, results)`` as
    each request finishes (one result per prompt, one per question, in order).

    Requests are read lazily: the next is taken only while fewer than ``batch_size``
    sequences are in flight, so an endless iterable works. A request whose settings
    differ from the running batch's (another budget) waits until the batch has
    drained, then starts a new one (seeded again with ``seed``). If a batch step
    fails, every request in flight is run again with ``alone`` (when given), so that
    only a bad one fails: its outcome is then the exception. Without ``alone``
    the failure propagates.

    With ``kv_limit``, a request joins only while the KV memory in flight plus its
    own stays within the limit (the batch drains until it does); a request that
    cannot fit even alone gets :class:`~knorm_gen.generation.admission.KVMemoryExceeded` as its
    outcome (or raises it, without ``alone``)."""
    if model_support(model).batching is not None:  # this model's rows cannot decode together: one at a time
        outcomes = _one_at_a_time(model, tokenizer, requests, alone, kv_limit)
    else:
        outcomes = _batched(model, tokenizer, requests, batch_size, seed, alone, kv_limit)
    for request, outcome in outcomes:
        if not isinstance(outcome, Exception):
            for result in outcome:
                result.long_document = request.long_document
        yield request, outcome


def _batched(model: Any, tokenizer: Any, requests: Iterable[Request], batch_size: int, seed: Optional[int],
             alone: Optional[Callable[[Request], list[GenerationResult]]],
             kv_limit: Optional[KVLimit]) -> Iterator[tuple[Request, Outcome]]:
    """:func:`run_jobs` for a model whose rows decode together."""
    batch = _Scheduler(model, tokenizer, batch_size, seed, alone, kv_limit)
    try:
        for request in requests:
            refused = batch.refusal(request)  # too large even alone
            if refused is None:
                yield from batch.make_room(request)
                refused = batch.add(request)  # its context's prefill failed
            if refused is not None:
                yield request, refused
                continue
            while batch.full():
                yield from batch.step()
        yield from batch.drain()
    finally:
        batch.close()


class _Scheduler:
    """The steps of :func:`run_jobs`: the engine of the running batch (None between
    batches) and the requests in flight, each with its results so far."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, seed: Optional[int],
                 alone: Optional[Callable[[Request], list[GenerationResult]]], kv_limit: Optional[KVLimit]):
        self.model, self.tokenizer, self.batch_size, self.seed = model, tokenizer, batch_size, seed
        self.alone, self.kv_limit = alone, kv_limit
        self.engine: Optional[BatchEngine] = None
        self.flight: dict[Hashable, tuple[Request, list]] = {}  # request key -> (request, results by sequence)

    def refusal(self, request: Request) -> Optional[KVMemoryExceeded]:
        """Why a request cannot run even alone under the KV limit (None: it can)."""
        if self.kv_limit is None:
            return None
        try:
            self.kv_limit.check_alone(request)
        except KVMemoryExceeded as e:
            if self.alone is None:
                raise
            return e
        return None

    def make_room(self, request: Request) -> Iterator[tuple[Request, Outcome]]:
        """Step until ``request`` may join: a batch of other settings drains first,
        and under a KV limit the batch runs until the request fits."""
        if self.engine is not None and request.batch_key != (self.engine.eviction, self.engine.prefill_step_size):
            yield from self.drain()
            self.close()
        kv = self.kv_limit
        while kv is not None and self.engine is not None and len(self.engine) and kv.bytes_with(request) > kv.limit:
            yield from self.step()

    def add(self, request: Request) -> Optional[Exception]:
        """Queue ``request`` in the running batch (a new one if none runs); the
        failure of its context's prefill is returned as its outcome."""
        if self.kv_limit is not None:
            self.kv_limit.admit(request)
        if self.engine is None:
            self.engine = BatchEngine(self.model, self.tokenizer, request.eviction, batch_size=self.batch_size,
                                      prefill_step_size=request.generation.prefill_step_size, seed=self.seed)
        self.flight[request.key] = (request, [None] * request.sequences)
        try:
            if request.ids is not None:
                self.engine.add((request.key, 0), request.ids, request.generation, spans=request.spans,
                                eviction=request.eviction)
            else:
                self.engine.add_questions(request.key, request.context_ids, request.questions,
                                          request.question_ids, request.generation, request.spans, request.eviction)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - a context whose prefill fails is that request's failure
            if self.alone is None:
                raise
            del self.flight[request.key]
            if self.kv_limit is not None:
                self.kv_limit.release_request(request)
            return e
        return None

    def full(self) -> bool:
        return self.engine is not None and len(self.engine) >= self.batch_size

    def step(self) -> Iterator[tuple[Request, Outcome]]:
        """One step of the batch; the requests whose last sequence finished in it."""
        try:
            finished = self.engine.step()
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - the batch failed: run its requests alone, so only a bad one fails
            if self.alone is None:
                raise
            yield from self._run_stuck_alone()
            return
        for key, result in finished:
            done = self._finish(key, result)
            if done is not None:
                yield done

    def drain(self) -> Iterator[tuple[Request, Outcome]]:
        while self.engine is not None and len(self.engine):
            yield from self.step()

    def close(self) -> None:
        """Drop the running batch's engine (and give back what its generator holds)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def _finish(self, key: tuple, result: GenerationResult) -> Optional[tuple[Request, Outcome]]:
        if self.kv_limit is not None:
            self.kv_limit.release(key)
        request_key, index = key
        request, results = self.flight[request_key]
        results[index] = result
        if all(r is not None for r in results):
            del self.flight[request_key]
            return request, results
        return None

    def _run_stuck_alone(self) -> Iterator[tuple[Request, Outcome]]:
        stuck = [request for request, _ in self.flight.values()]
        self.flight.clear()
        engine, self.engine = self.engine, None
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the failed batch's generator: what it gives back matters no more
            pass
        for request in stuck:
            if self.kv_limit is not None:
                self.kv_limit.release_request(request)
        for request in stuck:
            yield request, _alone(self.alone, request)


def _one_at_a_time(model: Any, tokenizer: Any, requests: Iterable[Request],
                   alone: Optional[Callable[[Request], list[GenerationResult]]],
                   kv_limit: Optional[KVLimit]) -> Iterator[tuple[Request, Outcome]]:
    """:func:`run_jobs` for a model whose rows cannot decode together (its ``ModelSupport.batching``)."""
    for request in requests:
        if kv_limit is not None:
            try:
                kv_limit.check_alone(request)
            except KVMemoryExceeded as e:
                if alone is None:
                    raise
                yield request, e
                continue
        if alone is None:
            yield request, run_alone(model, tokenizer, request)
        else:
            yield request, _alone(alone, request)


def _alone(alone: Callable[[Request], list[GenerationResult]], request: Request) -> Outcome:
    try:
        return alone(request)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - reported as that request's outcome
        return e


# ---- one request alone, on mlx_lm's stream_generate ---------------------------------


def stream_ids(model, tok, ids, caches, *, generation: GenerationConfig, config: dict,
                prompt_tokens: int, probe_s: float = 0.0) -> Iterator[Union[str, GenerationResult]]:
    """Drive mlx_lm's stream_generate over ``caches``; yield text, then the result
    (``probe_s``: seconds spent before, counted as prefill)."""
    last = None
    pieces = []
    tokens = []
    tic = time.perf_counter()
    first_at = None
    for resp in stream_generate(model, tok, mx.array(ids), max_tokens=generation.max_tokens,
                                sampler=make_row_sampler(generation),
                                logits_processors=make_row_processors(generation), prompt_cache=caches,
                                prefill_step_size=generation.prefill_step_size):
        if first_at is None:
            first_at = time.perf_counter()
        last = resp
        tokens.append(int(resp.token))
        if resp.text:
            pieces.append(resp.text)
            yield resp.text
    end = time.perf_counter()
    yield GenerationResult.from_caches(
        caches,
        max_tokens=generation.max_tokens,
        text="".join(pieces),
        finish_reason=last.finish_reason,
        prompt_tokens=prompt_tokens,
        generated_tokens=last.generation_tokens,
        prefill_s=first_at - tic + probe_s,
        decode_s=end - first_at,
        prompt_tps=last.prompt_tps,
        generation_tps=last.generation_tps,
        peak_memory_gb=last.peak_memory,
        config=config,
        tokens=tokens,
    )


def stream_request(model: Any, tokenizer: Any, request: Request) -> Iterator[Union[str, GenerationResult]]:
    """A prompt :class:`~knorm_gen.generation.engine.Request` alone on mlx_lm's ``stream_generate``:
    text pieces, then the result."""
    generation = request.generation
    if generation.seed is not None:
        mx.random.seed(generation.seed)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    tok = as_tokenizer(tokenizer)
    caches = probe_caches(make_eviction_cache(model, request.eviction, request.spans), model, tok, request.ids,
                          request.spans)
    for item in stream_ids(model, tok, request.ids, caches, generation=generation,
                            config=settings_dict(request.eviction, generation), prompt_tokens=len(request.ids),
                            probe_s=time.perf_counter() - tic):
        if isinstance(item, GenerationResult):
            item.long_document = request.long_document
        yield item


def run_alone(model: Any, tokenizer: Any, request: Request) -> list[GenerationResult]:
    """A request with nothing else in flight, on mlx_lm's ``stream_generate``: a prompt as
    :func:`stream_request` runs it; a context compressed once, then each question answered
    from its own pinned copy (as a batch answers them, one at a time)."""
    if request.ids is not None:
        *_, result = stream_request(model, tokenizer, request)
        return [result]
    generation = request.generation
    if generation.seed is not None:
        mx.random.seed(generation.seed)
    mx.reset_peak_memory()
    tok = as_tokenizer(tokenizer)
    tic = time.perf_counter()
    caches = probe_caches(make_eviction_cache(model, request.eviction, request.spans), model, tok,
                          request.context_ids, request.spans, request.question_ids)
    prefill(model, request.context_ids, caches, generation.prefill_step_size)
    context_s = time.perf_counter() - tic
    config = settings_dict(request.eviction, generation)
    results = []
    for question, ids in zip(request.questions, request.question_ids):
        *_, result = stream_ids(model, tok, ids, pin_caches(copy_caches(caches)), generation=generation,
                                 config=config, prompt_tokens=len(request.context_ids) + len(ids), probe_s=context_s)
        result.question, result.context_prefill_s = question, context_s
        results.append(result)
    return results
