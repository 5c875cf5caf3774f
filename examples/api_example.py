"""Generate with KV-cache eviction from Python (the default rule; the instructions are never evicted).

Run: python examples/api_example.py   (about half a minute on 2 CPU cores)
"""

from knorm_gen import answer_questions, generate_batch_with_eviction, generate_with_eviction, load_model

model, tokenizer = load_model()  # the embedded SmolLM2-135M-Instruct

# One completion; every compressed layer keeps at most 64 tokens.
result = generate_with_eviction(
    model, tokenizer,
    "Explain in two sentences why the sky is blue.",
    budget=64, n_sink=4, recent=16, max_tokens=48,
)
print(result.text)
print(f"{result.tokens_seen} tokens seen, {result.tokens_kept} kept, "
      f"{result.compression_ratio:.2f}x smaller cache, {result.generation_tps:.1f} tokens/s")

# Several questions about one context: the context is compressed once.
context = (
    "The Rhine rises in the Swiss Alps, flows through Lake Constance, forms part of the "
    "border between Germany and France, and reaches the North Sea in the Netherlands. "
    "Its length is about 1,230 kilometres."
)
for answer in answer_questions(
    model, tokenizer, context,
    ["Where does the Rhine rise?", "Where does the Rhine reach the sea?"],
    budget=32, max_tokens=24,
):
    print(f"Q: {answer.question}\nA: {answer.text}")

# Several prompts decoded together; each row evicts exactly as it would alone.
prompts = ["Name three rivers in Europe.", "What is a prime number?", "Describe a cat in one sentence."]
for prompt, r in zip(prompts, generate_batch_with_eviction(model, tokenizer, prompts, batch_size=3,
                                                           budget=32, max_tokens=24)):
    print(f"{r.prompt_tokens}+{r.generated_tokens} tokens, {r.tokens_kept} kept: {r.text[:40]!r}")
