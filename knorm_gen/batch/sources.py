"""Where a run's rows come from: a JSONL file or stream, or a folder of text files.

Both are an :class:`InputSource`. :meth:`~InputSource.items` reads the input from
its start on every call (the job reads it to plan the resume, to run, and in a
run across processes to merge) and yields one :class:`~knorm_gen.batch.rows.Row` or
:class:`~knorm_gen.batch.rows.RowError` per item, in input order, numbered from 1 in
``line``: a JSONL file's line number, a folder file's place in the sorted list.

A folder (:class:`FolderSource`) gives one row per file whose name matches one of
its globs, at any depth, sorted by relative path: ``{"id": "<path under the
folder>", "<context field>": "<text>"}``, so its record and fingerprint are those
of the same row given as JSONL. Hidden files and folders (``.name``) and the run's
own files are left out. A file that cannot be a row (not UTF-8, empty, too large,
unreadable, gone, a PDF without text) is a :class:`RowError` whose message starts
with its path.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import stat
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import BinaryIO, Iterator, Optional, Sequence, Union

from ..eviction.config import RowsConfig
from ..platform.files import FileUsageError, open_input
from . import records as rec
from .distributed import local_parts
from .records import FILE_TOO_LARGE, INVALID_ROW, INVALID_UTF8, UNREADABLE_FILE
from .rows import MAX_LINE_BYTES, Row, RowError, content_digest, parse_row, read_rows

DEFAULT_GLOBS = ("*.txt", "*.md", "*.rst")
"""The files of a folder INPUT read without ``--glob``."""

PDF_EXTRA = 'pip install -e ".[pdf]" in the knorm_gen checkout (or pip install pypdf)'

Item = Union[Row, RowError]


class InputSource:
    """The rows of one input. ``rerun_edited``: a row whose content changed since its
    record was written runs again on resume (a folder's edited file) instead of being
    refused (a JSONL row). ``lines``: an item's number is a line of the input, worth
    naming in messages (a folder's file is named by its path instead)."""

    rerun_edited = False
    lines = True

    def items(self) -> Iterator[Item]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlSource(InputSource):
    """JSONL rows from a seekable binary stream (:func:`~knorm_gen.platform.files.open_input`)."""

    def __init__(self, stream: BinaryIO, shape: RowsConfig):
        self.stream, self.shape = stream, shape

    def items(self) -> Iterator[Item]:
        self.stream.seek(0)
        yield from read_rows(self.stream, shape=self.shape)

    def close(self) -> None:
        self.stream.close()


@dataclass(frozen=True)
class Listed:
    """A file of a folder input: its path under the folder, with ``/``; ``problem``:
    ``(error type, message)`` when it cannot be read at all (an unlistable subfolder,
    a name that is not UTF-8)."""

    rel: str
    problem: Optional[tuple[str, str]] = None


class Unusable(Exception):
    """A file that cannot be a row: ``kind`` is its record's error type."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class FolderSource(InputSource):
    """One row per listed file of ``root`` (listed once, read on every :meth:`items`)."""

    rerun_edited = True
    lines = False

    def __init__(self, root: Path, files: Sequence[Listed], shape: RowsConfig, max_bytes: int = MAX_LINE_BYTES):
        self.root, self.files, self.shape, self.max_bytes = root, list(files), shape, max_bytes

    def items(self) -> Iterator[Item]:
        for number, listed in enumerate(self.files, 1):
            yield self.item(number, listed)

    def item(self, number: int, listed: Listed) -> Item:
        """The row of one file, or the error that says why it is none."""
        rel = listed.rel
        try:
            if listed.problem:
                raise Unusable(*listed.problem)
            text = file_text(self.root / rel, self.max_bytes)
        except Unusable as e:
            return RowError(number, e.kind, f"{rel}: {e}", id=rel)
        obj = {"id": rel, self.shape.context_field: text}
        row = parse_row(obj, number, self.shape, where=rel)
        if isinstance(row, Row):
            row.digest, row.path = content_digest(obj), rel
        return row


# ------------------------------------------------------------------ reading one file


def file_text(path: Path, max_bytes: int) -> str:
    """A file's text: UTF-8 (a BOM dropped, CRLF and CR line ends read as LF), or a
    PDF's extracted text. :class:`Unusable` says why there is none."""
    data = _read_bytes(path, max_bytes)
    if is_pdf(path.name):
        text = pdf_text(data)
        if not text.strip():
            raise Unusable(INVALID_ROW, "the PDF holds no text layer (a scanned PDF needs OCR first, e.g. with "
                                        "ocrmypdf)")
        return text
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise Unusable(INVALID_UTF8, f"not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    if not text.strip():
        raise Unusable(INVALID_ROW, "the file is empty" if not text else "the file holds only whitespace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _read_bytes(path: Path, max_bytes: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO that matches a glob must not block the run
    except FileNotFoundError:
        gone = ("it is a link to a missing file" if os.path.lexists(path) else
                "the file is gone (deleted or moved since the folder was listed)")
        raise Unusable(UNREADABLE_FILE, gone) from None
    except OSError as e:
        raise Unusable(UNREADABLE_FILE, f"cannot read the file: {e.strerror or e}") from None
    with open(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Unusable(UNREADABLE_FILE, "not a regular file")
            data = f.read(max_bytes + 1) if st.st_size <= max_bytes else b""
        except OSError as e:
            raise Unusable(UNREADABLE_FILE, f"cannot read the file: {e.strerror or e}") from None
    if st.st_size > max_bytes or len(data) > max_bytes:
        raise Unusable(FILE_TOO_LARGE, f"the file is larger than the {max_bytes}-byte limit of one input row; "
                                       "it was not read")
    return data


def is_pdf(name: str) -> bool:
    """A PDF, by its name (``.pdf``, any case): its text is extracted by pypdf."""
    return name.lower().endswith(".pdf")


def pdf_support() -> bool:
    """Whether pypdf (the ``pdf`` extra) is installed."""
    return importlib.util.find_spec("pypdf") is not None


def pdf_text(data: bytes) -> str:
    """The text of each page that has any, joined with blank lines (pypdf)."""
    from pypdf import PdfReader

    logger = logging.getLogger("pypdf")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a damaged file's warnings would fill the progress display
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            reader.decrypt("")  # many PDFs are encrypted with an empty password
        pages = [page.extract_text() or "" for page in reader.pages]
        text = "\n\n".join(p for p in pages if p.strip())
        text.encode("utf-8")  # an unpaired surrogate cannot go into a record
    except Exception as e:  # noqa: BLE001 - pypdf raises many kinds on a damaged file; the run goes on
        message = " ".join(str(e).split())[:200]
        raise Unusable(UNREADABLE_FILE, f"pypdf cannot read it as a PDF: {type(e).__name__}: {message}") from None
    finally:
        logger.setLevel(level)
    return text


# ------------------------------------------------------------------ opening an input


def open_source(path: str, shape: RowsConfig, globs: Sequence[str] = (),
                own_files: Sequence[tuple[str, Optional[str]]] = ()) -> InputSource:
    """The input at ``path``: a folder's files (``globs``, default :data:`DEFAULT_GLOBS`),
    or JSONL rows (a file, ``-``, a pipe). ``own_files``: ``(role, path)`` of the run's
    output (first), stats log, summary and texts, which a folder never reads, and which
    must not be one of its documents (:func:`check_own_files`). A problem found before
    any work is a :class:`~knorm_gen.platform.files.FileUsageError`."""
    if path != "-" and os.path.isdir(path):
        return open_folder(Path(path), shape, tuple(globs) or DEFAULT_GLOBS, own_files)
    if globs:
        raise FileUsageError(f"--glob picks the files of a folder INPUT, and {path} is not a folder")
    return JsonlSource(open_input(path), shape)


def open_folder(root: Path, shape: RowsConfig, globs: Sequence[str],
                own_files: Sequence[tuple[str, Optional[str]]] = ()) -> FolderSource:
    """The folder's files that match ``globs``; no match is a usage error, and so is a
    PDF among them without pypdf."""
    patterns = check_globs(globs)
    try:
        os.scandir(root).close()
    except OSError as e:
        raise FileUsageError(f"cannot read input folder {root}: {e.strerror or e}") from None
    check_own_files(root, patterns, own_files)
    files = list_folder(root, patterns, *_run_files(root, [p for _, p in own_files]))
    if not files:
        default = tuple(globs) == DEFAULT_GLOBS
        raise FileUsageError(
            f"INPUT {root} is a directory with no file matching {', '.join(repr(g) for g in globs)}"
            f"{' (the default globs)' if default else ''} at any depth (hidden files and folders are skipped); "
            "name the files to read with --glob PATTERN, repeatable, e.g. --glob '*.html'"
            f"{' (it replaces the default)' if default else ''}, or glob = [...] in a job file")
    pdfs = [f.rel for f in files if is_pdf(f.rel)]
    if pdfs and not pdf_support():
        raise FileUsageError(f"{len(pdfs)} of the files of {root} that --glob matches are PDFs (first: {pdfs[0]}); "
                             f"reading PDFs needs pypdf: {PDF_EXTRA}")
    return FolderSource(root, files, shape)


def check_globs(globs: Sequence[str]) -> tuple[str, ...]:
    """The patterns, each matched against a file's name: a leading ``**/`` is dropped
    (every pattern matches at any depth); a folder in a pattern is a usage error."""
    out = []
    for glob in globs:
        if not isinstance(glob, str) or not glob.strip():
            raise FileUsageError(f"--glob must be a file name pattern such as '*.md', got {glob!r}")
        pattern = glob
        while pattern.startswith("**/"):
            pattern = pattern[3:]
        if "/" in pattern:
            raise FileUsageError(f"--glob {glob!r}: a glob is matched against file names at any depth of the "
                                 "folder, so it names no folder; use a pattern such as '*.md', and give the "
                                 "folder as INPUT")
        out.append(pattern)
    return tuple(dict.fromkeys(out))


# How each of the run's own files begins, when it is one (an earlier run of this job wrote it).
_OWN_STARTS = {"texts": (b"# Texts of ",), "summary": (b'{\n  "input": ',)}


def check_own_files(root: Path, globs: Sequence[str], own_files: Sequence[tuple[str, Optional[str]]]) -> None:
    """Refuse a file the run writes that is a document of the folder input (an existing
    file the globs match, not hidden) and not one an earlier run wrote: writing it would
    replace the user's document."""
    real_root = os.path.realpath(root).rstrip(os.sep) + os.sep
    for role, path in own_files:
        if not path or path == "-" or not os.path.isfile(path):
            continue
        real = os.path.realpath(path)
        rel = real[len(real_root):].split(os.sep) if real.startswith(real_root) else None
        if not rel or any(part.startswith(".") for part in rel) or not any(fnmatchcase(rel[-1], g) for g in globs):
            continue
        if _written_by_us(role, real):
            continue
        raise FileUsageError(f"the {role} file {path} is a document of the input folder {root} (it matches the "
                             f"globs), and this run would replace it; give the {role} a path outside the folder, "
                             "or a name no glob matches")


def _written_by_us(role: str, path: str) -> bool:
    """Whether the file at ``path`` is empty or begins as this role's file of ours does."""
    try:
        with open(path, "rb") as f:
            start = f.read(4096)
    except OSError:
        return False
    if role in _OWN_STARTS:
        return not start.strip() or start.startswith(_OWN_STARTS[role])
    return rec.looks_ours(start)


def _run_files(root: Path, own_files: Sequence[Optional[str]]) -> tuple[set[str], set[str]]:
    """The run's own files (and their part files) and, when the output lies in a
    subfolder of ``root``, that subfolder: what a folder input leaves out (real paths)."""
    files: set[str] = set()
    folders: set[str] = set()
    for path in own_files:
        if path and path != "-":
            files.update(os.path.realpath(p) for p in (path, *local_parts(path)))
    output = own_files[0] if own_files else None
    if output and output != "-":
        real_root, folder = os.path.realpath(root), os.path.dirname(os.path.realpath(output))
        if folder.startswith(real_root.rstrip(os.sep) + os.sep):
            folders.add(folder)
    return files, folders


def list_folder(root: Path, globs: Sequence[str], skip_files: set = frozenset(),
                skip_folders: set = frozenset()) -> list[Listed]:
    """Every file under ``root`` whose name matches a glob, sorted by relative path;
    hidden names and the ``skip_*`` real paths are left out, links to folders are not
    followed. A subfolder that cannot be listed is an entry with its problem."""
    found: list[Listed] = []

    def unlistable(e: OSError) -> None:
        problem = f"cannot list this folder: {e.strerror or e}; the files in it were not read"
        found.append(_listed(Path(e.filename).relative_to(root).as_posix() + "/", (UNREADABLE_FILE, problem)))

    for folder, dirs, names in os.walk(root, onerror=unlistable):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not d.startswith(".") and os.path.realpath(here / d) not in skip_folders]
        for name in names:
            if name.startswith(".") or not any(fnmatchcase(name, g) for g in globs):
                continue
            if os.path.realpath(here / name) not in skip_files:
                found.append(_listed((here / name).relative_to(root).as_posix()))
    return unique_ids(sorted(found, key=lambda f: f.rel))


def _listed(rel: str, problem: Optional[tuple[str, str]] = None) -> Listed:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:  # a name of bytes that are not UTF-8 (os.fsdecode's surrogates)
        byte = next(ord(c) - 0xDC00 for c in rel if "\udc80" <= c <= "\udcff")
        shown = rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        return Listed(shown, (INVALID_UTF8, f"the file name is not valid UTF-8 (byte 0x{byte:02x}; each such byte "
                                            "is shown as \\xNN in its id); rename the file to a UTF-8 name to read it"))
    return Listed(rel, problem)


def unique_ids(files: list[Listed]) -> list[Listed]:
    """``files`` with every id unique: a name shown with ``\\xNN`` escapes (not UTF-8) that
    a real file's name spells too gets ``\\`` before each escape until it is unique."""
    taken = {f.rel for f in files if f.problem is None or f.problem[0] != INVALID_UTF8}
    out = []
    for f in files:
        rel = f.rel
        if f.problem is not None and f.problem[0] == INVALID_UTF8:
            while rel in taken:
                rel = rel.replace("\\x", "\\\\x")
            taken.add(rel)
        out.append(Listed(rel, f.problem))
    return out
