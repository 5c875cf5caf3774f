"""Adding a rule with settings, as docs/api.md says: its own file and its line in the registry
(the numpy reference in tests/test_rules.py is the third file). Done here on a copy of the
package: the rule and its two settings reach the command line, a job file, the record and its
fingerprint with nothing else touched."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "knorm_gen"

TILT = '''"""A rule with two settings, written for the test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .base import Rule, setting, squared_norm


@dataclass(frozen=True)
class Tilt(Rule):
    """Keep low norms, tilted toward early positions."""

    name = "tilt"
    summary = "low norms, tilted toward early positions"

    weight: float = setting(0.5, "How much the position counts beside the norm.")
    power: int = setting(1, "The position's power.")

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        tilt = self.weight * mx.power(positions.astype(mx.float32), self.power)
        return squared_norm(keys) + mx.broadcast_to(tilt, keys.shape[:3])
'''


def _package_with_tilt(root: Path) -> None:
    shutil.copytree(PACKAGE, root / "knorm_gen", ignore=shutil.ignore_patterns("__pycache__"))
    rules = root / "knorm_gen" / "eviction" / "rules"
    (rules / "tilt.py").write_text(TILT)
    registry = rules / "__init__.py"
    text = registry.read_text()
    text = text.replace("from .question import Question\n", "from .question import Question\nfrom .tilt import Tilt\n")
    text = text.replace("Question)}", "Question, Tilt)}")
    assert "Tilt)}" in text  # the registry line took the new rule
    registry.write_text(text)


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "knorm_gen.cli", *args], capture_output=True, text=True, cwd=root,
                          env=env, timeout=300)


def test_a_new_rule_with_two_settings_reaches_the_cli_a_job_file_the_record_and_its_fingerprint(tmp_path,
                                                                                                tiny_model_dir):
    root = tmp_path / "copy"
    _package_with_tilt(root)
    help_text = " ".join(_run(root, "--help").stdout.split())
    assert "--tilt-weight" in help_text and "--tilt-power" in help_text and "tilt = low norms" in help_text
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "The harbor keeps a log of ships and storms. " * 8}) + "\n")
    common = [str(rows), "--model", str(tiny_model_dir), "--budget", "16", "-m", "2", "--quiet"]
    by_option = tmp_path / "by_option.jsonl"
    result = _run(root, *common, "--keep", "tilt", "--tilt-weight", "0.25", "-o", str(by_option))
    assert result.returncode == 0, result.stderr
    record = json.loads(by_option.read_text())
    assert (record["config"]["keep"], record["config"]["tilt_weight"], record["config"]["tilt_power"]) == \
        ("tilt", 0.25, 1)
    assert record["tokens_kept"] < record["tokens_seen"] and record["kept_bytes"] <= record["kv_ceiling_bytes"]
    job = tmp_path / "job.toml"
    by_job = tmp_path / "by_job.jsonl"
    job.write_text(f'input = "{rows}"\noutput = "{by_job}"\nmodel = "{tiny_model_dir}"\n'
                   f'[eviction]\nbudget = 16\nkeep = "tilt"\ntilt_weight = 0.25\ntilt_power = 2\n'
                   f'[generation]\nmax_tokens = 2\n')
    result = _run(root, "--job", str(job), "--quiet")
    assert result.returncode == 0, result.stderr
    again = json.loads(by_job.read_text())
    assert again["config"]["tilt_power"] == 2 and again["fingerprint"] != record["fingerprint"]
    # the settings of a rule that runs in no layer stay out of the record, as the question rule's do
    low = tmp_path / "low.jsonl"
    assert _run(root, *common, "--keep", "low", "-o", str(low)).returncode == 0
    assert not {"tilt_weight", "tilt_power", "question_score"} & set(json.loads(low.read_text())["config"])
