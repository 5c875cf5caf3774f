"""Generation with an eviction cache, on mlx_lm's own ``stream_generate``."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import EvictionConfig, L2NormKVCache, cache_stats, copy_caches, make_eviction_cache
from .models import model_context_length

Prompt = Union[str, Sequence[int], mx.array, Sequence[dict]]

DEFAULT_PREFILL_STEP = 512


@dataclass
class GenerationResult:
    """A completion and the numbers that describe what it cost.

    ``tokens_seen`` is the number of positions the cache processed (prompt plus
    every generated token fed back, read from the cache's offset);
    ``tokens_kept`` the most positions any compressed layer holds;
    ``compression_ratio = full_bytes / kept_bytes`` over all layers.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    tokens_seen: int
    tokens_kept: int
    compression_ratio: float
    kept_bytes: int
    full_bytes: int
    prefill_s: float
    decode_s: float
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    config: dict = field(default_factory=dict)
    question: Optional[str] = None
    context_prefill_s: Optional[float] = None

    def to_dict(self) -> dict:
        """A JSON-serialisable dict."""
        return asdict(self)


def _as_tokenizer(tokenizer: Any) -> TokenizerWrapper:
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: Optional[bool] = None) -> list[int]:
    """Token ids for text, token ids, or chat messages.

    ``chat=None`` applies the chat template to text when the tokenizer has one
    (what an instruct model expects); messages always use it.
    """
    if isinstance(prompt, mx.array):
        ids = prompt.tolist()
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if chat is None:
            chat = _has_chat_template(tokenizer)
        if chat:
            return encode_prompt(tokenizer, [{"role": "user", "content": prompt}])
        ids = tokenizer.encode(prompt)  # with BOS where the tokenizer adds one (Gemma needs it)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        for i, m in enumerate(prompt):
            if "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}")
        if chat is False:
            raise ValueError("chat messages need the chat template; do not pass chat=False with messages")
        if not _has_chat_template(tokenizer):
            raise ValueError("this tokenizer has no chat template, so chat messages cannot be rendered")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):  # transformers may return a BatchEncoding
            ids = ids["input_ids"]
    elif isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be text, a list of token ids, or a list of chat messages")
        ids = list(prompt)
    else:
        raise ValueError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
    if len(ids) == 0:
        raise ValueError("prompt is empty")
    return list(ids)


def _check_length(model: Any, n_prompt: int) -> None:
    ctx = model_context_length(model)
    if ctx is not None and n_prompt > ctx:
        raise ValueError(f"prompt has {n_prompt} tokens, longer than the model context of {ctx} tokens")


def _check_sampling(max_tokens: int, temperature: float, top_p: float) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def _config(model, budget, n_sink, recent, keep, skip_layers) -> EvictionConfig:
    config = EvictionConfig(budget=budget, n_sink=n_sink, recent=recent, keep=keep,
                            skip_layers=None if skip_layers is None else tuple(skip_layers))
    return config.resolved(len(model.layers))


def _sampler(temperature: float, top_p: float):
    return make_sampler(temp=temperature, top_p=top_p if top_p < 1 else 0.0)


def _result_config(config: EvictionConfig, max_tokens, temperature, top_p, seed, prefill_step_size) -> dict:
    """The settings a result reports: the resolved eviction config plus sampling."""
    return {**config.to_dict(), "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "seed": seed, "prefill_step_size": prefill_step_size}


def _run(model, tok, ids, caches, *, max_tokens, sampler, prefill_step_size, config_dict, prompt_tokens,
         extra_prefill_s=0.0, question=None) -> Iterator[Union[str, GenerationResult]]:
    """Drive mlx_lm's stream_generate over ``caches``; yield text, then the result."""
    last = None
    pieces = []
    tic = time.perf_counter()
    first_at = None
    for resp in stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens, sampler=sampler,
                                prompt_cache=caches, prefill_step_size=prefill_step_size):
        if first_at is None:
            first_at = time.perf_counter()
        last = resp
        if resp.text:
            pieces.append(resp.text)
            yield resp.text
    end = time.perf_counter()
    stats = cache_stats(caches)
    prefill_s = (first_at - tic) + extra_prefill_s
    decode_s = end - first_at
    yield GenerationResult(
        text="".join(pieces),
        finish_reason=last.finish_reason,
        prompt_tokens=prompt_tokens,
        generated_tokens=last.generation_tokens,
        tokens_seen=stats.tokens_seen,
        tokens_kept=stats.tokens_kept,
        compression_ratio=stats.compression_ratio,
        kept_bytes=stats.kept_bytes,
        full_bytes=stats.full_bytes,
        prefill_s=prefill_s,
        decode_s=decode_s,
        prompt_tps=last.prompt_tps,
        generation_tps=last.generation_tps,
        peak_memory_gb=last.peak_memory,
        config=config_dict,
        question=question,
        context_prefill_s=extra_prefill_s if question is not None else None,
    )


def stream_with_eviction(
    model: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    budget: Optional[int] = 512,
    n_sink: int = 4,
    recent: Optional[int] = None,
    keep: str = "low",
    skip_layers: Optional[Sequence[int]] = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    chat: Optional[bool] = None,
) -> Iterator[Union[str, GenerationResult]]:
    """Like :func:`generate_with_eviction`, but yields text pieces as they are
    decoded and ends with the :class:`GenerationResult`."""
    config = _config(model, budget, n_sink, recent, keep, skip_layers)
    _check_sampling(max_tokens, temperature, top_p)
    tok = _as_tokenizer(tokenizer)
    ids = encode_prompt(tok, prompt, chat)
    _check_length(model, len(ids))
    if seed is not None:
        mx.random.seed(seed)
    mx.reset_peak_memory()
    caches = make_eviction_cache(model, config)
    cfg = _result_config(config, max_tokens, temperature, top_p, seed, prefill_step_size)
    yield from _run(model, tok, ids, caches, max_tokens=max_tokens, sampler=_sampler(temperature, top_p),
                    prefill_step_size=prefill_step_size, config_dict=cfg, prompt_tokens=len(ids))


def generate_with_eviction(model: Any, tokenizer: Any, prompt: Prompt, **kwargs: Any) -> GenerationResult:
    """Generate a completion with L2Norm KV-cache eviction.

    ``prompt`` is text (the chat template is applied when the tokenizer has one,
    unless ``chat=False``), token ids, or chat messages. ``budget=None`` runs the
    full cache through the same code path. Keyword arguments are those of
    :func:`stream_with_eviction`. Raises ``ValueError`` naming the problem for
    bad arguments, an empty prompt, or a prompt longer than the model context.
    """
    *_, result = stream_with_eviction(model, tokenizer, prompt, **kwargs)
    return result


def _split_template(tok: TokenizerWrapper, context: str, chat: bool) -> tuple[str, str]:
    """(prefix, suffix_template) so that prompt = prefix + "\n\n" + question + suffix.

    The split sits right after the context, a natural pre-token boundary, so
    the two parts tokenize exactly as the whole prompt does.
    """
    if not chat:
        return context, "\n"
    marker = "\x00KNORM_QUESTION\x00"
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": context + marker}], add_generation_prompt=True, tokenize=False
    )
    i = rendered.index(marker)
    return rendered[:i], rendered[i + len(marker):]


def answer_questions(
    model: Any,
    tokenizer: Any,
    context: str,
    questions: Sequence[str],
    *,
    budget: Optional[int] = 512,
    n_sink: int = 4,
    recent: Optional[int] = None,
    keep: str = "low",
    skip_layers: Optional[Sequence[int]] = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP,
    chat: Optional[bool] = None,
) -> list[GenerationResult]:
    """Compress ``context`` once, then answer each question from its own copy.

    The question and answer tokens are never evicted (the copy is pinned), and
    positions continue from the true context length. One result per question;
    each result's ``prefill_s`` includes the shared context prefill, also
    reported alone as ``context_prefill_s``.
    """
    config = _config(model, budget, n_sink, recent, keep, skip_layers)
    _check_sampling(max_tokens, temperature, top_p)
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
    if chat is None:
        chat = _has_chat_template(tok)
    prefix, suffix = _split_template(tok, context, chat)
    prefix_ids = tok.encode(prefix, add_special_tokens=not chat)  # a chat template writes its own BOS
    question_ids = [tok.encode("\n\n" + q + suffix, add_special_tokens=False) for q in questions]
    _check_length(model, len(prefix_ids) + max(len(q) for q in question_ids))

    mx.reset_peak_memory()
    caches = make_eviction_cache(model, config)
    tic = time.perf_counter()
    for start in range(0, len(prefix_ids), prefill_step_size):
        model(mx.array(prefix_ids[start : start + prefill_step_size])[None], cache=caches)
        mx.eval([c.state for c in caches])
    context_s = time.perf_counter() - tic
    cfg = _result_config(config, max_tokens, temperature, top_p, seed, prefill_step_size)

    results = []
    for q, ids in zip(questions, question_ids):
        if seed is not None:
            mx.random.seed(seed)
        own = copy_caches(caches)
        for c in own:
            if isinstance(c, L2NormKVCache):
                c.pin()
        *_, result = _run(model, tok, ids, own, max_tokens=max_tokens, sampler=_sampler(temperature, top_p),
                          prefill_step_size=prefill_step_size, config_dict=cfg, extra_prefill_s=context_s,
                          prompt_tokens=len(prefix_ids) + len(ids), question=q)
        results.append(result)
    return results
