"""Resume: the scan of an earlier output, the plan against the input, and the merge
of a process group's parts (no model needed)."""

import pytest

from knorm_gen.batch import records as rec
from knorm_gen.platform.files import rewrite_atomically
from knorm_gen.batch.resume import OutputCorrupt, scan_output


def record_line(row_id, error=None):
    return rec.dump_record({"id": row_id, "completion": "x", "error": error})


def test_scan_output_torn_tail_failed_records_and_corruption(tmp_path):
    path = tmp_path / "out.jsonl"
    assert scan_output(path).records == {}
    ok1, ok2 = record_line("a"), record_line(2)
    failed = record_line("b", {"type": "invalid_row", "message": "m", "line": 2})
    path.write_bytes(ok1 + failed + ok2 + b'{"id": "c", "compl')
    state = scan_output(path)
    assert state.torn and state.dropped_errors == 1 and state.needs_rewrite
    keep = [line for _, line in state.records.values()]
    assert keep == [ok1, ok2] and set(state.records) == {"a", "2"}
    rewrite_atomically(path, keep)
    assert path.read_bytes() == ok1 + ok2
    assert not scan_output(path).needs_rewrite
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temp file left

    path.write_bytes(ok1 + b'{"id": "c"\n')  # a terminated but unreadable last line is torn too
    assert scan_output(path).torn
    path.write_bytes(ok1 + b"garbage\n" + ok2)
    with pytest.raises(OutputCorrupt, match="line 2 is not a knorm-batch record"):
        scan_output(path)
    path.write_bytes(b'{"not": "a record"}\n' + ok1)
    with pytest.raises(OutputCorrupt):
        scan_output(path)
