"""Smoke run of the benchmarks' --quick mode on a tiny random model, validated against the
schema that benchmarks/README.md documents (every documented field present with its type,
every top-level key documented, every documented file written by the quick run or published).
Quality numbers are not asserted here."""

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_DOC = ROOT / "benchmarks" / "README.md"
TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "absent": lambda v: False,  # the field's top-level key may be missing (a section the run skipped)
}


def documented_schema() -> dict:
    """``{file: [(field path, [types])]}`` from the README's results table."""
    schema: dict = {}
    row = re.compile(r"^\| `([\w.*-]+\.json)` \| `([^`]+)` \| ([a-z |\\]+?) \|", re.M)
    for file, path, types in row.findall(SCHEMA_DOC.read_text()):
        names = [t.strip() for t in types.replace("\\|", "|").split("|")]
        assert all(n in TYPES for n in names), (file, path, types)
        schema.setdefault(file, []).append((path, names))
    return schema


def values_at(data, path: str):
    """Every value a field path reaches (``a.b``, ``a[]``, ``a{}``)."""
    found = [data]
    for part in path.split("."):
        m = re.fullmatch(r"(\w+)((?:\[\]|\{\})*)", part)
        assert m, path
        name, suffixes = m.groups()
        nxt = []
        for item in found:
            assert isinstance(item, dict) and name in item, f"{path}: missing '{name}'"
            nxt.append(item[name])
        for suffix in re.findall(r"\[\]|\{\}", suffixes):
            want = list if suffix == "[]" else dict
            assert all(isinstance(v, want) for v in nxt), f"{path}: '{name}' is not a {want.__name__}"
            nxt = [x for v in nxt for x in (v if suffix == "[]" else v.values())]
            assert nxt, f"{path}: '{name}' is empty"
        found = nxt
    return found


def check_file(data: dict, fields: list) -> None:
    tops = {path.split(".")[0].split("[")[0].split("{")[0] for path, _ in fields}
    assert set(data) <= tops, f"undocumented top-level keys: {sorted(set(data) - tops)}"
    for path, types in fields:
        if "absent" in types and path.split(".")[0].split("[")[0].split("{")[0] not in data:
            continue
        for value in values_at(data, path):
            assert any(TYPES[t](value) for t in types), f"{path}: {value!r} is not {' | '.join(types)}"


def test_schema_validator_catches_drift():
    fields = [("rows[].ppl", ["number"]), ("grid{}", ["array"]), ("name", ["string"])]
    check_file({"rows": [{"ppl": 1.5}], "grid": {"512": [1]}, "name": "x"}, fields)
    for bad in ({"rows": [{"ppl": "1.5"}], "grid": {"512": [1]}, "name": "x"},   # wrong type
                {"rows": [{}], "grid": {"512": [1]}, "name": "x"},                # missing field
                {"rows": [{"ppl": 1.0}], "grid": {"512": [1]}, "name": "x", "new": 1}):  # undocumented
        with pytest.raises(AssertionError):
            check_file(bad, fields)
    check_file({"name": "x"}, [("job.rows[].n", ["number", "absent"]), ("name", ["string"])])  # a skipped section
    with pytest.raises(AssertionError):
        check_file({"name": "x", "job": {}}, [("job.rows[].n", ["number", "absent"]), ("name", ["string"])])


def schema_for(name: str, schema: dict) -> list:
    matches = [pattern for pattern in schema if fnmatch.fnmatch(name, pattern)]
    assert len(matches) == 1, f"{name} matches {matches} in benchmarks/README.md"
    return schema[matches[0]]


def test_published_results_match_the_documented_schema():
    schema = documented_schema()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        check_file(json.loads(path.read_text()), schema_for(path.name, schema))


def test_run_all_quick_matches_the_documented_schema(tmp_path, tiny_model_dir):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from run_all import STEPS

    # cost.py's quick run and its file are checked by tests/test_cost_benchmark.py (against this schema too)
    steps = [s for s in STEPS if s != "cost"]
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--model",
                           str(tiny_model_dir), "--out-dir", str(out), "--only", ",".join(steps)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    timed = [line.split()[0] for line in lines[-len(steps) - 1:]]  # one line a step, in the order they finish
    assert sorted(timed[:-1]) == sorted(steps) and timed[-1] == "all", proc.stdout
    schema = documented_schema()
    written = sorted(out.glob("*.json"))
    assert len(written) == len(steps), [p.name for p in written]  # one file per step
    for path in written:
        check_file(json.loads(path.read_text()), schema_for(path.name, schema))
    # nothing documented that no run writes: the quick run, or a published file (scripts outside run_all.py)
    published = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")]
    for pattern in schema:
        assert any(fnmatch.fnmatch(name, pattern) for name in [p.name for p in written] + published), pattern


def test_fidelity_references_are_cut_at_their_first_loop():
    from knorm_gen.tuning.evaluate import cut_repetition

    loop = [5, 6, 7, 8, 9, 10, 11, 12]
    assert cut_repetition([1, 2] + loop + loop + [3]) == [1, 2] + loop  # the second copy starts the loop
    assert cut_repetition(list(range(40))) == list(range(40))           # no 8-gram repeats: kept whole
    assert cut_repetition([4] * 7) == [4] * 7 and cut_repetition([4] * 9) == [4]  # overlapping copies
