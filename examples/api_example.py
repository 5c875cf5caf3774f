"""Generate with KV-cache eviction from Python (the default rule; the instructions are never evicted).

Each document below is several times the budget, so every compressed layer evicts: the lines
printed say how many positions were seen, how many a layer kept, and the KV bytes held against
the model's own cache.

Run: .venv/bin/python examples/api_example.py   (a few minutes on 2 CPU cores)
"""

import knorm_gen  # noqa: F401  (first, before mlx: on Linux it loads OpenBLAS for MLX)
from pydoc_data.topics import topics

from knorm_gen import answer_questions, generate_batch_with_eviction, generate_with_eviction, load_model

model, tokenizer = load_model()  # the embedded SmolLM2-135M-Instruct


def kept(r) -> str:
    return (f"{r.tokens_seen} tokens seen, {r.tokens_kept} kept per compressed layer "
            f"({r.compression_ratio:.2f}x compression of the document), KV {r.kept_bytes / 2**20:.1f} MiB "
            f"of the model's own {r.full_bytes / 2**20:.1f} MiB")


# One document (Python's reference on the `try` statement, about 2,000 tokens), one question:
# each compressed layer keeps at most 256 of the document's tokens; the question is pinned.
document = topics["try"]
(summary,) = answer_questions(model, tokenizer, document, ["Summarize the text above in two sentences."],
                              budget=256, max_tokens=48, repetition_penalty=1.2)
print(summary.text.strip())
print(kept(summary))

# Several questions about one context: the context is compressed once, to 128 tokens a layer.
document = topics["with"]  # the `with` statement, about 800 tokens
for answer in answer_questions(model, tokenizer, document,
                               ["Which methods does a context manager define?", "What does __exit__ receive?"],
                               budget=128, max_tokens=32):
    print(f"Q: {answer.question}\nA: {answer.text.strip()}\n   {kept(answer)}")

# A prompt that is all document (the request written at its end), and several decoded together:
# each row evicts exactly as it would alone, here to 64 tokens a layer.
prompts = [topics[name] + "\n\nIn one sentence, what is this about?" for name in ("assert", "class", "exceptions")]
for r in generate_batch_with_eviction(model, tokenizer, prompts, batch_size=3, budget=64, max_tokens=24):
    print(f"{r.text.strip()[:60]!r}: {kept(r)}")
single = generate_with_eviction(model, tokenizer, prompts[0], budget=64, max_tokens=24)
print(f"alone: {single.text.strip()[:60]!r}: {kept(single)}")
