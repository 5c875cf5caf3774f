"""files.py: whole-file replacement and the cleanup of what a killed one left (no model needed)."""

import os

import pytest

from knorm_gen.platform.files import remove_stale_temps, replacing, rewrite_atomically


def test_replacing_writes_whole_or_not_at_all(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]
    with replacing(path) as tmp:
        assert tmp.name == f".f.txt.{os.getpid()}.tmp"
        tmp.write_text("new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_a_symlink_keeps_pointing_at_its_rewritten_target(tmp_path):
    target, link = tmp_path / "target.jsonl", tmp_path / "link.jsonl"
    target.write_bytes(b"a\n")
    link.symlink_to(target)
    rewrite_atomically(link, [b"b\n", b"c\n"])
    assert link.is_symlink() and target.read_bytes() == b"b\nc\n"


def test_only_the_temps_of_dead_processes_are_removed(tmp_path):
    path = tmp_path / "out.jsonl"
    dead = tmp_path / ".out.jsonl.999999999.tmp"  # no such pid
    alive = tmp_path / f".out.jsonl.{os.getppid()}.tmp"
    other = tmp_path / ".other.jsonl.999999999.tmp"
    for p in (dead, alive, other):
        p.write_text("x")
    assert remove_stale_temps(path) == [dead]
    assert alive.exists() and other.exists() and not dead.exists()
