"""JSONL row parsing: kinds, ids, overrides, bad bytes and lines (no model needed)."""

import io

import pytest

from knorm_gen.batch import records as rec
from knorm_gen.batch import rows


def rows_of(data: bytes, **kw):
    return list(rows.read_rows(io.BytesIO(data), **kw))


def test_row_kinds_default_id_overrides_and_meta():
    data = (b'{"prompt": "Hi there"}\n'
            b'{"id": "m", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0.5}\n'
            b'{"id": 7, "context": "Some text.", "question": "What?", "source": "x", "budget": null}\n'
            b'{"id": "qs", "context": "Some text.", "questions": ["A?", "B?"], "max_tokens": 3, "meta": {"k": 1}}\n')
    a, b, c, d = rows_of(data)
    assert (a.id, a.kind, a.prompt, a.line, a.meta) == (1, "prompt", "Hi there", 1, {})
    assert (b.kind, b.prompt, b.overrides) == ("messages", [{"role": "user", "content": "Hello"}], {"temperature": 0.5})
    assert (c.kind, c.context, c.questions, c.meta, c.overrides) == (
        "questions", "Some text.", ["What?"], {"source": "x"}, {"budget": None})
    assert (d.questions, d.overrides, d.meta) == (["A?", "B?"], {"max_tokens": 3}, {"meta": {"k": 1}})


def test_a_rows_budget_and_ratio_apply_on_top_of_the_runs():
    from knorm_gen.eviction.config import EvictionConfig, make_configs

    (row,) = rows_of(b'{"prompt": "p", "ratio": 8, "budget": 300}\n')
    assert row.overrides == {"ratio": 8, "budget": 300}
    run = EvictionConfig()  # the default: ratio 4, no cap
    capped, _ = make_configs(run, **row.overrides)
    assert (capped.ratio, capped.budget) == (8, 300)
    assert (make_configs(run, budget=300)[0].ratio, make_configs(run, budget=300)[0].budget) == (4, 300)  # a cap
    full, _ = make_configs(run, ratio=None, budget=None)
    assert (full.ratio, full.budget) == (None, None)  # the full cache


@pytest.mark.parametrize("line, field", [
    ('{"prompt": 5}', "'prompt' must be text, got an integer 5"),
    ('{"prompt": "   "}', "'prompt' is empty"),
    ('{"messages": "x"}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "messages[0].content must be text"),
    ('{"context": "c", "questions": []}', "'questions' must be a non-empty list of text"),
    ('{"context": "c", "questions": ["ok", 3]}', "'questions[1]' must be text"),
    ('{"context": "c"}', "exactly one of 'question'"),
    ('{"prompt": "p", "messages": [{"role": "user", "content": "x"}]}', "got 'prompt' and 'messages'"),
    ('{"id": 1}', "got none"),
    ('{"prompt": "p", "question": "q"}', "go with 'context'"),
    ('{"id": 1.5, "prompt": "p"}', "'id' must be a non-empty string or an integer, got a number 1.5"),
    ('{"id": true, "prompt": "p"}', "'id' must be"),
    ('{"prompt": "p", "max_tokens": 0}', "'max_tokens' must be an integer >= 1"),
    ('{"prompt": "p", "temperature": "hot"}', "'temperature' must be a number >= 0"),
    ('{"prompt": "p", "budget": "big"}', "'budget' must be an integer >= 1 or null"),
    ('{"prompt": "p", "ratio": 0.5}', "'ratio' must be a number >= 1 or null"),
    ('{"prompt": "p", "ratio": "4"}', "'ratio' must be a number >= 1 or null"),
    ('[1, 2]', "expected a JSON object, got an array"),
])
def test_wrong_types_name_line_and_field(line, field):
    (err,) = rows_of(b"\n" + line.encode() + b"\n")
    assert isinstance(err, rows.RowError) and err.type == rec.INVALID_ROW and err.line == 2
    assert err.message.startswith("line 2: ") and field in err.message


def test_bom_crlf_blank_lines_and_bad_bytes():
    data = (rows.BOM + b'{"id": "a", "prompt": "x"}\r\n'
            b"\r\n   \n"
            b'{"id": "b", "prompt": "caf\xc3\xa9"}\r\n'
            b'{"id": "c", "prompt": "bad \xff byte"}\n'
            b'{"id": "d", "prompt": "trunc\n'
            b'{"id": "e", "prompt": "no newline at end"}')
    items = rows_of(data)
    assert [getattr(i, "id", None) for i in items] == ["a", "b", None, None, "e"]
    assert items[1].prompt == "caf\u00e9" and items[1].line == 4  # blank lines count for line numbers
    assert (items[2].type, items[2].line) == (rec.INVALID_UTF8, 5) and "0xff" in items[2].message
    assert (items[3].type, items[3].line) == (rec.INVALID_JSON, 6)
    assert items[4].line == 7


def test_huge_line_is_skipped_unread_and_reading_goes_on():
    data = b'{"prompt": "' + b"x" * 5000 + b'"}\n{"id": "next", "prompt": "y"}\n'
    big, nxt = rows_of(data, max_bytes=1000)
    assert (big.type, big.line) == (rec.LINE_TOO_LONG, 1) and "1000-byte" in big.message
    assert nxt.id == "next" and nxt.line == 2
    assert len(rows_of(b'\n{"a":1}\n\n{"b":2}')) == 2  # blank lines are no rows


def test_duplicate_ids_compare_as_text():
    items = rows_of(b'{"id": 3, "prompt": "a"}\n{"id": "3", "prompt": "b"}\n{"prompt": "c"}\n{"id": "x", "prompt": "d"}\n')
    assert items[0].id == 3
    assert items[1].type == rec.DUPLICATE_ID and items[1].id is None and "first used on line 1" in items[1].message
    # line 3 has the default id 3, which line 1 already used
    assert items[2].type == rec.DUPLICATE_ID
    assert items[3].id == "x"

