"""Generation with an eviction cache, one row at a time, on mlx_lm's own
``stream_generate``; and the prompt handling every path shares. Several rows at
once (and ``answer_questions``) live in :mod:`knorm_gen.batched`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import cache_stats, make_eviction_cache
from .config import (  # noqa: F401  (DEFAULT_* re-exported)
    DEFAULT_PREFILL_STEP,
    DEFAULT_QUESTION_SEPARATOR,
    EvictionConfig,
    GenerationConfig,
    make_configs,
)
from .models import model_context_length

Prompt = Union[str, Sequence[int], mx.array, Sequence[dict]]


class PromptTooLongError(ValueError):
    """A prompt has more tokens than the model's context length."""


@dataclass
class GenerationResult:
    """A completion and the numbers that describe what it cost.

    ``tokens_seen`` is the number of positions the cache processed (prompt plus
    every generated token fed back, read from the cache's offset);
    ``tokens_kept`` the positions a layer at the base ``budget`` holds (the fewest
    any compressed layer holds: ``early_factor`` gives the first 30% of layers more than the
    budget, and ``layer_budgets`` may give others more; ``kept_bytes`` counts them all);
    ``compression_ratio = full_bytes / kept_bytes`` over all layers;
    ``kv_ceiling_bytes`` the most this configuration can ever hold for one row
    (None when some layer keeps every token, so memory grows with the input).
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
    kv_ceiling_bytes: Optional[int]
    prefill_s: float
    decode_s: float
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    config: dict = field(default_factory=dict)
    question: Optional[str] = None
    context_prefill_s: Optional[float] = None
    tokens: list = field(default_factory=list)
    """The generated token ids, the final one included (an end-of-sequence token when
    ``finish_reason`` is ``"stop"``)."""

    def to_dict(self) -> dict:
        """A JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_caches(cls, caches: Sequence[Any], **fields: Any) -> "GenerationResult":
        """A result whose cache numbers are read from ``caches`` (see :func:`cache_stats`)."""
        stats = cache_stats(caches)
        return cls(tokens_seen=stats.tokens_seen, tokens_kept=stats.tokens_kept,
                   compression_ratio=stats.compression_ratio, kept_bytes=stats.kept_bytes,
                   full_bytes=stats.full_bytes, kv_ceiling_bytes=stats.ceiling_bytes, **fields)


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
        ids = _encode_text(tokenizer, prompt)
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


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def _check_length(model: Any, n_prompt: int) -> None:
    ctx = model_context_length(model)
    if ctx is not None and n_prompt > ctx:
        raise PromptTooLongError(f"prompt has {n_prompt} tokens, longer than the model context of {ctx} tokens")


def _configs(model: Any, eviction, generation, settings) -> tuple[EvictionConfig, GenerationConfig]:
    eviction, generation = make_configs(eviction, generation, **settings)
    return eviction.for_model(model), generation


def _sampler(generation: GenerationConfig):
    return make_sampler(temp=generation.temperature, top_p=generation.top_p if generation.top_p < 1 else 0.0)


def result_config(eviction: EvictionConfig, generation: GenerationConfig) -> dict:
    """The settings a result reports: the resolved eviction config plus generation."""
    return {**eviction.to_dict(), **generation.to_dict()}


def _run(model, tok, ids, caches, *, generation: GenerationConfig, config_dict, prompt_tokens,
         extra_prefill_s=0.0, question=None) -> Iterator[Union[str, GenerationResult]]:
    """Drive mlx_lm's stream_generate over ``caches``; yield text, then the result."""
    last = None
    pieces = []
    tokens = []
    tic = time.perf_counter()
    first_at = None
    for resp in stream_generate(model, tok, mx.array(ids), max_tokens=generation.max_tokens,
                                sampler=_sampler(generation), prompt_cache=caches,
                                prefill_step_size=generation.prefill_step_size):
        if first_at is None:
            first_at = time.perf_counter()
        last = resp
        tokens.append(int(resp.token))
        if resp.text:
            pieces.append(resp.text)
            yield resp.text
    end = time.perf_counter()
    prefill_s = (first_at - tic) + extra_prefill_s
    decode_s = end - first_at
    yield GenerationResult.from_caches(
        caches,
        text="".join(pieces),
        finish_reason=last.finish_reason,
        prompt_tokens=prompt_tokens,
        generated_tokens=last.generation_tokens,
        prefill_s=prefill_s,
        decode_s=decode_s,
        prompt_tps=last.prompt_tps,
        generation_tps=last.generation_tps,
        peak_memory_gb=last.peak_memory,
        config=config_dict,
        question=question,
        context_prefill_s=extra_prefill_s if question is not None else None,
        tokens=tokens,
    )


def stream_with_eviction(
    model: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    eviction: Optional[EvictionConfig] = None,
    generation: Optional[GenerationConfig] = None,
    **settings: Any,
) -> Iterator[Union[str, GenerationResult]]:
    """Like :func:`generate_with_eviction`, but yields text pieces as they are
    decoded and ends with the :class:`GenerationResult`."""
    eviction, generation = _configs(model, eviction, generation, settings)
    tok = _as_tokenizer(tokenizer)
    ids = encode_prompt(tok, prompt, generation.chat)
    _check_length(model, len(ids))
    if generation.seed is not None:
        mx.random.seed(generation.seed)
    mx.reset_peak_memory()
    caches = make_eviction_cache(model, eviction)
    yield from _run(model, tok, ids, caches, generation=generation,
                    config_dict=result_config(eviction, generation), prompt_tokens=len(ids))


def generate_with_eviction(
    model: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    eviction: Optional[EvictionConfig] = None,
    generation: Optional[GenerationConfig] = None,
    **settings: Any,
) -> GenerationResult:
    """Generate a completion with L2Norm KV-cache eviction.

    ``prompt`` is text (the chat template is applied when the tokenizer has one,
    unless ``chat=False``), token ids, or chat messages. Settings come from
    ``eviction`` (:class:`EvictionConfig`) and ``generation``
    (:class:`GenerationConfig`), or as keywords naming their fields
    (``budget=64, max_tokens=48``), which override the configs. ``budget=None``
    runs the full cache through the same code path. Raises ``ValueError``
    naming the problem for bad settings or an empty prompt, and
    :class:`PromptTooLongError` for a prompt longer than the model context.
    """
    *_, result = stream_with_eviction(model, tokenizer, prompt, eviction=eviction, generation=generation,
                                      **settings)
    return result


def _common_prefix(first: Sequence[int], *others: Sequence[int]) -> int:
    n = len(first)
    for other in others:
        n = min(n, len(other))
        n = next((i for i in range(n) if first[i] != other[i]), n)
    return n


def split_question_prompts(
    tokenizer: Any, context: str, questions: Sequence[str], *, chat: bool,
    question_separator: str = DEFAULT_QUESTION_SEPARATOR,
) -> tuple[list[int], list[list[int]]]:
    """``(shared, rests)``: token ids of the context part shared by every question,
    and of each question's remainder, so that ``shared + rests[i]`` equals the
    ids of the whole prompt ``context + question_separator + questions[i]``
    encoded at once (through the chat template when ``chat``; exactly that
    text, nothing after it, in completion mode).

    The shared part is the longest token prefix common to every whole prompt
    and to the context alone: a token that BPE merges across the boundary
    belongs to the question, so no split ever tokenizes differently from the
    whole prompt.
    """
    wholes = [encode_prompt(tokenizer, context + question_separator + q, chat) for q in questions]
    if chat:
        marker = "\x00KNORM_QUESTION\x00"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + marker}], add_generation_prompt=True, tokenize=False)
        head = tokenizer.encode(rendered[: rendered.index(marker)], add_special_tokens=False)
    else:
        head = _encode_text(tokenizer, context)
    n = _common_prefix(head, *wholes)
    return wholes[0][:n], [w[n:] for w in wholes]
