"""Files a run reads and writes: streams vs regular files, distinct roles,
writability checks, locks and atomic rewrites."""

from __future__ import annotations

import fcntl
import os
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Optional, Sequence, Union


class FileUsageError(ValueError):
    """A file problem found before any work starts."""


def default_output(input_path: str) -> str:
    """``<input stem>.completions.jsonl`` beside a regular input file, ``<folder
    name>.completions.jsonl`` beside a folder; stdout otherwise (stdin, a pipe such as
    ``<(cat a.jsonl)``, a device, the root folder)."""
    if input_path == "-" or _special_path(input_path):
        return "-"
    p = Path(input_path)
    try:
        mode = p.stat().st_mode
    except OSError:
        mode = stat.S_IFREG
    if stat.S_ISDIR(mode):
        p = Path(os.path.abspath(input_path)) if p.name in ("", ".", "..") else p
        return str(p.with_name(p.name + ".completions.jsonl")) if p.name else "-"
    if not stat.S_ISREG(mode):
        return "-"
    return str(p.with_name(p.stem + ".completions.jsonl"))


def _special_path(path: str) -> bool:
    # /dev/stdin, /dev/fd/63 (a shell's <(...)), /proc/self/fd/0: a stream even when
    # it resolves to a regular file, and never a place to create files beside.
    return os.path.abspath(path).startswith(("/dev/", "/proc/"))


def is_stream(path: str) -> bool:
    """``-`` or an existing file that is not a regular file (a pipe, a terminal, /dev/stdout)."""
    if path == "-" or _special_path(path):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def open_input(path: str) -> BinaryIO:
    """The input as a seekable binary stream. Stdin and pipes are spooled to a
    temporary file first, because the runner reads the rows twice (once to plan
    the resume, once to run). Unreadable input is a usage error."""
    if path == "-":
        source = sys.stdin.buffer
    else:
        p = Path(path)
        if p.is_dir():
            raise FileUsageError(f"input {path} is a directory, not a JSONL file")
        try:
            source = open(p, "rb")
        except OSError as e:
            raise FileUsageError(f"cannot read input {path}: {e.strerror or e}") from None
        if source.seekable() and stat.S_ISREG(os.fstat(source.fileno()).st_mode):
            return source
    spool = tempfile.TemporaryFile(prefix="knorm-batch-input-")
    try:
        while chunk := source.read(1 << 20):
            spool.write(chunk)
    except OSError as e:
        spool.close()
        raise FileUsageError(f"cannot read input {path}: {e.strerror or e}") from None
    finally:
        if source is not sys.stdin.buffer:
            source.close()
    spool.seek(0)
    return spool


def check_distinct_files(named: Sequence[tuple[str, Optional[str]]]) -> None:
    """Refuse two roles on one file (the same path, a link, or the same inode),
    which would read a file while truncating it, or write it twice."""
    def identity(path: str):
        try:
            st = os.stat(path)
        except OSError:
            return ("path", os.path.realpath(path))
        if not stat.S_ISREG(st.st_mode):
            return None  # pipes and devices: reading one and writing another is fine
        return ("inode", st.st_dev, st.st_ino)

    seen: dict = {}
    for role, path in named:
        if path is None or path == "-":
            continue
        ident = identity(path)
        if ident is None:
            continue
        if ident in seen:
            other_role, other_path = seen[ident]
            raise FileUsageError(f"the {role} {path} is the same file as the {other_role} {other_path}; "
                                  f"give each its own file")
        seen[ident] = (role, path)


def check_writable(path: Optional[str], what: str) -> None:
    """Refuse a path that cannot be written, without creating anything."""
    if path is None or is_stream(path):
        return
    p = Path(path)
    if p.is_dir():
        raise FileUsageError(f"{what} {path} is a directory")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise FileUsageError(f"cannot write {what} {path}: permission denied")
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise FileUsageError(f"cannot write {what} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FileUsageError(f"cannot write {what} {path}: permission denied in {parent}")


class LockHeld(RuntimeError):
    """Another process holds the lock on a file this run would write."""


class FileLock:
    """An exclusive, advisory lock on a file a run writes, held for the whole run.

    The lock lives on a sidecar ``.NAME.lock`` holding the owner's pid, because
    the file itself may be replaced by an atomic rewrite (a lock on the old
    inode would then guard nothing). The sidecar sits beside the file a
    symlink points to, so every name of a file shares one lock; the file
    itself (its inode) is locked too, which catches a hard link's other name
    (:meth:`lock_file`). ``flock`` is dropped by the kernel when the owner
    dies, even by ``kill -9``, so a crash never leaves a stale lock.
    """

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        target = Path(os.path.realpath(self.path))
        self.lock_path = target.with_name(f".{target.name}.lock")
        self._fd: Optional[int] = None
        self._file_fds: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> a locked fd on it

    def acquire(self) -> "FileLock":
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                # No sidecar possible (a read-only folder): lock the file itself,
                # which then cannot be replaced by a rewrite either.
                self.lock_path = self.path
                fd = os.open(self.path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise LockHeld(f"{self.path} is being written by another knorm-batch run{holder}; "
                               "wait for it to finish, or write to another --output") from None
            # The previous holder may have unlinked the sidecar after we opened it.
            try:
                current = os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
            os.close(fd)
        if self.lock_path != self.path:
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            except OSError:
                pass  # a full disk: the lock holds all the same, only its message lacks the pid
        self._fd = fd
        try:
            self.lock_file()
        except LockHeld:
            self.release()
            raise
        return self

    def lock_file(self) -> None:
        """Lock the file the path names now (when it is a regular file), once per inode:
        a run on another name of it (a hard link) finds it held. Call again once the
        file exists or was replaced by a rewrite."""
        if self.lock_path == self.path:
            return  # the file itself is the lock already
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return  # not there yet: the sidecar guards it
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if not stat.S_ISREG(st.st_mode) or ident in self._file_fds:
            os.close(fd)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(f"{self.path} is being written by another knorm-batch run under another name of "
                           "the same file (a hard link); wait for it to finish, or write to another "
                           "--output") from None
        self._file_fds[ident] = fd

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            pid = os.pread(fd, 32, 0).decode().strip()
        except (OSError, UnicodeDecodeError):
            return ""
        return f" (pid {pid})" if pid.isdigit() else ""

    def release(self) -> None:
        for fd in self._file_fds.values():
            os.close(fd)
        self._file_fds.clear()
        if self._fd is None:
            return
        if self.lock_path != self.path:
            try:
                os.unlink(self.lock_path)  # while still holding it: see acquire()
            except OSError:
                pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def replacing(path: Union[str, Path], *, sync_folder: bool = True) -> Iterator[Path]:
    """Write ``path`` whole or not at all: the block writes (and fsyncs) the
    temporary path yielded, ``.NAME.PID.tmp`` beside ``path``, which then replaces
    ``path`` by a rename (and the folder is fsynced, unless ``sync_folder`` is
    False). A symlink keeps pointing where it did: its target is replaced. A
    failure leaves ``path`` as it was and no temp file behind; a kill leaves one
    that :func:`remove_stale_temps` removes."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync_folder:
        fsync_folder(path.parent)


def fsync_folder(folder: Union[str, Path], *, quiet: bool = False) -> None:
    """fsync a folder, so that a rename in it survives a power cut. ``quiet``:
    ignore a failure (some file systems cannot sync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        if quiet:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not quiet:
            raise
    finally:
        os.close(fd)


def rewrite_atomically(path: Union[str, Path], lines: list[bytes]) -> None:
    """Replace ``path`` with ``lines`` (see :func:`replacing`)."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def remove_stale_temps(path: Union[str, Path]) -> list[Path]:
    """Remove the ``.NAME.PID.tmp`` files that :func:`replacing` left beside
    ``path`` (or beside its symlink's target) when process PID died mid-write.
    Those of a live process other than this one are kept. Call it before this
    process rewrites ``path``, holding its lock where it has one."""
    removed = []
    for p in dict.fromkeys([Path(path), Path(os.path.realpath(path))]):
        prefix = f".{p.name}."
        try:
            names = os.listdir(p.parent)
        except OSError:
            continue
        for name in names:
            pid = name[len(prefix):-len(".tmp")]
            if not (name.startswith(prefix) and name.endswith(".tmp") and pid.isdigit()) or _alive(int(pid)):
                continue
            try:
                os.unlink(p.parent / name)
                removed.append(p.parent / name)
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier process with this pid: this one has written none yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True
