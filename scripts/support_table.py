"""Write docs/models.md's support table: every architecture of the installed mlx_lm, built
as a tiny random model (tests/zoo.py, the list tests/test_architectures.py checks), with
what knorm_gen's model check finds on it.

    .venv/bin/python scripts/support_table.py        # rewrites the table in docs/models.md
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import knorm_gen  # noqa: E402,F401  (BLAS preload before mlx)
from knorm_gen.models.support import model_support, support_row  # noqa: E402
from tests import zoo  # noqa: E402

START, END = "<!-- support table: scripts/support_table.py -->", "<!-- end of support table -->"
COLUMNS = ("architecture", "outcome", "compressed layers", "sliding-window layers", "question rule", "rows together",
           "quantized KV")


def rows() -> list[dict]:
    out = []
    for arch in zoo.ARCHITECTURES:
        if zoo.status(arch):
            out.append({"architecture": arch, "outcome": f"not built here: {zoo.status(arch)}",
                        **{c: "-" for c in COLUMNS[2:]}})
        else:
            out.append({**support_row(model_support(zoo.tiny_model(arch))), "architecture": arch})
    return out


def table(found: list[dict]) -> str:
    def cell(value: str) -> str:
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join([f"`{r['architecture']}`"] + [cell(r[c]) for c in COLUMNS[1:]]) + " |" for r in found]
    return "\n".join(lines)


def main() -> None:
    path = ROOT / "docs" / "models.md"
    text = path.read_text(encoding="utf-8")
    if START not in text:
        raise SystemExit(f"{path} has no {START!r} marker: add one where the table goes, and {END!r} after it")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{START}\n{table(rows())}\n{END}{tail}", encoding="utf-8")
    print(f"wrote {len(zoo.ARCHITECTURES)} architectures to {path}")


if __name__ == "__main__":
    main()
