"""The row loop: input items in, one record out per row, handed over as each row finishes.

One row at a time (``batch_size=1``: each row through the single-row API, on
mlx_lm's ``stream_generate``, records in input order) or several decoded
together through the one scheduler (:func:`knorm_gen.generation.engine.run_jobs`: prompt
rows and question rows in the same continuous batch, records in finishing
order). Every record is built here, whole, with its fingerprint;
:mod:`knorm_gen.batch.job` decides which rows run and where the records go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from ..eviction.config import (
    EvictionConfig,
    GenerationConfig,
    ResolvedEviction,
    RowsConfig,
    make_configs,
    settings_dict,
)
from ..eviction.legacy import older_spelling
from ..eviction.quant import check_head_dims
from ..generation.admission import KVLimit, KVMemoryExceeded
from ..generation.engine import Outcome, Request, run_alone, run_jobs
from ..generation.generate import answer_in_pieces, prompt_request, question_request
from ..generation.long_documents import needs_pieces
from ..generation.prompts import PromptTooLongError
from ..models.support import model_support
from ..platform.mlx_compat import kv_head_dims
from . import records as rec
from .rows import Row, RowError

Emit = Callable[[Optional[dict], int], None]  # (record, or None for a row skipped as done; its line)


@dataclass(frozen=True)
class RowSettings:
    """A row's effective settings, resolved once: the run's, with its per-row overrides."""

    eviction: ResolvedEviction
    generation: GenerationConfig
    config: dict  # what its record reports (and its fingerprint covers)


class RowRunner:
    """Runs rows into records for one run: the model's layer kinds are found once,
    each distinct set of per-row overrides is resolved once, and each row's
    fingerprint is computed once (by :meth:`fingerprint`, which the resume scan
    calls first)."""

    def __init__(self, model: Any, tokenizer: Any, *, model_spec: str, eviction: EvictionConfig,
                 generation: GenerationConfig, batch_size: int, rows: Optional[RowsConfig] = None,
                 kv_limit_bytes: Optional[int] = None):
        self.model, self.tokenizer, self.model_spec = model, tokenizer, model_spec
        self.eviction, self.generation, self.batch_size = eviction, generation, batch_size
        self.rows = rows or RowsConfig()
        self.kv = KVLimit(model, kv_limit_bytes) if kv_limit_bytes is not None else None
        self.support = model_support(model)
        self.full_layers = self.support.full_layers
        self._settings: dict = {}
        self._head_dims: Optional[list[int]] = None  # read once, when a row first asks for kv_bits
        self._fingerprints: dict[tuple[str, str], Optional[str]] = {}
        self.base = self.settings_for({})  # ValueError: the run's own settings do not fit the model

    # ---- settings and fingerprints ------------------------------------------------
    def settings_for(self, overrides: dict) -> RowSettings:
        """The settings of a row with these overrides (ValueError names a bad one)."""
        key = tuple(sorted(overrides.items()))
        if key not in self._settings:
            eviction, generation = make_configs(self.eviction, self.generation, **overrides)
            resolved = eviction.resolved(self.support.n_layers, self.full_layers)
            self.support.check(resolved)
            if resolved.kv_bits:
                if self._head_dims is None:
                    self._head_dims = kv_head_dims(self.model)
                check_head_dims(self._head_dims, resolved.kv_group_size)
            self._settings[key] = RowSettings(resolved, generation, settings_dict(resolved, generation, self.rows))
        return self._settings[key]

    def fingerprint(self, row: Row) -> Optional[str]:
        """The fingerprint a record of this row carries (None: its settings are invalid)."""
        key = (row.key, row.digest)  # a folder's file edited between the resume scan and its run: its new content
        if key not in self._fingerprints:
            try:
                config = self.settings_for(row.overrides).config
            except ValueError:
                self._fingerprints[key] = None
            else:
                self._fingerprints[key] = rec.fingerprint(row.digest, config, self.model_spec)
        return self._fingerprints[key]

    def legacy_fingerprint(self, row: Row) -> Optional[str]:
        """The fingerprint a record of this row carried when these settings had an older
        spelling (:func:`~knorm_gen.eviction.legacy.older_spelling`), or None."""
        if self.fingerprint(row) is None:
            return None
        old = older_spelling(self.settings_for(row.overrides).config)
        return None if old is None else rec.fingerprint(row.digest, old, self.model_spec)

    # ---- records ----------------------------------------------------------------------
    def _record(self, row_id: Any, config: dict, meta: Optional[dict]) -> dict:
        return rec.empty_record(row_id, self.model_spec, config, meta)

    def error_record(self, err: RowError) -> dict:
        """The record of a line that could not become a row."""
        record = self._record(err.id, self.base.config, err.meta)
        record["error"] = err.to_dict()
        return record

    def failure_record(self, row: Row, settings: Optional[RowSettings], e: BaseException) -> dict:
        """The record of a row whose settings, prompt or generation failed."""
        record = self._record(row.id, settings.config if settings else self.base.config, row.meta)
        if settings is not None:
            record["fingerprint"] = self.fingerprint(row)
        if isinstance(e, ValueError):
            kind = (rec.PROMPT_TOO_LONG if isinstance(e, PromptTooLongError) else
                    rec.KV_MEMORY_EXCEEDED if isinstance(e, KVMemoryExceeded) else rec.INVALID_ROW)
            return rec.failed(record, kind, str(e), row.line, row.where)
        return rec.failed(record, rec.GENERATION_ERROR, f"{type(e).__name__}: {e}", row.line, row.where)

    def result_record(self, row: Row, settings: RowSettings, results: list) -> dict:
        """The record of a row from its results (one per prompt, one per question)."""
        record = self._record(row.id, settings.config, row.meta)
        record["fingerprint"] = self.fingerprint(row)
        numbers = rec.question_numbers(results) if row.kind == "questions" else rec.completion_numbers(results[0])
        record.update(numbers)
        record["long_document"] = results[0].long_document
        return rec.finite(record)

    # ---- the loop ----------------------------------------------------------------------
    def run(self, items: Iterable[Union[Row, RowError]], done: set, emit: Emit, *,
            stop_reading: Callable[[], bool], stop_now: Callable[[], bool]) -> None:
        """Every item into ``emit`` as it finishes; rows whose id is in ``done`` are
        skipped. ``stop_reading()`` (a first Ctrl-C) takes no further row but
        finishes those in flight; ``stop_now()`` (the output is gone) ends at once."""
        if self.batch_size == 1:
            self._run_alone(items, done, emit, stop_reading)
            return
        requests = self._requests(items, done, emit, lambda: stop_reading() or stop_now())
        for request, outcome in run_jobs(self.model, self.tokenizer, requests, batch_size=self.batch_size,
                                         seed=self.generation.seed, alone=self._alone, kv_limit=self.kv):
            row, settings = request.tag
            emit(self._outcome_record(row, settings, outcome), row.line)
            if stop_now():
                return

    def _outcome_record(self, row: Row, settings: RowSettings, outcome: Outcome) -> dict:
        if isinstance(outcome, Exception):
            return self.failure_record(row, settings, outcome)
        return self.result_record(row, settings, outcome)

    def _to_run(self, items, done: set, emit: Emit, stop: Callable[[], bool]) -> Iterator[Row]:
        """The rows that need running; a row already done and a line that is no row
        are handed to ``emit`` at once. After each item, ``stop()`` ends the rest."""
        for item in items:
            if isinstance(item, Row) and item.key in done:
                emit(None, item.line)
            elif isinstance(item, RowError):
                emit(self.error_record(item), item.line)
            else:
                yield item
            if stop():
                return

    def _run_alone(self, items, done: set, emit: Emit, stop: Callable[[], bool]) -> None:
        """One row at a time: each record is handed over before the next row starts."""
        for row in self._to_run(items, done, emit, stop):
            emit(self.run_row(row), row.line)

    def run_row(self, row: Row) -> dict:
        """Generate for one row alone; any failure becomes the record's error."""
        settings = None
        try:
            settings = self.settings_for(row.overrides)
            if self._in_pieces(row, settings):
                return self.result_record(row, settings, self._pieces(row, settings))
            request = self._request(row, settings)  # encoded once: the memory check and the generation share it
            if self.kv is not None:
                self.kv.check_alone(request)
            return self.result_record(row, settings, self._alone(request))
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - one bad row must not stop an overnight run
            return self.failure_record(row, settings, e)

    def _alone(self, request: Request) -> list:
        """A request's results with nothing else in flight: a prompt on mlx_lm's stream_generate
        (as generate_with_eviction runs it), a context's questions as answer_questions does
        (on a model whose rows cannot decode together, one after another)."""
        if request.ids is None and model_support(self.model).batching is None:
            ((_, results),) = run_jobs(self.model, self.tokenizer, [request], batch_size=self.batch_size,
                                       seed=request.generation.seed)
            return results
        return run_alone(self.model, self.tokenizer, request)

    def _requests(self, items, done: set, emit: Emit, stop: Callable[[], bool]) -> Iterator[Request]:
        """The rows that can run, as requests; the others become records at once, so
        they never enter (or disturb) a batch. ``stop()`` is asked before each item."""
        if stop():
            return
        for row in self._to_run(items, done, emit, stop):
            settings = None
            try:
                settings = self.settings_for(row.overrides)
                if self._in_pieces(row, settings):  # read in pieces now: its own small batches, then its record
                    emit(self.result_record(row, settings, self._pieces(row, settings)), row.line)
                    continue
                request = self._request(row, settings)
            except Exception as e:  # noqa: BLE001 - a bad row never enters a batch
                emit(self.failure_record(row, settings, e), row.line)
            else:
                yield request

    def _in_pieces(self, row: Row, settings: RowSettings) -> bool:
        return row.kind == "questions" and needs_pieces(self.model, self.tokenizer, row.context, row.questions,
                                                        settings.generation)

    def _pieces(self, row: Row, settings: RowSettings) -> list:
        return answer_in_pieces(self.model, self.tokenizer, row.context, row.questions, settings.eviction,
                                settings.generation, self.batch_size, settings.generation.seed)

    def _request(self, row: Row, settings: RowSettings) -> Request:
        if row.kind == "questions":
            return question_request(self.model, self.tokenizer, row.line, row.context, row.questions,
                                    settings.eviction, settings.generation, tag=(row, settings))
        return prompt_request(self.model, self.tokenizer, row.line, row.prompt, settings.eviction,
                              settings.generation, tag=(row, settings))
