"""Generation with an eviction cache: one row on mlx_lm's own ``stream_generate``,
several rows together on the one scheduler (:mod:`knorm_gen.generation.engine`), and a
context compressed once for several questions."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from ..eviction.config import LAYOUT_FIELDS, EvictionConfig, GenerationConfig, ResolvedEviction, make_configs
from ..models.support import check_model
from .engine import DEFAULT_BATCH_SIZE, Request, run_jobs, stream_request
from .long_documents import REDUCE_HEADER, check_room, fit_context, fit_prompt, needs_pieces, pieces, room_for
from .prompts import (
    Prompt,
    as_tokenizer,
    check_length,
    context_spans,
    encode_text,
    encode_with_spans,
    has_chat_template,
    question_prompts,
)
from .results import GenerationResult

__all__ = [
    "GenerationResult", "generate_with_eviction", "stream_with_eviction", "generate_batch_with_eviction",
    "stream_batch_with_eviction", "answer_questions",
]

Eviction = Union[EvictionConfig, ResolvedEviction, None]


def resolve_settings(model: Any, eviction: Eviction, generation: Optional[GenerationConfig],
                     settings: dict, tokenizer: Any = None, texts: Sequence[Any] = ()) -> tuple[ResolvedEviction,
                                                                                             GenerationConfig]:
    """The configs a call runs with: keyword fields over the configs, the eviction
    settings resolved for ``model`` (a :class:`ResolvedEviction` is taken as it is
    unless a keyword changes it). With ``preset="auto"``, the documents ``texts``
    tell the run's compression, which the saved tuning must match
    (:func:`~knorm_gen.generation.tunings.auto_config`)."""
    if isinstance(eviction, ResolvedEviction) and not set(settings) & {*EvictionConfig.__dataclass_fields__, "preset"}:
        _, generation = make_configs(None, generation, **settings)
        return eviction, generation
    if isinstance(eviction, ResolvedEviction):
        raise TypeError("eviction settings given as keywords need an EvictionConfig, not a resolved one")
    eviction, generation = make_configs(eviction, generation, **settings)
    if settings.get("preset") == "auto":  # the model's saved tuning (knorm-tune); the default without one
        from .tunings import auto_config, run_ratio

        ratio = run_ratio(tokenizer, texts, eviction) if tokenizer is not None else None
        eviction, note = auto_config(model, eviction, tuple(k for k in LAYOUT_FIELDS if k in settings), ratio)
        if note.startswith("preset auto: no saved tuning") or "so the default layout runs" in note:
            warnings.warn(note, stacklevel=3)
    resolved = eviction.for_model(model)
    check_model(model, resolved)
    return resolved, generation


def _chat(tokenizer: Any, generation: GenerationConfig) -> bool:
    return has_chat_template(tokenizer) if generation.chat is None else generation.chat


def stream_with_eviction(
    model: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    eviction: Eviction = None,
    generation: Optional[GenerationConfig] = None,
    **settings: Any,
) -> Iterator[Union[str, GenerationResult]]:
    """Like :func:`generate_with_eviction`, but yields text pieces as they are
    decoded and ends with the :class:`GenerationResult`."""
    eviction, generation = resolve_settings(model, eviction, generation, settings, tokenizer, [prompt])
    tok = as_tokenizer(tokenizer)
    yield from stream_request(model, tok, prompt_request(model, tok, 0, prompt, eviction, generation))


def generate_with_eviction(
    model: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    eviction: Eviction = None,
    generation: Optional[GenerationConfig] = None,
    **settings: Any,
) -> GenerationResult:
    """Generate a completion with KV-cache eviction (the default rule, or the chosen one).

    ``prompt`` is text (the chat template is applied when the tokenizer has one,
    unless ``chat=False``), token ids, or chat messages. Settings come from
    ``eviction`` (:class:`EvictionConfig`) and ``generation``
    (:class:`GenerationConfig`), or as keywords naming their fields
    (``budget=64, max_tokens=48``), which override the configs. ``budget=None``
    runs the full cache through the same code path. Raises ``ValueError``
    naming the problem for bad settings or an empty prompt, and
    :class:`~knorm_gen.generation.prompts.PromptTooLongError` for a prompt longer than the
    model context.
    """
    *_, result = stream_with_eviction(model, tokenizer, prompt, eviction=eviction, generation=generation,
                                      **settings)
    return result


def stream_batch_with_eviction(
    model: Any,
    tokenizer: Any,
    prompts: Iterable[Prompt],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    eviction: Eviction = None,
    generation: Optional[GenerationConfig] = None,
    **settings: Any,
) -> Iterator[tuple[int, GenerationResult]]:
    """Like :func:`generate_batch_with_eviction`, but yields ``(index, result)``
    as each row finishes (not in input order). Prompts are read lazily, so an
    endless iterable works; at most ``batch_size`` rows are in flight (the
    scheduler ``knorm-batch`` uses, so the two compute the same batches)."""
    eviction, generation = resolve_settings(model, eviction, generation, settings, tokenizer,
                                            list(prompts[:64]) if isinstance(prompts, (list, tuple)) else ())
    tok = as_tokenizer(tokenizer)

    def requests() -> Iterator[Request]:
        for index, prompt in enumerate(prompts):
            yield prompt_request(model, tok, index, prompt, eviction, generation)

    for request, (result,) in run_jobs(model, tok, requests(), batch_size=batch_size, seed=generation.seed):
        yield request.key, result


def generate_batch_with_eviction(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    eviction: Eviction = None,
    generation: Optional[GenerationConfig] = None,
    on_result: Optional[Callable[[int, GenerationResult], None]] = None,
    **settings: Any,
) -> list[GenerationResult]:
    """Generate for several prompts at once, each row evicting exactly as it
    would alone; one :class:`GenerationResult` per prompt, in input order.

    Up to ``batch_size`` rows decode together (mlx_lm's continuous batching: a
    row that finishes makes room for the next). Settings are those of
    :func:`generate_with_eviction`. ``on_result(index, result)`` is called as
    each row finishes. Each result carries its own cache numbers; prefill and
    decode time are shared and attributed as
    :class:`~knorm_gen.generation.engine.BatchEngine` describes. With ``temperature > 0``
    (or ``keep="random"``) the rows draw from one random stream: a run is
    reproducible for the same prompts and ``batch_size``, but a row's draws
    differ from the same row run alone.
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
    eviction: Eviction = None,
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
    :func:`~knorm_gen.generation.prompts.split_question_prompts`). Settings as in
    :func:`generate_with_eviction`.

    The question and answer tokens are never evicted (each copy is pinned), and
    positions continue from the true context length. One result per question,
    in order; each result's ``prefill_s`` includes the shared context prefill,
    also reported alone as ``context_prefill_s``.
    """
    eviction, generation = resolve_settings(model, eviction, generation, settings, tokenizer, [context])
    tok = as_tokenizer(tokenizer)
    if isinstance(context, str) and needs_pieces(model, tok, context, _as_list(questions), generation):
        return answer_in_pieces(model, tok, context, _as_list(questions), eviction, generation, batch_size,
                                generation.seed)
    request = question_request(model, tok, "context", context, questions, eviction, generation)
    ((_, results),) = run_jobs(model, tok, [request], batch_size=batch_size, seed=generation.seed)
    return results


def _as_list(questions: Any) -> list:
    return [questions] if isinstance(questions, str) else list(questions)


def prompt_request(model: Any, tokenizer: Any, key: Any, prompt: Prompt, eviction: ResolvedEviction,
                   generation: GenerationConfig, tag: Any = None) -> Request:
    """A :class:`~knorm_gen.generation.engine.Request` for one prompt: its ids, checked against the
    model context, and the document's positions in them (the rest is pinned)."""
    info = None
    if generation.long_documents == "truncate":
        prompt, info = fit_prompt(model, tokenizer, prompt, generation)
    ids, spans = encode_with_spans(tokenizer, prompt, generation.chat, generation.system_prompt,
                                   special=generation.parse_special_tokens,
                                   pin_prefix_chars=generation.pin_prefix_chars)
    check_length(model, len(ids))
    return Request(key, eviction.for_row(spans, len(ids)), generation, ids=ids, spans=spans, tag=tag,
                   long_document=info)


def question_request(model: Any, tokenizer: Any, key: Any, context: str, questions: Sequence[str],
                     eviction: ResolvedEviction, generation: GenerationConfig, tag: Any = None) -> Request:
    """A :class:`~knorm_gen.generation.engine.Request` for a context and its questions: the shared
    context ids, each question's ids, and the document's positions in the context
    (its template, system turn, questions and answers are pinned). Under
    ``long_documents="truncate"`` a document longer than the model's context keeps its start
    and end (:mod:`knorm_gen.generation.long_documents`)."""
    info = None
    if generation.long_documents == "truncate" and isinstance(context, str) and context.strip():
        context, info = fit_context(model, tokenizer, context, [questions] if isinstance(questions, str)
                                    else list(questions), generation)
    questions, context_ids, question_ids = question_prompts(
        model, tokenizer, context, questions, chat=generation.chat, question_separator=generation.question_separator,
        system_prompt=generation.system_prompt, special=generation.parse_special_tokens)
    spans = context_spans(tokenizer, context, context_ids, chat=_chat(tokenizer, generation),
                          system_prompt=generation.system_prompt, special=generation.parse_special_tokens,
                          pin_prefix_chars=generation.pin_prefix_chars)
    return Request(key, eviction.for_row(spans, len(context_ids)), generation, context_ids=context_ids,
                   questions=questions, question_ids=question_ids, spans=spans, tag=tag, long_document=info)


# ---- documents longer than the context, in pieces (long_documents="chunk") ----------------


def answer_in_pieces(model: Any, tokenizer: Any, context: str, questions: Sequence[str],
                     eviction: ResolvedEviction, generation: GenerationConfig, batch_size: int,
                     seed: Optional[int] = None) -> list:
    """Map, then reduce: each question answered on every piece of ``context`` that fits, with
    eviction (the pieces decode together), then once more over the pieces' answers. One result
    per question; its cache numbers are its largest piece's, its times the sum of every step's,
    and its ``long_document`` lists the pieces."""
    doc, fits = room_for(model, tokenizer, context, questions, generation)
    check_room(model, fits, generation)
    parts = [p for p in pieces(tokenizer, context, fits, generation) if p.strip()]  # a blank stretch is no piece
    if not parts:
        raise ValueError("context is empty: the document holds only whitespace")
    requests = [question_request(model, tokenizer, i, part, questions, eviction, generation)
                for i, part in enumerate(parts)]
    mapped = {r.key: results for r, results in run_jobs(model, tokenizer, requests, batch_size=batch_size, seed=seed)}
    by_piece = [mapped[i] for i in range(len(parts))]
    final = []
    for q, question in enumerate(questions):
        notes = "\n\n".join(REDUCE_HEADER.format(i=i + 1, n=len(parts)) + results[q].text.strip()
                            for i, results in enumerate(by_piece))
        reduce = question_request(model, tokenizer, "reduce", notes, [question], eviction, generation)
        ((_, (answer,)),) = run_jobs(model, tokenizer, [reduce], batch_size=batch_size, seed=seed)
        final.append(_with_pieces(answer, [results[q] for results in by_piece], parts, tokenizer, doc))
    return final


def _with_pieces(answer: Any, mapped: list, parts: list[str], tokenizer: Any, document_tokens: int) -> Any:
    peak = max(mapped, key=lambda r: r.tokens_seen)
    info = {"mode": "chunk", "document_tokens": document_tokens,
            "pieces": [{"tokens": len(encode_text(tokenizer, p)), "tokens_seen": r.tokens_seen,
                        "tokens_kept": r.tokens_kept, "compression_ratio": r.compression_ratio, "answer": r.text}
                       for p, r in zip(parts, mapped)]}
    return replace(answer, tokens_seen=peak.tokens_seen, tokens_kept=peak.tokens_kept,
                   tokens_pinned=peak.tokens_pinned, compression_ratio=peak.compression_ratio,
                   token_ratio=peak.token_ratio, kept_bytes=peak.kept_bytes, full_bytes=peak.full_bytes,
                   kv_ceiling_bytes=peak.kv_ceiling_bytes, prompt_tokens=peak.prompt_tokens,
                   prefill_s=answer.prefill_s + sum(r.prefill_s for r in mapped),
                   decode_s=answer.decode_s + sum(r.decode_s for r in mapped), long_document=info)
