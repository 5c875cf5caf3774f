"""Write docs/api.md's settings tables: one row per field of ``EvictionConfig``,
``GenerationConfig`` and ``RowsConfig``, from the fields themselves (name, type, default and
the help text ``knorm-batch --help`` shows, all in each field's ``_setting`` metadata), so the
page cannot drift from the code. ``tests/test_docs.py`` checks the page equals what this writes.

    .venv/bin/python scripts/config_tables.py          # rewrites the tables in docs/api.md
    .venv/bin/python scripts/config_tables.py --check  # exit 1 when they are stale

Each table lies between ``<!-- fields:CLASS -->`` and ``<!-- /fields -->`` (CLASS: a class of
knorm_gen.eviction.config); what is between the markers is replaced, the rest of the page is kept.
"""

from __future__ import annotations

import re
import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import knorm_gen  # noqa: E402,F401  (BLAS preload before mlx)
from knorm_gen.eviction import config  # noqa: E402
from knorm_gen.cli.batch import batch_command  # noqa: E402

PAGE = ROOT / "docs" / "api.md"
REGION = re.compile(r"(<!-- fields:(\w+) -->\n)(.*?)(<!-- /fields -->)", re.S)
COLUMNS = ("field", "type", "default", "option", "what it sets")


def option(f: Field) -> str:
    """The field's ``knorm-batch`` option, with every spelling it takes (``--temperature, --temp``)."""
    (param,) = [p for p in batch_command.params if p.name == f.name]
    names = ", ".join(param.opts) + "".join(f" / {o}" for o in param.secondary_opts)
    return names + (" (repeatable)" if f.metadata.get("multiple") else "")


def default(f: Field) -> str:
    """The Python default, and beside it what ``--help`` says of it where the field has words for it."""
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    words = f.metadata.get("default_text")
    if value is config.UNSET:  # settled with other fields (budget, ratio): the words say how
        return words
    return f"`{value!r}`" + (f" ({words})" if words else "")


def table(cls_name: str) -> str:
    """The markdown table of ``knorm_gen.eviction.config.<cls_name>``'s fields."""
    cls = getattr(config, cls_name, None)
    if cls is None or not hasattr(cls, "__dataclass_fields__"):
        raise SystemExit(f"{PAGE}: <!-- fields:{cls_name} --> names no settings class of knorm_gen.eviction.config")

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for f in fields(cls):
        lines.append("| " + " | ".join([f"`{f.name}`", f"`{cell(f.type)}`", cell(default(f)), f"`{cell(option(f))}`",
                                        cell(f.metadata.get("help", ""))]) + " |")
    return "\n".join(lines)


def render(text: str) -> str:
    """``text`` with every fields region rewritten from the classes as they are now."""
    return REGION.sub(lambda m: f"{m[1]}{table(m[2])}\n{m[4]}", text)


def main(argv: list[str]) -> None:
    text = PAGE.read_text(encoding="utf-8")
    found = [m[2] for m in REGION.finditer(text)]
    if not found:
        raise SystemExit(f"{PAGE} has no '<!-- fields:CLASS -->' ... '<!-- /fields -->' region")
    new = render(text)
    if "--check" in argv:
        if new != text:
            raise SystemExit(f"{PAGE}: the settings tables are stale; run python scripts/config_tables.py")
        print(f"{PAGE}: the tables of {', '.join(found)} are up to date")
        return
    PAGE.write_text(new, encoding="utf-8")
    print(f"wrote the tables of {', '.join(found)} to {PAGE}")


if __name__ == "__main__":
    main(sys.argv[1:])
