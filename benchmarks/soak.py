"""A long knorm-batch job with faults: a rank killed (SIGKILL) and the job resumed, again and again.

    python benchmarks/soak.py                # 2,000 rows, 3 kills and 3 resumes, on a tiny random model
    python benchmarks/soak.py --rows 200     # a quick check

N rows of mixed lengths (short prompts, documents with questions, some past the model's
context, and hostile lines: empty prompts, invalid JSON, bytes that are not UTF-8, special
tokens, odd Unicode) run through ``mlx.launch -n 2`` on two local ranks with a tiny random
model (tests/conftest.py's, its context cut to --context tokens). Each launch but the last
has one rank killed once it has written its share of new records; the next launch resumes.
The result is checked against a clean launch of the same job: every id once (none lost or
duplicated), no record differing in its deterministic fields (id, completion, answers, token
counts, error; not timings), and the peak RSS of each rank per launch (memory flat: the last
launches' peaks within ``FLAT`` of the first's). Prints the figures as JSON and writes --out.
Not part of run_all.py: it is too slow for the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
FLAT = 1.25  # a launch's peak RSS may be at most this times the first launch's
QUESTIONS = ["Summarize the text above.", "Who is named in it?"]
WORDS = ("the harbour master logs every ship and the Mary sailed at dawn with forty barrels of salt while the Anne "
         "came in at noon with wool from the north").split()


def make_rows(n: int, context: int, seed: int = 0) -> list[bytes]:
    """``n`` input lines of mixed lengths and kinds, some past ``context`` tokens, some hostile."""
    rng = random.Random(seed)
    hostile = [lambda i: json.dumps({"id": f"empty-{i}", "prompt": ""}),
               lambda i: '{"id": "broken-%d", "prompt": "no closing brace"' % i,
               lambda i: b'{"id": "bytes-%d", "prompt": "\xff\xfe not UTF-8"}' % i,
               lambda i: json.dumps({"id": f"special-{i}", "prompt": "<|im_end|><|im_start|>user\nSay hi."}),
               lambda i: json.dumps({"id": f"odd-{i}", "prompt": "\u200b\u202eRTL \U0001F600 \ufeff zero-width"},
                                    ensure_ascii=False)]
    lines = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.10:
            line = hostile[i % len(hostile)](i)
        elif kind < 0.45:
            line = json.dumps({"id": f"p{i}", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))})
        else:
            words = rng.randint(10, context // 3) if kind < 0.9 else rng.randint(context // 4, context // 2)
            line = json.dumps({"id": f"c{i}", "context": " ".join(rng.choices(WORDS, k=words)),
                               "questions": QUESTIONS[: rng.randint(1, 2)]})  # the last tenth: past the context
        lines.append((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n")
    return lines


def tiny_model(folder: Path, context: int) -> Path:
    """The tests' tiny random model (a token per byte) with a context of ``context`` tokens."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import make_tiny_model_dir

    path = make_tiny_model_dir(folder, layers=2)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(config))
    return path


def rank_pids(marker: str) -> dict[int, int]:
    """``{rank: pid}`` of the knorm-batch processes whose command line names ``marker``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and b"knorm_gen.cli" in cmdline:
            for var in environ:
                if var.startswith(b"MLX_RANK="):
                    found[int(var[9:])] = int(pid)
    return found


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def written(out: Path) -> int:
    """Records on disk: the parts' lines (the final output is written only at the end)."""
    from knorm_gen.batch.distributed import local_parts

    return sum(p.read_bytes().count(b"\n") for p in local_parts(str(out)))


def launch(argv: list[str], out: Path, kill_rank: int | None = None, kill_after: int = 0) -> dict:
    """One ``mlx.launch -n 2`` of the job; with ``kill_rank``, that rank is SIGKILLed once
    ``kill_after`` new records are on disk. Returns what happened and each rank's peak RSS."""
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--python", sys.executable, "--", "-m", "knorm_gen.cli", *argv]
    start, peaks, killed = written(out), {}, None
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    while proc.poll() is None:
        pids = rank_pids(str(out))
        for rank, pid in pids.items():
            peaks[rank] = max(peaks.get(rank, 0.0), peak_rss_mib(pid))
        if kill_rank is not None and killed is None and kill_rank in pids and written(out) - start >= kill_after:
            os.kill(pids[kill_rank], signal.SIGKILL)
            killed = written(out) - start
        time.sleep(0.1)
    stderr = proc.communicate()[1].decode(errors="replace")
    return {"killed_rank": kill_rank if killed is not None else None, "records_before_kill": killed,
            "new_records": written(out) - start if killed is not None else None, "exit_code": proc.returncode,
            "wall_s": time.perf_counter() - tic, "peak_rss_mib": [round(peaks.get(r, 0.0), 1) for r in (0, 1)],
            "stderr_tail": stderr[-400:] if proc.returncode not in (0, 1) else ""}


def deterministic(record: dict) -> dict:
    """What a record says that does not depend on timing."""
    answers = record.get("answers")
    return {"id": record.get("id"), "completion": record.get("completion"),
            "answers": [{k: a.get(k) for k in ("question", "answer", "prompt_tokens", "generated_tokens", "tokens_seen",
                                              "tokens_kept")} for a in answers] if answers is not None else None,
            **{k: record.get(k) for k in ("prompt_tokens", "generated_tokens", "tokens_seen", "tokens_kept")},
            "error": record.get("error")}


def by_key(path: Path) -> dict:
    """Each record of ``path`` by its id (a line without id: by its error's line)."""
    out = {}
    for line in path.read_bytes().splitlines():
        record = json.loads(line)
        key = record["id"] if record.get("id") is not None else f"line {record['error']['line']}"
        out.setdefault(key, []).append(deterministic(record))
    return out


def check(clean: Path, soaked: Path, expected: list[str]) -> dict:
    """Ids lost or duplicated in ``soaked``, and records that differ from ``clean``'s."""
    ids = Counter(json.loads(line).get("id") for line in soaked.read_bytes().splitlines())
    ids.pop(None, None)
    a, b = by_key(clean), by_key(soaked)
    return {"ids_expected": len(expected), "ids_lost": sorted(set(expected) - set(ids)),
            "ids_duplicated": sorted(k for k, n in ids.items() if n > 1),
            "records_differing": sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)),
            "records": sum(len(v) for v in b.values())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--resumes", type=int, default=3, help="kills, each followed by a resume (default 3)")
    ap.add_argument("--context", type=int, default=512, help="the tiny model's context in tokens")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--work-dir", default=None, help="where the job's files go (default: a temporary folder)")
    ap.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    args = ap.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="knorm-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    model = tiny_model(work / "model", args.context)
    inp = work / "rows.jsonl"
    lines = make_rows(args.rows, args.context)
    inp.write_bytes(b"".join(lines))
    expected = sorted({json.loads(x)["id"] for x in lines if _json(x)})

    def job(out: Path) -> list[str]:
        return [str(inp), "-o", str(out), "--model", str(model), "--budget", "32", "--max-tokens",
                str(args.max_tokens), "--batch-size", "1", "-q", "--stats-log", str(out.with_suffix(".stats.jsonl"))]

    clean = launch(job(work / "clean.jsonl"), work / "clean.jsonl")
    out = work / "soak.jsonl"
    share = max(2, args.rows // (2 * (args.resumes + 1)))  # new records before each kill: about a quarter each
    launches = [launch(job(out), out, kill_rank=i % 2, kill_after=share) for i in range(args.resumes)]
    launches.append(launch(job(out), out))
    peaks = [max(x["peak_rss_mib"]) for x in launches]
    figures = {"benchmark": "soak", "rows": args.rows, "resumes": args.resumes,
               "faults": sum(x["killed_rank"] is not None for x in launches), "context": args.context,
               "max_tokens": args.max_tokens, "clean": clean, "launches": launches,
               **check(work / "clean.jsonl", out, expected),
               "part_lines_left": written(out),
               "peak_rss_mib_per_launch": peaks,
               "memory_flat": all(p <= FLAT * peaks[0] for p in peaks if p),
               "seconds": time.perf_counter() - tic}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=1))
    shown = {k: v for k, v in figures.items() if k not in ("clean", "launches")}
    print(json.dumps({**shown, "launches": [{k: x[k] for k in ("killed_rank", "records_before_kill", "exit_code",
                                                                "wall_s", "peak_rss_mib")} for x in launches]}, indent=1))
    return figures


def _json(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
