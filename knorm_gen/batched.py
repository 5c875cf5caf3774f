"""Several rows decoded together, each evicting exactly as it would alone.

This runs on mlx_lm's own ``BatchGenerator`` (continuous batching: each step
decodes the running rows, then prefills a chunk of waiting ones). The eviction
caches join its batch protocol: ``L2NormKVCache.merge`` builds a
:class:`~knorm_gen.batch_cache.BatchL2NormKVCache`, which handles right-padded
prefill chunks, ``filter``, ``extend`` and ``extract``. The one thing the
generator cannot host unaided is the model's shared full-attention mask, so
every step runs inside :func:`~knorm_gen.batch_cache.own_layer_masks`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from .batch_cache import own_layer_masks
from .cache import L2NormKVCache, copy_caches, make_eviction_cache
from .config import EvictionConfig, GenerationConfig
from .generate import (
    GenerationResult,
    Prompt,
    _as_tokenizer,
    _check_length,
    _configs,
    _has_chat_template,
    _sampler,
    encode_prompt,
    result_config,
    split_question_prompts,
)

DEFAULT_BATCH_SIZE = 8


@dataclass
class _Row:
    key: Hashable
    ids: list[int]
    generation: GenerationConfig
    config: dict
    prompt_tokens: int
    question: Optional[str] = None
    context_prefill_s: Optional[float] = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    done_prompt: int = 0
    tokens: list[int] = field(default_factory=list)


class BatchEngine:
    """Rows in, :class:`GenerationResult` out as they finish, over one
    ``BatchGenerator``. All rows share one eviction config (a batch cache holds
    one budget); each row has its own :class:`GenerationConfig` (``max_tokens``,
    ``temperature``, ``top_p``); ``prefill_step_size`` is the engine's.

    Time is shared, so it is attributed: each step's decode time goes in equal
    parts to the rows it decoded; the rest of the step (prefill chunks, and the
    first forward of rows entering decode) goes to the rows prefilled in that
    step in proportion to their tokens, or to the decoded rows when none was.
    Summed over rows, the attributed times add up to the engine's wall time.
    ``peak_memory_gb`` is the process peak while the row was in flight, which
    the whole batch shares.
    """

    def __init__(self, model: Any, tokenizer: Any, eviction: EvictionConfig, *, batch_size: int = DEFAULT_BATCH_SIZE,
                 prefill_step_size: int = 512, seed: Optional[int] = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.model = model
        self.tok = _as_tokenizer(tokenizer)
        self.eviction = eviction.for_model(model)
        if seed is not None:
            mx.random.seed(seed)
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in self.tok.eos_token_ids],
            completion_batch_size=batch_size,
            prefill_batch_size=batch_size,
            prefill_step_size=prefill_step_size,
        )
        self._rows: dict[int, _Row] = {}
        mx.reset_peak_memory()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, key: Hashable, ids: Sequence[int], generation: GenerationConfig, *,
            caches: Optional[list] = None, prompt_tokens: Optional[int] = None, question: Optional[str] = None,
            context_prefill_s: Optional[float] = None) -> None:
        """Queue a row: ``ids`` to feed (after ``caches``' history, if given)."""
        (uid,) = self._gen.insert(
            [list(ids)], max_tokens=[generation.max_tokens],
            caches=[caches if caches is not None else make_eviction_cache(self.model, self.eviction)],
            samplers=[_sampler(generation)],
        )
        self._rows[uid] = _Row(key, list(ids), generation, result_config(self.eviction, generation),
                               prompt_tokens if prompt_tokens is not None else len(ids), question,
                               context_prefill_s, prefill_s=context_prefill_s or 0.0)

    def step(self) -> list[tuple[Hashable, GenerationResult]]:
        """One generator step; the rows that finished in it."""
        with own_layer_masks(self.model), self._gen.stats() as stats:
            prompt_responses, responses = self._gen.next()
        self._attribute(stats, prompt_responses, responses)
        finished = []
        for r in responses:
            row = self._rows[r.uid]
            row.tokens.append(int(r.token))
            if r.finish_reason is not None:
                del self._rows[r.uid]
                finished.append((row.key, self._result(row, r.finish_reason, r.prompt_cache)))
        return finished

    def run(self) -> Iterator[tuple[Hashable, GenerationResult]]:
        """Step until every queued row has finished, yielding rows as they finish."""
        while self._rows:
            yield from self.step()

    def _attribute(self, stats, prompt_responses, responses) -> None:
        decoded = [self._rows[r.uid] for r in responses]
        for row in decoded:
            row.decode_s += stats.decode_time / len(decoded)
        shares = {}
        for p in prompt_responses:
            row = self._rows[p.uid]
            done = p.progress[0] if isinstance(p.progress, tuple) else p.progress
            shares[p.uid] = max(done - row.done_prompt, 0) + (1 if p.end_of_prompt else 0)
            row.done_prompt = done
        rest = max(stats.wall_time - stats.decode_time, 0.0)
        total = sum(shares.values())
        if total:
            for uid, n in shares.items():
                self._rows[uid].prefill_s += rest * n / total
        elif decoded:
            for row in decoded:
                row.decode_s += rest / len(decoded)

    def _result(self, row: _Row, finish_reason: str, caches: list) -> GenerationResult:
        text_tokens = row.tokens[:-1] if finish_reason == "stop" else row.tokens
        detok = self.tok.detokenizer
        detok.reset()
        for t in text_tokens:
            detok.add_token(t)
        detok.finalize()
        n = len(row.tokens)
        return GenerationResult.from_caches(
            caches,
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


def stream_batch_with_eviction(
    model: Any,
    tokenizer: Any,
    prompts: Iterable[Prompt],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    eviction: Optional[EvictionConfig] = None,
    generation: Optional[GenerationConfig] = None,
    **settings: Any,
) -> Iterator[tuple[int, GenerationResult]]:
    """Like :func:`generate_batch_with_eviction`, but yields ``(index, result)``
    as each row finishes (not in input order). Prompts are read lazily, so an
    endless iterable works; at most ``batch_size`` rows are in flight (the
    schedule ``knorm-batch`` uses, so the two compute the same batches)."""
    eviction, generation = _configs(model, eviction, generation, settings)
    tok = _as_tokenizer(tokenizer)
    engine = BatchEngine(model, tok, eviction, batch_size=batch_size,
                         prefill_step_size=generation.prefill_step_size, seed=generation.seed)
    source = iter(enumerate(prompts))
    exhausted = False
    while True:
        while not exhausted and len(engine) < batch_size:
            item = next(source, None)
            if item is None:
                exhausted = True
                break
            index, prompt = item
            ids = encode_prompt(tok, prompt, generation.chat)
            _check_length(model, len(ids))
            engine.add(index, ids, generation)
        if not len(engine):
            return
        yield from engine.step()


def generate_batch_with_eviction(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    eviction: Optional[EvictionConfig] = None,
    generation: Optional[GenerationConfig] = None,
    on_result: Optional[Callable[[int, GenerationResult], None]] = None,
    **settings: Any,
) -> list[GenerationResult]:
    """Generate for several prompts at once, each row evicting exactly as it
    would alone; one :class:`GenerationResult` per prompt, in input order.

    Up to ``batch_size`` rows decode together (mlx_lm's continuous batching: a
    row that finishes makes room for the next). Settings are those of
    :func:`~knorm_gen.generate_with_eviction`. ``on_result(index, result)`` is
    called as each row finishes. Each result carries its own cache numbers;
    prefill and decode time are shared and attributed as :class:`BatchEngine`
    describes. With ``temperature > 0`` (or ``keep="random"``) the rows draw
    from one random stream: a run is reproducible for the same prompts and
    ``batch_size``, but a row's draws differ from the same row run alone.
    """
    prompts = list(prompts)
    results: list[Optional[GenerationResult]] = [None] * len(prompts)
    for index, result in stream_batch_with_eviction(model, tokenizer, prompts, batch_size=batch_size,
                                                    eviction=eviction, generation=generation, **settings):
        results[index] = result
        if on_result is not None:
            on_result(index, result)
    return results  # type: ignore[return-value]


def answer_questions(
    model: Any,
    tokenizer: Any,
    context: str,
    questions: Sequence[str],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    eviction: Optional[EvictionConfig] = None,
    generation: Optional[GenerationConfig] = None,
    **settings: Any,
) -> list[GenerationResult]:
    """Compress ``context`` once, then answer every question from its own copy,
    the questions decoded together in batches of ``batch_size``.

    Each prompt is ``context + question_separator + question`` (a
    :class:`GenerationConfig` field, default a blank line), through the chat
    template when ``chat`` (default: when the tokenizer has one). In completion
    mode (``chat=False``) nothing follows the question, so a base-model user
    can write the question as the start of the answer ("... The pass key is").
    The tokens fed are exactly those of the whole prompt encoded at once (see
    :func:`~knorm_gen.generate.split_question_prompts`). Settings as in
    :func:`~knorm_gen.generate_with_eviction`.

    The question and answer tokens are never evicted (each copy is pinned), and
    positions continue from the true context length. One result per question,
    in order; each result's ``prefill_s`` includes the shared context prefill,
    also reported alone as ``context_prefill_s``.
    """
    eviction, generation = _configs(model, eviction, generation, settings)
    if not isinstance(context, str) or not context.strip():
        raise ValueError("context is empty")
    if isinstance(questions, str):
        questions = [questions]
    if not questions:
        raise ValueError("questions is empty")
    for i, q in enumerate(questions):
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"question {i} is empty or not text")
    tok = _as_tokenizer(tokenizer)
    chat = _has_chat_template(tok) if generation.chat is None else generation.chat
    prefix_ids, question_ids = split_question_prompts(tok, context, questions, chat=chat,
                                                      question_separator=generation.question_separator)
    _check_length(model, len(prefix_ids) + max(len(q) for q in question_ids))

    engine = BatchEngine(model, tok, eviction, batch_size=batch_size,
                         prefill_step_size=generation.prefill_step_size, seed=generation.seed)
    caches = make_eviction_cache(model, engine.eviction)
    tic = time.perf_counter()
    step = generation.prefill_step_size
    for start in range(0, len(prefix_ids), step):
        model(mx.array(prefix_ids[start : start + step])[None], cache=caches)
        mx.eval([c.state for c in caches])
    context_s = time.perf_counter() - tic
    for i, (q, ids) in enumerate(zip(questions, question_ids)):
        own = copy_caches(caches)
        for c in own:
            if isinstance(c, L2NormKVCache):
                c.pin()
        engine.add(i, ids, generation, caches=own, prompt_tokens=len(prefix_ids) + len(ids), question=q,
                   context_prefill_s=context_s)
    results: list[Optional[GenerationResult]] = [None] * len(questions)
    for i, result in engine.run():
        results[i] = result
    return results  # type: ignore[return-value]
