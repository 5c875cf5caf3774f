"""Real English text that ships with CPython: the sections of ``pydoc_data.topics``."""

from __future__ import annotations

import re


def pydoc_sections(min_chars: int = 0) -> list[tuple[str, str]]:
    """``(name, text)`` of every pydoc topic with at least ``min_chars`` characters,
    longest first (ties by name), whitespace runs inside lines collapsed."""
    from pydoc_data.topics import topics

    out = []
    for name, text in topics.items():
        text = re.sub(r"[ \t]+", " ", text).strip()
        if len(text) >= min_chars:
            out.append((name, text))
    out.sort(key=lambda item: (-len(item[1]), item[0]))
    return out


def text_of_tokens(tokenizer, n_tokens: int, skip: int = 0) -> list[int]:
    """``n_tokens`` token ids of pydoc prose (sections joined, longest first),
    starting after the first ``skip`` sections."""
    ids: list[int] = []
    for _, text in pydoc_sections()[skip:]:
        ids.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"pydoc_data.topics holds fewer than {n_tokens} tokens after {skip} sections")
