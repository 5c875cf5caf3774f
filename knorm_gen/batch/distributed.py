"""One ``knorm-batch`` job across processes and machines, on MLX's own launcher.

``mlx.launch`` starts one process per slot; each calls :func:`group` and gets
its rank and the group size (1 without the launcher: nothing changes). Rank r
takes the input rows whose index modulo the group size is r, and writes them
to its own part file beside the output (``out.part-r-of-n.jsonl``) with the
single-process rules (whole, fsynced records; resume; torn lines cut). No
shared filesystem is assumed: the records every rank finished before are
exchanged through ``mx.distributed`` collectives when the job starts, and the
new ones when it ends, when rank 0 writes the final output in input order
(:mod:`knorm_gen.batch.resume` does both).

A collective has no timeout, so each one runs with the default SIGINT/SIGTERM
actions: if another rank dies, ``mlx.launch`` terminates the waiting ones at
once instead of leaving them blocked. Every finished record is already on
disk in a part file by then; rerunning the launch resumes.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, TypeVar

import numpy as np

_PART = re.compile(r"^(?P<stem>.+)\.part-(?P<rank>\d+)-of-(?P<size>\d+)(?P<suffix>\.[^.]*)?$")


class PeerLost(Exception):
    """A collective failed because another rank of the launch died (killed, or
    its machine gone): ``phase`` names the exchange, ``detail`` MLX's words."""

    def __init__(self, rank: int, phase: str, detail: str):
        super().__init__(f"rank {rank}: a peer rank died during {phase} ({detail})")
        self.rank, self.phase, self.detail = rank, phase, detail


@dataclass
class Group:
    """This process's place in the job: ``rank`` of ``size`` (1 without a launcher).
    ``phase`` names the exchange the collectives belong to now (:meth:`during`), for
    the message of a lost peer."""

    rank: int = 0
    size: int = 1
    handle: Any = None
    phase: str = "a collective"

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @contextmanager
    def during(self, phase: str) -> Iterator["Group"]:
        """The collectives inside belong to ``phase`` (``the start``, ``the merge``, ...)."""
        before, self.phase = self.phase, phase
        try:
            yield self
        finally:
            self.phase = before

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank. :class:`PeerLost`
        when another rank died."""
        try:
            return self._gather_bytes(data)
        except RuntimeError as e:  # MLX: "[ring] connection to a peer was lost"
            raise PeerLost(self.rank, self.phase, " ".join(str(e).split())[:200]) from None

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
    """The rank that runs the input item with this 0-based index (non-blank lines)."""
    return index % size


Item = TypeVar("Item")


def share(items: Iterable[Item], limit: Optional[int] = None, rank: int = 0, size: int = 1) -> Iterator[Item]:
    """The items up to ``limit`` (read no further), and of those only the share of
    process ``rank`` of ``size`` (:func:`shard_of`)."""
    for n, item in enumerate(items):
        if limit is not None and n >= limit:
            return
        if shard_of(n, size) == rank:
            yield item
