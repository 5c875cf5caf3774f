"""Rebuild examples/folder/, docs.jsonl, longdocs.jsonl and questions.jsonl from pydoc_data.topics.

The text is the Python reference documentation that ships with CPython, so
the files are deterministic for a given Python version (they were built
with 3.11). Run: python examples/make_examples.py
"""

import json
from pathlib import Path

from pydoc_data.topics import topics

HERE = Path(__file__).resolve().parent
# Documents are plain {"id", "text"} rows: the summarization instruction is the job's
# (--question / [rows] questions), asked after each document and never evicted.

# Long sections, about 1,500-3,500 tokens each with the embedded model's tokenizer.
LONG_TOPICS = ["typesmapping", "attribute-access", "comparisons", "assignment", "execmodel",
               "import", "try", "calls", "sequence-types", "function"]

# docs.jsonl: sections of about 800-1,250 tokens as prompt rows, the workload of
# benchmarks/bench_distributed.py (long enough that a 128-token budget really evicts).
MAIN_TOPICS = ["with", "binary", "objects", "identifiers"]

# The main job (make run) reads a folder: one text file per section, 2,000-3,300 tokens each,
# so the default compression (a quarter of each document kept) really evicts.
FOLDER_TOPICS = ["typesmapping", "execmodel", "import"]

# Shorter sections, each with questions whose answers are in its text.
QUESTIONS = {
    "for": ["What happens to the 'else' clause of a for loop when 'break' is executed?",
            "Are the names in the target list deleted when the loop finishes?"],
    "raise": ["What does a bare 'raise' do when no exception is being handled?",
              "Which attribute does the 'from' clause set on the raised exception?"],
    "dict": ["If the same key appears twice in a dictionary display, which value is kept?",
             "What does a double asterisk denote in a dictionary display?",
             "In which Python version was unpacking into dictionary displays added?"],
}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    docs = [{"id": name, "text": topics[name].strip(), "source": f"pydoc_data.topics:{name}"}
            for name in MAIN_TOPICS]
    longdocs = [{"id": name, "text": topics[name].strip(), "source": f"pydoc_data.topics:{name}"}
                for name in LONG_TOPICS]
    questions = [{"id": name, "context": topics[name].strip(), "questions": qs, "source": f"pydoc_data.topics:{name}"}
                 for name, qs in QUESTIONS.items()]
    (HERE / "folder").mkdir(exist_ok=True)
    for name in FOLDER_TOPICS:
        (HERE / "folder" / f"{name}.txt").write_text(topics[name].strip() + "\n", encoding="utf-8")
    write_jsonl(HERE / "docs.jsonl", docs)
    write_jsonl(HERE / "longdocs.jsonl", longdocs)
    write_jsonl(HERE / "questions.jsonl", questions)
    print(f"wrote {len(FOLDER_TOPICS)} files to folder/, {len(docs)} rows to docs.jsonl, {len(longdocs)} to longdocs.jsonl "
          f"and {len(questions)} to questions.jsonl")


if __name__ == "__main__":
    main()
