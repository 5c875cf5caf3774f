"""Durable record writing (no model needed)."""

import io
import json
import os

from knorm_gen.batch import records as rec
from knorm_gen.batch import rows


def rows_of(data: bytes, **kw):
    return list(rows.read_rows(io.BytesIO(data), **kw))


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


def test_records_are_one_json_object_per_line():
    line = rec.dump_record({"id": "x", "completion": "two\nlines \u2028 and \r"})
    assert line.count(b"\n") == 1 and json.loads(line)["completion"] == "two\nlines \u2028 and \r"


def test_the_error_types_are_the_ones_the_readme_lists():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"`type` is one of `{', '.join(rec.ERROR_TYPES)}`" in readme
