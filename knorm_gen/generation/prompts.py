"""From what a user gives to the token ids a model is fed: text, token ids or chat
messages; a context with questions split where the questions begin; and the
check that a prompt fits the model's context."""

from __future__ import annotations

import re
import weakref
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..eviction.config import DEFAULT_QUESTION_SEPARATOR
from ..eviction.spans import ALL_EVICTABLE, Spans
from ..platform.mlx_compat import model_context_length

Prompt = Union[str, Sequence[int], mx.array, Sequence[dict]]


class PromptTooLongError(ValueError):
    """A prompt has more tokens than the model's context length."""


def as_tokenizer(tokenizer: Any) -> TokenizerWrapper:
    """mlx_lm's wrapper around a tokenizer (its detokenizer and stop ids)."""
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: Optional[bool] = None, system_prompt: Optional[str] = None,
                  *, special: bool = False) -> list[int]:
    """Token ids for text, token ids, or chat messages.

    ``chat=None`` applies the chat template to text when the tokenizer has one
    (what an instruct model expects); messages always use it. ``system_prompt``
    goes first as a system message (unless the messages start with their own);
    it needs the chat template. User text is
    tokenized as text: ``<|im_end|>`` written in it is those characters, not the
    control token (only the chat template's own markers are). ``special=True``
    (``parse_special_tokens``) parses special-token spellings in the text too.
    """
    if isinstance(prompt, mx.array):
        ids = prompt.tolist()
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if chat is None:
            chat = has_chat_template(tokenizer)
        if chat:
            return encode_prompt(tokenizer, [{"role": "user", "content": prompt}], system_prompt=system_prompt,
                                 special=special)
        _no_system_prompt(system_prompt)
        ids = encode_text(tokenizer, prompt, special=special)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = _encode_messages(tokenizer, with_system_prompt(prompt, system_prompt), chat, special)
    elif isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be text, a list of token ids, or a list of chat messages")
        ids = list(prompt)
    else:
        raise ValueError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
    if len(ids) == 0:
        raise ValueError("prompt is empty")
    return list(ids)


DOCUMENT_ROLES = ("user", "assistant")
"""Message roles whose content is the document (evictable); every other role's
content (``system``, ``developer``, ``tool``) and the template around them are pinned."""


def encode_with_spans(tokenizer: Any, prompt: Prompt, chat: Optional[bool] = None,
                      system_prompt: Optional[str] = None, *, special: bool = False,
                      pin_prefix_chars: int = 0) -> tuple[list[int], Spans]:
    """``(ids, spans)``: :func:`encode_prompt`'s ids, and the position ranges of the
    document in them, the only positions eviction may drop.

    Through the chat template the document is the content of the user and
    assistant messages (a text prompt is one user message); the template's
    markup, the system turn and everything after the last such content (the
    generation prompt and the answer) are pinned, as are the first
    ``pin_prefix_chars`` characters of each user message (an instruction written
    before the document). Without the template (completion style, token ids)
    there is no instruction to tell apart: the whole prompt and the answer are
    evictable, the sinks aside. A token the template's text shares with the
    content (a BPE merge across the boundary) is pinned."""
    ids = encode_prompt(tokenizer, prompt, chat, system_prompt, special=special)
    if isinstance(prompt, str):
        if not (has_chat_template(tokenizer) if chat is None else chat):
            return ids, ALL_EVICTABLE
        messages = with_system_prompt([{"role": "user", "content": prompt}], system_prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = with_system_prompt(prompt, system_prompt)
    else:
        return ids, ALL_EVICTABLE
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") not in DOCUMENT_ROLES or not isinstance(m.get("content"), str) or not m["content"]:
            continue
        lead = m["content"][:pin_prefix_chars] if m["role"] == "user" else ""
        start = _common_prefix(ids, ids_before_marker(tokenizer, messages, i, lead, special))
        end = _common_prefix(ids, ids_before_marker(tokenizer, messages, i, m["content"], special))
        if end > start:
            spans.append((start, end))
    return ids, tuple(spans)


_MARKER = "\x00KNORM_MARK\x00"


def ids_before_marker(tokenizer: Any, messages: Sequence[dict], index: int, text: str, special: bool) -> list[int]:
    """Token ids of the rendered chat up to where message ``index``'s content,
    replaced by ``text``, ends."""
    marked = [dict(m) for m in messages]
    marked[index]["content"] = text + _MARKER
    if not special and _holds_special(tokenizer, [m[k] for m in marked for k in ("role", "content")]):
        return _render_as_text(tokenizer, marked, until=_MARKER)
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered[: rendered.index(_MARKER)], add_special_tokens=False))


def _encode_messages(tokenizer: Any, messages: Sequence[dict], chat: Optional[bool], special: bool = False) -> list[int]:
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}")
    if chat is False:
        raise ValueError("chat messages need the chat template; do not pass chat=False with messages")
    if not has_chat_template(tokenizer):
        raise ValueError("this tokenizer has no chat template, so chat messages cannot be rendered")
    if not special and _holds_special(tokenizer, [m[k] for m in messages for k in ("role", "content")]):
        return _render_as_text(tokenizer, messages)
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def with_system_prompt(messages: Sequence[dict], system_prompt: Optional[str]) -> list[dict]:
    """``messages`` with ``system_prompt`` first, unless they start with a system message."""
    messages = list(messages)
    if system_prompt is None or (messages and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _no_system_prompt(system_prompt: Optional[str]) -> None:
    if system_prompt is not None:
        raise ValueError("system_prompt needs the chat template; it cannot be used with chat=False")


def encode_text(tokenizer: Any, text: str, *, special: bool = False) -> list[int]:
    """Plain text to ids, with the tokenizer's BOS (unless ``special`` and the
    text starts with it); special-token spellings are text unless ``special``."""
    if not special:
        return list(tokenizer.encode(text, add_special_tokens=True, split_special_tokens=True))
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


_SPECIALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _specials(tokenizer: Any) -> tuple[Optional["re.Pattern"], dict]:
    """A regex matching the spelling of any of the tokenizer's special tokens
    (None: none) and each spelling's id; found once per tokenizer (Gemma 3 has
    6,249 special tokens)."""
    inner = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    try:
        return _SPECIALS[inner]
    except (KeyError, TypeError):
        pass
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {t.content: i for i, t in decoder.items() if getattr(t, "special", False) and t.content}
    spellings = sorted(ids, key=len, reverse=True)
    found = (re.compile("|".join(map(re.escape, spellings))) if spellings else None, ids)
    try:
        _SPECIALS[inner] = found
    except TypeError:  # not weakly referable: found again next time
        pass
    return found


def _special_pattern(tokenizer: Any) -> Optional["re.Pattern"]:
    return _specials(tokenizer)[0]


def _holds_special(tokenizer: Any, texts: Sequence[str]) -> bool:
    pattern = _special_pattern(tokenizer)
    return pattern is not None and any(pattern.search(t) for t in texts)


_SENTINEL = "\x00KNORM_TEXT_{}\x00"


def _render_as_text(tokenizer: Any, messages: Sequence[dict], *, until: Optional[str] = None) -> list[int]:
    """Messages through the chat template, the template's markers as special
    tokens and the contents as text (only called when a content spells a
    special token; otherwise the template's own tokenization is used as ever).
    Each special spelling in a content is swapped for a sentinel before
    rendering, so every special token left in the rendered text is the
    template's; the text between two of them is tokenized with special tokens
    split, sentinels restored. ``until``: only the rendered text before it."""
    pattern = _special_pattern(tokenizer)
    found: list[str] = []

    def hide(m: "re.Match") -> str:
        found.append(m.group(0))
        return _SENTINEL.format(len(found) - 1)

    hidden = [{**m, "role": pattern.sub(hide, m["role"]), "content": pattern.sub(hide, m["content"])}
              for m in messages]
    rendered = tokenizer.apply_chat_template(hidden, add_generation_prompt=True, tokenize=False)
    if until is not None:
        rendered = rendered[: rendered.index(until)]
    restore = re.compile(_SENTINEL.format("([0-9]+)"))
    vocab = _specials(tokenizer)[1]
    ids: list[int] = []
    pos = 0
    for m in list(pattern.finditer(rendered)) + [None]:
        piece = rendered[pos: m.start() if m else len(rendered)]
        if piece:
            piece = restore.sub(lambda r: found[int(r.group(1))] if int(r.group(1)) < len(found) else r.group(0),
                                piece)
            ids.extend(tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True))
        if m:
            ids.append(vocab[m.group(0)])
            pos = m.end()
    return ids


def check_length(model: Any, n_prompt: int) -> None:
    """Raise :class:`PromptTooLongError` when ``n_prompt`` tokens exceed the model context;
    the message names the length, the limit and the fixes."""
    ctx = model_context_length(model)
    if ctx is not None and n_prompt > ctx:
        raise PromptTooLongError(
            f"the prompt has {n_prompt} tokens, more than the model's context of {ctx} tokens: choose "
            f"--long-documents truncate (keep the document's start and end) or chunk (question rows: answer the "
            f"question on each piece that fits, then over the pieces' answers), or a model with a longer context")


def _common_prefix(first: Sequence[int], *others: Sequence[int]) -> int:
    n = len(first)
    for other in others:
        n = min(n, len(other))
        n = next((i for i in range(n) if first[i] != other[i]), n)
    return n


def split_question_prompts(
    tokenizer: Any, context: str, questions: Sequence[str], *, chat: bool,
    question_separator: str = DEFAULT_QUESTION_SEPARATOR, system_prompt: Optional[str] = None, special: bool = False,
) -> tuple[list[int], list[list[int]]]:
    """``(shared, rests)``: token ids of the context part shared by every question,
    and of each question's remainder, so that ``shared + rests[i]`` equals the
    ids of the whole prompt ``context + question_separator + questions[i]``
    encoded at once (through the chat template when ``chat``; exactly that
    text, nothing after it, in completion mode).

    The shared part is the longest token prefix common to every whole prompt
    and to the context alone: a token that BPE merges across the boundary
    belongs to the question, so no split ever tokenizes differently from the
    whole prompt. Special-token spellings are text unless ``special`` (see
    :func:`encode_prompt`).
    """
    wholes = [encode_prompt(tokenizer, context + question_separator + q, chat, system_prompt, special=special)
              for q in questions]
    if chat:
        marker = "\x00KNORM_QUESTION\x00"
        messages = with_system_prompt([{"role": "user", "content": context + marker}], system_prompt)
        if not special and _holds_special(tokenizer, [context, system_prompt or ""]):
            head = _render_as_text(tokenizer, messages, until=marker)
        else:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            head = tokenizer.encode(rendered[: rendered.index(marker)], add_special_tokens=False)
    else:
        head = encode_text(tokenizer, context, special=special)
    n = _common_prefix(head, *wholes)
    return wholes[0][:n], [w[n:] for w in wholes]


def context_spans(tokenizer: Any, context: str, context_ids: Sequence[int], *, chat: bool,
                  system_prompt: Optional[str] = None, special: bool = False, pin_prefix_chars: int = 0) -> Spans:
    """The document's positions in ``context_ids`` (:func:`split_question_prompts`'
    shared part): everything before the context's text (template, system turn,
    user-turn header, the first ``pin_prefix_chars`` characters) is pinned, and
    so is everything after ``context_ids`` (separator, question, answer)."""
    start = 0
    if chat:
        messages = with_system_prompt([{"role": "user", "content": context}], system_prompt)
        start = _common_prefix(context_ids, ids_before_marker(tokenizer, messages, len(messages) - 1,
                                                               context[:pin_prefix_chars], special))
    elif pin_prefix_chars:
        start = _common_prefix(context_ids, encode_text(tokenizer, context[:pin_prefix_chars], special=special))
    return ((start, len(context_ids)),) if len(context_ids) > start else ()


def question_prompts(model: Any, tokenizer: Any, context: Any, questions: Any, *, chat: Optional[bool],
                     question_separator: str, system_prompt: Optional[str] = None,
                     special: bool = False) -> tuple[list[str], list[int], list[list[int]]]:
    """``(questions, context_ids, question_ids)`` for a context and its questions,
    validated (ValueError names the problem) and checked against the model context.
    :func:`context_spans` tells where the document lies in ``context_ids``."""
    if not isinstance(context, str) or not context.strip():
        raise ValueError("context is empty")
    if isinstance(questions, str):
        questions = [questions]
    questions = list(questions)
    if not questions:
        raise ValueError("questions is empty")
    for i, q in enumerate(questions):
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"question {i} is empty or not text")
    chat = has_chat_template(tokenizer) if chat is None else chat
    prefix, rests = split_question_prompts(tokenizer, context, questions, chat=chat,
                                           question_separator=question_separator, system_prompt=system_prompt,
                                           special=special)
    check_length(model, len(prefix) + max(len(r) for r in rests))
    return questions, prefix, rests
