"""The fidelity benchmark's papers (benchmarks/documents.py ``papers()``): R vignettes from the
Debian packages pinned in benchmarks/vignettes.txt, which scripts/setup.sh unpacks into the
venv. Each carries its authors' abstract as the human-written summary, not inside the body,
and the held-out half is fixed by the names alone."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import documents  # noqa: E402

SETUP_HINT = "the vignettes are not unpacked at the pinned versions here: run scripts/setup.sh (or make test)"


@pytest.fixture(scope="module")
def papers():
    found = documents.papers()
    assert len(found) == len(documents.PAPERS), SETUP_HINT
    return found


def test_every_paper_has_its_abstract_apart_from_its_body(papers):
    for doc in papers:
        assert doc.name.startswith("paper:") and doc.source.startswith("Debian 12 r-cran-")
        assert doc.licence.startswith(("GPL", "LGPL")), doc.name
        assert len(doc.summary) >= 100, doc.name  # the authors' abstract, one paragraph or more
        assert len(doc.text) >= 6000, doc.name
        body = " ".join(doc.text.split())
        assert doc.summary not in body, doc.name
        assert doc.summary[:80] not in body, doc.name
        # the LaTeX markup of the abstract is gone: no citation keys or formatting commands
        assert not re.search(r"\\(?:cite\w*|pkg|proglang|emph)\{", doc.summary), doc.name
        assert "\\begin{document}" not in doc.text and "\\Abstract{" not in doc.text, doc.name


def test_the_held_out_half_is_fixed_by_the_names():
    names = [documents.paper_name(p, f) for p, f, _ in documents.PAPERS]
    held = [n for n in names if documents.is_held_out(n)]
    assert abs(2 * len(held) - len(names)) <= 3  # about half
    # the first byte of the name's sha256 is odd: these must never move
    assert documents.is_held_out("paper:Formula/Formula") and not documents.is_held_out("paper:AER/AER")


def test_enough_papers_of_2k_to_30k_tokens_on_each_side(papers):
    from knorm_gen.models.load import get_model

    _, tok = get_model("default")
    kept = documents.papers(tok)
    assert len(kept) >= 48
    assert all(2000 <= d.tokens <= 30000 for d in kept)
    assert sum(d.held_out for d in kept) >= 24 and sum(not d.held_out for d in kept) >= 24
    assert {d.name for d in documents.papers(tok, held_out=True)} == {d.name for d in kept if d.held_out}
