"""One ``knorm-batch`` job across processes and machines, on MLX's own launcher.

``mlx.launch`` starts one process per slot; each calls :func:`group` and gets
its rank and the group size (1 without the launcher: nothing changes). Rank r
takes the input rows whose index modulo the group size is r, and writes them
to its own part file beside the output (``out.part-r-of-n.jsonl``) with the
single-process rules (whole, fsynced records; resume; torn lines cut). No
shared filesystem is assumed: the records every rank finished before are
exchanged through ``mx.distributed`` collectives when the job starts, and the
new ones when it ends, when rank 0 writes the final output in input order.

A collective has no timeout, so each one runs with the default SIGINT/SIGTERM
actions: if another rank dies, ``mlx.launch`` terminates the waiting ones at
once instead of leaving them blocked. Every finished record is already on
disk in a part file by then; rerunning the launch resumes.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from . import records as rec
from .rows import Row

_PART = re.compile(r"^(?P<stem>.+)\.part-(?P<rank>\d+)-of-(?P<size>\d+)(?P<suffix>\.[^.]*)?$")


class PeerLost(Exception):
    """A collective failed because another rank of the launch died (killed, or
    its machine gone): ``phase`` names the exchange, ``detail`` MLX's words."""

    def __init__(self, rank: int, phase: str, detail: str):
        super().__init__(f"rank {rank}: a peer rank died during {phase} ({detail})")
        self.rank, self.phase, self.detail = rank, phase, detail


_PHASES = {"_prepare": "the start", "_plan_group": "the resume exchange", "_finish_group": "the merge"}


def _phase() -> str:
    """Which exchange of a job the current collective belongs to (from its caller in job.py)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _PHASES:
            return _PHASES[frame.f_code.co_name]
        frame = frame.f_back
    return "a collective"


@dataclass(frozen=True)
class Group:
    """This process's place in the job: ``rank`` of ``size`` (1 without a launcher)."""

    rank: int = 0
    size: int = 1
    handle: Any = None

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank. :class:`PeerLost`
        when another rank died."""
        try:
            return self._gather_bytes(data)
        except RuntimeError as e:  # MLX: "[ring] connection to a peer was lost"
            raise PeerLost(self.rank, _phase(), " ".join(str(e).split())[:200]) from None

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        import mlx.core as mx

        with _default_signals():
            lengths = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int64), group=self.handle)
            mx.eval(lengths)
            sizes = [int(x) for x in np.array(lengths)]
            width = max(max(sizes), 1)
            buf = np.zeros(width, dtype=np.uint8)
            buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            gathered = mx.distributed.all_gather(mx.array(buf), group=self.handle)
            mx.eval(gathered)
        flat = np.array(gathered)
        return [flat[i * width : i * width + n].tobytes() for i, n in enumerate(sizes)]

    def gather_json(self, value: Any) -> list[Any]:
        """Every rank's JSON-serialisable ``value``, in rank order, on every rank."""
        return [json.loads(b.decode("utf-8")) for b in self.gather_bytes(json.dumps(value).encode("utf-8"))]

    def barrier(self) -> None:
        self.gather_bytes(b"")


def group() -> Group:
    """The launch group of this process (``mx.distributed.init()``)."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        return Group()
    handle = mx.distributed.init()
    return Group(handle.rank(), handle.size(), handle) if handle.size() > 1 else Group()


@contextmanager
def _default_signals() -> Iterator[None]:
    """Default SIGINT/SIGTERM actions while blocked in a collective (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def part_path(path: str, rank: int, size: int) -> str:
    """``out.jsonl`` -> ``out.part-0-of-2.jsonl``: the file rank ``rank`` of ``size`` writes."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.part-{rank}-of-{size}{p.suffix}"))


def local_parts(path: str) -> list[Path]:
    """The part files of ``path`` (any group size) on this machine, sorted."""
    p = Path(path)
    if not p.parent.is_dir():
        return []
    found = []
    for candidate in p.parent.iterdir():
        m = _PART.match(candidate.name)
        if m and m["stem"] == p.stem and (m["suffix"] or "") == p.suffix:
            found.append(candidate)
    return sorted(found)


def shard_of(index: int, size: int) -> int:
    """The rank that runs the input row with this 0-based index (non-blank lines)."""
    return index % size


def merge_records(items: Iterator[Any], earlier: list[bytes], blobs: list[bytes], expected: dict,
                  accept_old: bool) -> list[bytes]:
    """The final output: one line per input row, in input order. A row's
    successful record comes from the earlier records or any part (one whose
    fingerprint matches the input wins); else its error record from a part."""
    good: dict[str, bytes] = {}
    errors: dict[int, bytes] = {}
    for line in [*earlier, *(x + b"\n" for blob in blobs for x in blob.splitlines() if x.strip())]:
        record = rec.parse_record(line.rstrip(b"\n"))
        if record is None:
            continue  # a torn tail of a part this run did not own
        if record["error"] is None and record["id"] is not None:
            key = rec.id_key(record["id"])
            fits = record.get("fingerprint") == expected.get(key) or accept_old
            if key not in good or fits:
                good[key] = line
        elif isinstance(record["error"], dict) and isinstance(record["error"].get("line"), int):
            errors[record["error"]["line"]] = line
    out = []
    for item in items:
        key = item.key if isinstance(item, Row) else None
        if key is not None and key in good:
            out.append(good[key])
        elif item.line in errors:
            out.append(errors[item.line])
    return out


def merge_stats(earlier: bytes, blobs: list[bytes]) -> list[bytes]:
    """The combined stats log: earlier entries, then new ones (each once) in input-line order."""
    seen = set(earlier.splitlines())
    fresh = []
    for blob in blobs:
        for line in blob.splitlines():
            if line.strip() and line not in seen:
                seen.add(line)
                try:
                    fresh.append((int(json.loads(line).get("line") or 0), line))
                except (ValueError, AttributeError):
                    continue
    fresh.sort(key=lambda item: item[0])
    return [earlier] + [line + b"\n" for _, line in fresh]
