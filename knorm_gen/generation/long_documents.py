"""Documents longer than the model's context (``long_documents``, ``--long-documents``).

- ``error`` (the default): the row fails with a record that names its length, the model's
  context and the two choices below;
- ``truncate``: the document keeps its start and its end, half of the room each (the room: the
  context less the template, the question and a whole ``max_tokens`` answer), with ``[...]``
  where the middle was; the record says how many tokens were kept of each end and how many cut;
- ``chunk`` (question rows): the document is read in pieces that fit (cut at a sentence or line
  end near each boundary); the job's question is answered on each piece with eviction, then once
  more over the pieces' answers (map, then reduce). The record lists the pieces and their counts.

A row's ``long_document`` (on each :class:`~knorm_gen.generation.results.GenerationResult` and in the
record) is None when the document fit.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from ..eviction.config import GenerationConfig
from ..platform.mlx_compat import model_context_length
from .prompts import encode_prompt, encode_text, has_chat_template, split_question_prompts

CUT_MARK = "\n\n[...]\n\n"
"""What stands where a truncated document's middle was."""

REDUCE_HEADER = "Part {i} of {n}: "
"""How each piece's answer is introduced in the final pass over the pieces' answers."""


def room_for(model: Any, tokenizer: Any, context: str, questions: Sequence[str],
             generation: GenerationConfig) -> tuple[int, Optional[int]]:
    """``(document tokens, the most that fit)``: the document's own tokens, and how many of
    them fit with the template, each question and a whole ``max_tokens`` answer in the
    model's context (None: the context is unknown)."""
    limit = model_context_length(model)
    chat = has_chat_template(tokenizer) if generation.chat is None else generation.chat
    doc = len(encode_text(tokenizer, context, special=generation.parse_special_tokens))
    if limit is None:
        return doc, None
    prefix, rests = split_question_prompts(tokenizer, context, questions, chat=chat,
                                           question_separator=generation.question_separator,
                                           system_prompt=generation.system_prompt,
                                           special=generation.parse_special_tokens)
    overhead = len(prefix) + max(len(r) for r in rests) - doc
    return doc, max(limit - overhead - generation.max_tokens, 0)


def truncate(tokenizer: Any, context: str, fits: int, generation: GenerationConfig) -> tuple[str, dict]:
    """``context`` cut to its first and last halves of ``fits`` tokens, and what the record says."""
    ids = encode_text(tokenizer, context, special=generation.parse_special_tokens)
    mark = len(encode_text(tokenizer, CUT_MARK))
    keep = max(fits - mark - 2, 2)  # two spare: a token may merge differently at each cut
    head, tail = keep - keep // 2, keep // 2
    text = tokenizer.decode(ids[:head]) + CUT_MARK + tokenizer.decode(ids[-tail:])
    return text, {"mode": "truncate", "document_tokens": len(ids), "kept_start": head, "kept_end": tail,
                  "cut": len(ids) - head - tail}


def pieces(tokenizer: Any, context: str, fits: int, generation: GenerationConfig) -> list[str]:
    """``context`` in the fewest pieces of at most ``fits`` tokens, of about equal length, each
    cut after the sentence or line end nearest its share (within a tenth of the room)."""
    ids = encode_text(tokenizer, context, special=generation.parse_special_tokens)
    room = max(fits - 2, 1)  # two spare: a token may merge differently at each cut
    count = math.ceil(len(ids) / room)
    out, start = [], 0
    while start < len(ids):
        left = count - len(out)
        end = len(ids) if left <= 1 else min(start + math.ceil((len(ids) - start) / left), len(ids))
        if end < len(ids):
            near = [j for j in range(max(end - room // 10, start + 1), min(end + room // 10, start + room) + 1)
                    if any(c in tokenizer.decode(ids[j - 1 : j]) for c in ".!?\n")]
            end = min(near, key=lambda j: abs(j - end)) if near else end
        out.append(tokenizer.decode(ids[start:end]))
        start = end
    return out


def fit_context(model: Any, tokenizer: Any, context: str, questions: Sequence[str],
                generation: GenerationConfig) -> tuple[str, Optional[dict]]:
    """The context a question row runs with under ``long_documents="truncate"``: itself when
    it fits with a whole answer, else its start and end (:func:`truncate`)."""
    doc, fits = room_for(model, tokenizer, context, questions, generation)
    if fits is None or doc <= fits:
        return context, None
    return truncate(tokenizer, context, fits, generation)


def fit_prompt(model: Any, tokenizer: Any, prompt: Any, generation: GenerationConfig) -> tuple[Any, Optional[dict]]:
    """A prompt row's prompt under ``long_documents="truncate"``: itself when it fits with a
    whole answer, else (text prompts) its user text's start and end."""
    limit = model_context_length(model)
    if limit is None or not isinstance(prompt, str):
        return prompt, None
    whole = len(encode_prompt(tokenizer, prompt, generation.chat, generation.system_prompt,
                              special=generation.parse_special_tokens))
    if whole + generation.max_tokens <= limit:
        return prompt, None
    doc = len(encode_text(tokenizer, prompt, special=generation.parse_special_tokens))
    return truncate(tokenizer, prompt, max(limit - (whole - doc) - generation.max_tokens, 0), generation)


def needs_pieces(model: Any, tokenizer: Any, context: str, questions: Sequence[str],
                 generation: GenerationConfig) -> bool:
    """Whether a question row is to be read in pieces (``chunk``, and it does not fit)."""
    if generation.long_documents != "chunk":
        return False
    doc, fits = room_for(model, tokenizer, context, questions, generation)
    return fits is not None and doc > fits
