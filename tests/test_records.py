"""JSONL row parsing, durable record writing, and the resume scanner (no model needed)."""

import io
import json
import os

import pytest

from knorm_gen import records as rec


def rows_of(data: bytes, **kw):
    return list(rec.read_rows(io.BytesIO(data), **kw))


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
    ('[1, 2]', "expected a JSON object, got an array"),
])
def test_wrong_types_name_line_and_field(line, field):
    (err,) = rows_of(b"\n" + line.encode() + b"\n")
    assert isinstance(err, rec.RowError) and err.type == rec.INVALID_ROW and err.line == 2
    assert err.message.startswith("line 2: ") and field in err.message


def test_bom_crlf_blank_lines_and_bad_bytes():
    data = (rec.BOM + b'{"id": "a", "prompt": "x"}\r\n'
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
    assert rec.count_rows(io.BytesIO(b'\n{"a":1}\n\n{"b":2}')) == 2


def test_duplicate_ids_compare_as_text():
    items = rows_of(b'{"id": 3, "prompt": "a"}\n{"id": "3", "prompt": "b"}\n{"prompt": "c"}\n{"id": "x", "prompt": "d"}\n')
    assert items[0].id == 3
    assert items[1].type == rec.DUPLICATE_ID and items[1].id is None and "first used on line 1" in items[1].message
    # line 3 has the default id 3, which line 1 already used
    assert items[2].type == rec.DUPLICATE_ID
    assert items[3].id == "x"


def test_writer_writes_whole_lines_and_fsyncs(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = tmp_path / "out.jsonl"
    w = rec.RecordWriter.open(path)
    w.write({"id": 1, "text": "caf\u00e9\nline"})
    assert path.read_bytes() == '{"id": 1, "text": "caf\u00e9\\nline"}\n'.encode()
    w.write({"id": 2})
    w.close()
    assert len(synced) == 2
    # a stream that is not a file (stdout, a pipe) is flushed but not fsynced
    buf = io.BytesIO()
    rec.RecordWriter(buf).write({"id": 3})
    assert buf.getvalue() == b'{"id": 3}\n' and len(synced) == 2


def record_line(row_id, error=None):
    return rec.dump_record({"id": row_id, "completion": "x", "error": error})


def test_scan_output_torn_tail_failed_records_and_corruption(tmp_path):
    path = tmp_path / "out.jsonl"
    assert rec.scan_output(path).records == {}
    ok1, ok2 = record_line("a"), record_line(2)
    failed = record_line("b", {"type": "invalid_row", "message": "m", "line": 2})
    path.write_bytes(ok1 + failed + ok2 + b'{"id": "c", "compl')
    state = rec.scan_output(path)
    assert state.torn and state.dropped_errors == 1 and state.needs_rewrite
    keep = [line for _, line in state.records.values()]
    assert keep == [ok1, ok2] and set(state.records) == {"a", "2"}
    rec.rewrite_atomically(path, keep)
    assert path.read_bytes() == ok1 + ok2
    assert not rec.scan_output(path).needs_rewrite
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temp file left

    path.write_bytes(ok1 + b'{"id": "c"\n')  # a terminated but unreadable last line is torn too
    assert rec.scan_output(path).torn
    path.write_bytes(ok1 + b"garbage\n" + ok2)
    with pytest.raises(rec.OutputCorrupt, match="line 2 is not a knorm-batch record"):
        rec.scan_output(path)
    path.write_bytes(b'{"not": "a record"}\n' + ok1)
    with pytest.raises(rec.OutputCorrupt):
        rec.scan_output(path)


def test_records_are_one_json_object_per_line():
    line = rec.dump_record({"id": "x", "completion": "two\nlines \u2028 and \r"})
    assert line.count(b"\n") == 1 and json.loads(line)["completion"] == "two\nlines \u2028 and \r"
