"""A document compressed once, saved, then asked many questions: what ``knorm-generate
--save-prompt-cache`` and ``--prompt-cache-file`` run, as ``mlx_lm.cache_prompt`` and
``mlx_lm.generate --prompt-cache-file`` do with a full cache.

:func:`save_document` prefills a document through fresh eviction caches, exactly as
:func:`~knorm_gen.answer_questions` prefills a context (the same ids, spans, probe and
blocks), and saves them with mlx_lm's ``save_prompt_cache``; the file's metadata holds
what is needed to check and continue them: the model, the settings, the document's
text, its ids and the question separator. :func:`answer_from` loads such a file, checks
that the question leaves the document's tokens as they were saved, pins the caches (the
question and answer are never evicted) and generates on mlx_lm's ``stream_generate``.
The file is only read, so one file answers any number of questions, each answer the one
``answer_questions(model, tokenizer, document, [question], ...)`` gives with the same
settings (under the question rule, for the questions the document was saved for)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from ..eviction.cache import copy_caches, make_eviction_cache, pin_caches, probe_caches
from ..eviction.config import EvictionConfig, GenerationConfig, ResolvedEviction, settings_dict
from ..eviction.legacy import current_settings
from ..eviction.memory import cache_stats
from ..eviction.spans import Spans, check_spans, evictable_count
from ..models.load import model_fingerprint
from ..models.support import check_model
from .engine import prefill, stream_ids
from .prompts import (
    as_tokenizer,
    check_length,
    context_spans,
    encode_text,
    has_chat_template,
    ids_before_marker,
    question_prompts,
    with_system_prompt,
)
from .results import GenerationResult

FORMAT = "knorm_gen.saved_document/1"
"""The metadata key ``format`` of a file :func:`save_document` writes."""

DOCUMENT_SETTINGS = ("chat", "question_separator", "system_prompt", "parse_special_tokens", "pin_prefix_chars",
                     "prefill_step_size")
"""The generation settings that shape a saved document's tokens or caches: a question is
asked with the file's (the other generation settings, such as ``max_tokens``, are the
question's own)."""

SUFFIX = ".safetensors"


class PromptCacheError(ValueError):
    """A saved document that cannot be saved or used as asked; the message names the fix."""


@dataclass
class SavedDocument:
    """A file :func:`save_document` wrote, read back: the caches and what the metadata says."""

    path: str
    caches: list
    document: str
    ids: list[int]
    spans: Spans
    questions: list[str]
    model: str
    adapter_path: Optional[str]
    chat_template_config: Optional[dict]
    eviction: EvictionConfig
    generation: dict
    """The :data:`DOCUMENT_SETTINGS` it was saved with, as given (``chat=None``: when the tokenizer has a template)."""
    settings: dict
    """The eviction settings resolved for the document, as a record's ``config`` reports them."""
    chat: bool
    """Whether the document went through the chat template."""
    model_fingerprint: Optional[str] = None
    """The saving model's content (:func:`~knorm_gen.models.load.model_fingerprint`); None in older files."""

    def generation_config(self, **fields_: Any) -> GenerationConfig:
        """A :class:`GenerationConfig` with this file's :data:`DOCUMENT_SETTINGS` and ``fields_``."""
        return GenerationConfig(**{**fields_, **self.generation})


@dataclass
class SaveReport:
    """What :func:`save_document` saved: the document's tokens (``prompt_tokens`` with the
    template), what a compressed layer keeps of them, the KV bytes and the file's size."""

    path: str
    prompt_tokens: int
    document_tokens: int
    tokens_kept: int
    compression_ratio: float
    kept_bytes: int
    full_bytes: int
    file_bytes: int
    prefill_s: float


def model_id(spec: Optional[str]) -> str:
    """A model spec as a saved document records it: a file or folder that exists as its
    absolute path (so ``./m`` and ``/work/m`` are one model), anything else as given."""
    spec = spec or "default"
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def chat_of(tokenizer: Any, generation: GenerationConfig) -> bool:
    """Whether prompts go through the chat template (``chat=None``: when the tokenizer has one)."""
    return has_chat_template(tokenizer) if generation.chat is None else bool(generation.chat)


def document_ids(tokenizer: Any, document: str, generation: GenerationConfig) -> list[int]:
    """The ids of the prompt up to the end of ``document`` (chat template, system turn and
    user-turn header included): the part a question asked after it shares, as
    :func:`~knorm_gen.generation.prompts.split_question_prompts` splits it."""
    if not isinstance(document, str) or not document.strip():
        raise ValueError("the document is empty")
    special = generation.parse_special_tokens
    if chat_of(tokenizer, generation):
        messages = with_system_prompt([{"role": "user", "content": document}], generation.system_prompt)
        return ids_before_marker(tokenizer, messages, len(messages) - 1, document, special)
    if generation.system_prompt is not None:
        raise ValueError("system_prompt needs the chat template; it cannot be used with chat=False")
    return encode_text(tokenizer, document, special=special)


def save_document(model: Any, tokenizer: Any, document: str, path: Union[str, Path], *,
                  eviction: EvictionConfig, generation: GenerationConfig, questions: Sequence[str] = (),
                  model_spec: str = "default", adapter_path: Optional[str] = None,
                  chat_template_config: Optional[dict] = None) -> SaveReport:
    """Compress ``document`` once through fresh caches of ``eviction`` and save them to
    ``path`` (a ``.safetensors`` file, written whole or not at all), as
    :func:`~knorm_gen.answer_questions` prefills a context: the same ids, the document's
    positions (the template around it pinned), a probe of ``questions`` under the
    question rule (without questions it reads the document's last paragraph), the same
    ``prefill_step_size`` blocks. ``model_spec``, ``adapter_path`` and
    ``chat_template_config`` are recorded so that a later run can check it loads the
    same model and template. ``PromptCacheError`` (a ``ValueError``) names a problem."""
    path = _save_path(path)
    if generation.long_documents != "error":
        raise PromptCacheError("long_documents truncate or chunk cut a prompt as it is read, and a saved document "
                               "is read whole: cut the document before saving it (long_documents error)")
    tok = as_tokenizer(tokenizer)
    chat = chat_of(tok, generation)
    question_ids: list = []
    if questions:
        questions, ids, question_ids = question_prompts(
            model, tok, document, list(questions), chat=chat, question_separator=generation.question_separator,
            system_prompt=generation.system_prompt, special=generation.parse_special_tokens)
    else:
        ids = document_ids(tok, document, generation)
        check_length(model, len(ids))
    spans = context_spans(tok, document, ids, chat=chat, system_prompt=generation.system_prompt,
                          special=generation.parse_special_tokens, pin_prefix_chars=generation.pin_prefix_chars)
    resolved = eviction.for_model(model)
    check_model(model, resolved)
    resolved = resolved.for_row(spans, len(ids))
    tic = time.perf_counter()
    caches = probe_caches(make_eviction_cache(model, resolved, spans), model, tok, ids, spans, question_ids)
    prefill(model, ids, caches, generation.prefill_step_size)
    prefill_s = time.perf_counter() - tic
    shaping = {k: getattr(generation, k) for k in DOCUMENT_SETTINGS}
    metadata = {
        "format": FORMAT, "model": model_id(model_spec), "adapter_path": model_id(adapter_path) if adapter_path else "",
        "chat_template_config": json.dumps(chat_template_config) if chat_template_config else "",
        "eviction": json.dumps(_eviction_fields(eviction)), "generation": json.dumps(shaping),
        "settings": json.dumps(resolved.to_dict()), "document": document,
        "document_sha256": hashlib.sha256(document.encode("utf-8")).hexdigest(),
        "ids": json.dumps(ids), "spans": json.dumps([list(s) for s in spans]), "questions": json.dumps(list(questions)),
        "chat": json.dumps(chat), "model_fingerprint": model_fingerprint(model),
    }
    _write(path, caches, metadata)
    stats = cache_stats(caches)
    return SaveReport(str(path), len(ids), evictable_count(spans, 0, len(ids)), stats.tokens_kept,
                      stats.compression_ratio, stats.kept_bytes, stats.full_bytes, path.stat().st_size, prefill_s)


def _save_path(path: Union[str, Path]) -> Path:
    path = Path(path).expanduser()
    if path.suffix != SUFFIX:
        raise PromptCacheError(f"{path} does not end in {SUFFIX}, the format the caches are saved in: name the file "
                               f"like doc{SUFFIX}")
    if not path.parent.is_dir():
        raise PromptCacheError(f"cannot save {path}: the folder {path.parent} does not exist")
    return path


def _write(path: Path, caches: list, metadata: dict) -> None:
    """``save_prompt_cache`` into a temporary file beside ``path``, then renamed over it."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{SUFFIX}")
    try:
        save_prompt_cache(str(tmp), caches, metadata)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        raise PromptCacheError(f"cannot save {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _eviction_fields(eviction: EvictionConfig) -> dict:
    """Every field of ``eviction`` as JSON values (tuples as lists, mappings with text keys)."""
    out = {}
    for f in fields(EvictionConfig):
        value = getattr(eviction, f.name)
        if isinstance(value, Mapping):
            value = {str(k): v for k, v in sorted(value.items())}
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _eviction_config(saved: dict) -> EvictionConfig:
    """:func:`_eviction_fields` read back."""
    values = {k: ({int(i): v for i, v in value.items()} if isinstance(value, dict) else value)
              for k, value in current_settings(saved).items() if k in EvictionConfig.__dataclass_fields__}
    return EvictionConfig(**values)


def read_document(path: Union[str, Path]) -> SavedDocument:
    """A file :func:`save_document` wrote: its caches and metadata. ``PromptCacheError``
    when it cannot be read or was not written by :func:`save_document`."""
    path = str(Path(path).expanduser())
    try:
        caches, meta = load_prompt_cache(path, return_metadata=True)
    except Exception as e:  # noqa: BLE001 - mlx and mlx_lm raise several kinds for a file they cannot read
        raise PromptCacheError(f"cannot read {path} as a saved prompt cache ({e}): save one with knorm-generate -p "
                               f"DOCUMENT --save-prompt-cache {path}") from None
    if meta.get("format") != FORMAT:
        raise PromptCacheError(f"{path} is a prompt cache knorm-generate did not save (it holds no document to ask "
                               f"about): save one with knorm-generate -p DOCUMENT --save-prompt-cache {path}")
    if hashlib.sha256(meta.get("document", "").encode("utf-8")).hexdigest() != meta.get("document_sha256"):
        raise PromptCacheError(f"{path}: its document does not match the digest saved with it (the file is damaged): "
                               "save the document again with knorm-generate --save-prompt-cache")
    try:
        return SavedDocument(
            path, caches, meta["document"], json.loads(meta["ids"]), check_spans(json.loads(meta["spans"])),
            json.loads(meta["questions"]), meta["model"], meta["adapter_path"] or None,
            json.loads(meta["chat_template_config"]) if meta["chat_template_config"] else None,
            _eviction_config(json.loads(meta["eviction"])), json.loads(meta["generation"]),
            json.loads(meta["settings"]), bool(json.loads(meta["chat"])), meta.get("model_fingerprint") or None)
    except (KeyError, ValueError, TypeError) as e:
        raise PromptCacheError(f"{path}: its metadata is damaged ({type(e).__name__}: {e}): save the document "
                               "again with knorm-generate --save-prompt-cache") from None


def eviction_differences(saved: SavedDocument, eviction: EvictionConfig) -> list[tuple[str, Any, Any]]:
    """``(setting, the file's, eviction's)`` for each eviction setting that differs (as
    records spell them: ``early_keep`` as the rule it runs)."""
    return _differences(saved.eviction.to_dict(), eviction.to_dict())


def generation_differences(saved: SavedDocument, given: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, the file's, given)`` for each of :data:`DOCUMENT_SETTINGS` in ``given``
    that differs from the file's (``chat``: from whether the document went through the chat
    template; None, the default, is the file's)."""
    mine = {**saved.generation, "chat": saved.chat}
    return [(k, mine[k], given[k]) for k in DOCUMENT_SETTINGS
            if k in given and given[k] != mine[k] and not (k == "chat" and given[k] is None)]


def _differences(mine: dict, theirs: dict) -> list[tuple[str, Any, Any]]:
    return [(k, mine.get(k), theirs.get(k)) for k in dict.fromkeys([*mine, *theirs]) if mine.get(k) != theirs.get(k)]


def check_same_model(saved: SavedDocument, model: Any) -> None:
    """Refuse ``model`` when its content is not the saving model's (other weights or config
    at the same path), naming both: caches of another model answer garbage."""
    if saved.model_fingerprint is None:
        return  # saved before files carried it: the layer and settings check below is all there is
    mine = model_fingerprint(model)
    if mine != saved.model_fingerprint:
        source = (getattr(model, "knorm_info", None) or {}).get("source", "the model given")
        raise PromptCacheError(f"{saved.path} was saved with another model: {saved.model} as it was then (content "
                               f"{saved.model_fingerprint}), and the model loaded now, {source}, has other weights or "
                               f"config (content {mine}); ask it with the model it was saved with, or save the "
                               "document again with this one")


def resolved_for(saved: SavedDocument, model: Any) -> ResolvedEviction:
    """The file's eviction settings resolved for ``model`` and its document, checked against
    what the file's caches were made with (``PromptCacheError``: another model's caches)."""
    check_same_model(saved, model)
    resolved = saved.eviction.for_model(model)
    resolved = resolved.for_row(saved.spans, len(saved.ids))
    if resolved.to_dict() != saved.settings or len(saved.caches) != resolved.n_layers:
        raise PromptCacheError(f"{saved.path} holds caches for another model (its layers and settings do not fit "
                               f"this one): ask it with the model it was saved with ({saved.model})")
    return resolved


def answer_from(model: Any, tokenizer: Any, saved: Union[str, Path, SavedDocument], question: str, *,
                generation: Optional[GenerationConfig] = None, **settings: Any) -> GenerationResult:
    """The answer to ``question`` asked after a saved document (:func:`stream_answer_from`):
    the :class:`GenerationResult` (its ``question`` set)."""
    *_, result = stream_answer_from(model, tokenizer, saved, question, generation=generation, **settings)
    return result


def stream_answer_from(model: Any, tokenizer: Any, saved: Union[str, Path, SavedDocument], question: str, *,
                       generation: Optional[GenerationConfig] = None, consume: bool = False,
                       **settings: Any) -> Iterator[Union[str, GenerationResult]]:
    """Ask ``question`` after a saved document (a path, or :func:`read_document`'s result,
    whose caches are then copied, so it can be asked again, unless ``consume``): the whole prompt is
    ``document + question_separator + question`` as :func:`~knorm_gen.answer_questions`
    builds it; the caches are pinned (the question and answer are never evicted) and
    mlx_lm's ``stream_generate`` continues them. Yields text pieces, then the result.
    ``generation`` (the fields it sets apart from the defaults) and keyword fields
    (``max_tokens=64``) set how the answer is generated; :data:`DOCUMENT_SETTINGS` are the
    file's, and a different one given is a ``PromptCacheError``, as is a question that
    changes how the document's last tokens tokenize. Under the question rule the document
    was compressed for the questions it was saved with: another question is answered
    from that compression."""
    owned = consume or not isinstance(saved, SavedDocument)
    saved = saved if isinstance(saved, SavedDocument) else read_document(saved)
    given = {**_set_fields(generation), **settings}
    differ = generation_differences(saved, given)
    if differ:
        raise PromptCacheError(f"{saved.path} was saved with other settings ({describe_differences(differ)}): leave them out "
                               f"(the file's are used), or save the document again with them")
    generation = saved.generation_config(**{k: v for k, v in given.items() if k not in DOCUMENT_SETTINGS})
    if generation.long_documents != "error":
        raise PromptCacheError("long_documents truncate or chunk cut a prompt as it is read, and a saved document is "
                               "read already: leave it out (a question too long for the model's context is refused)")
    tok = as_tokenizer(tokenizer)
    resolved = resolved_for(saved, model)
    rest = question_ids(model, tok, saved, question)
    caches = pin_caches(saved.caches if owned else copy_caches(saved.caches))
    if generation.seed is not None:
        mx.random.seed(generation.seed)
    mx.reset_peak_memory()
    for item in stream_ids(model, tok, rest, caches, generation=generation,
                            config=settings_dict(resolved, generation), prompt_tokens=len(saved.ids) + len(rest)):
        if isinstance(item, GenerationResult):
            item.question = question
        yield item


def _set_fields(generation: Optional[GenerationConfig]) -> dict:
    """The fields of ``generation`` that differ from the defaults (the ones a caller set)."""
    if generation is None:
        return {}
    return {f.name: getattr(generation, f.name) for f in fields(GenerationConfig)
            if getattr(generation, f.name) != f.default}


def question_ids(model: Any, tokenizer: Any, saved: SavedDocument, question: str) -> list[int]:
    """The ids fed after the saved document for ``question`` (separator, question, the
    template's end), checked: the whole prompt must start with the saved ids and fit the
    model's context."""
    gen = saved.generation
    _, shared, (rest,) = question_prompts(model, tokenizer, saved.document, [question], chat=saved.chat,
                                          question_separator=gen["question_separator"],
                                          system_prompt=gen["system_prompt"], special=gen["parse_special_tokens"])
    if shared == saved.ids:
        return rest
    n = min(len(shared), len(saved.ids))
    if shared[:n] != saved.ids[:n]:  # not the question: the document itself reads otherwise
        raise PromptCacheError(
            f"the tokenizer or chat template reads the document otherwise than when {saved.path} was saved: ask it "
            f"with the model ({saved.model}) and chat template config it was saved with, or save it again")
    raise PromptCacheError(
        f"this question changes how the document's last tokens tokenize (its first characters join them), so "
        f"{saved.path} does not hold the document as this prompt reads it: start the question with a space or a "
        f"new line, or save the document again with --question and this question")


def describe_differences(differ: Sequence[tuple[str, Any, Any]]) -> str:
    """``budget: 128 in the file, 64 here; ...`` for :func:`eviction_differences` and
    :func:`generation_differences`."""
    return "; ".join(f"{k}: {_shown(a)} in the file, {_shown(b)} here" for k, a, b in differ)


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) or value is None else str(value)


__all__ = ["FORMAT", "DOCUMENT_SETTINGS", "PromptCacheError", "SavedDocument", "SaveReport", "answer_from",
           "describe_differences", "document_ids", "eviction_differences", "generation_differences", "model_id", "question_ids",
           "read_document", "resolved_for", "save_document", "stream_answer_from"]
