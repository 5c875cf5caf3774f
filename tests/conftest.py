"""Shared fixtures: tiny random mlx_lm llama models (no weights needed)."""

import json
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from knorm_gen.eviction.rules.keydiff import BLEND_WEIGHT
from knorm_gen.eviction.rules.leverage import LEVERAGE_REFRESH, LEVERAGE_RIDGE


def tiny_llama(layers: int = 3, seed: int = 0, layer_types=None, sliding_window=None, vocab: int = 97,
               head_dim: int = 16):
    """A small random llama in float32; outputs are deterministic for a seed."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def random_tokens(n: int, seed: int = 0, vocab: int = 97, repeat: bool = True) -> mx.array:
    """Token ids; with ``repeat`` a small alphabet so equal keys (exact norm ties) occur."""
    rng = np.random.default_rng(seed)
    high = 12 if repeat else vocab
    return mx.array(rng.integers(0, high, size=n), dtype=mx.int32)


@pytest.fixture
def tiny_model():
    return tiny_llama()


def greedy_with_gaps(model, caches, token, max_tokens, eos):
    """Greedy tokens after ``token`` through ``caches``, with each step's top-2 logit gap
    (a divergence from another path is a near-tie only where the gap is small)."""
    tokens, gaps = [], []
    for _ in range(max_tokens):
        logits = model(mx.array([[token]]), cache=caches)[0, -1]
        top = np.sort(np.array(logits))[-2:]
        gaps.append(float(top[1] - top[0]))
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        if token in eos:
            break
    return tokens, gaps


# Two prefill block splits through the embedded 30-layer model gave last-token
# logits up to 3.5e-5 apart (one 700-token block vs 512+188, 300+1+1+1+397 and
# 50 single tokens + 650; AMD EPYC, OpenBLAS; logits up to 34). A top-2 gap
# under 1e-3 (about 30x that) is a genuine near-tie that either path may break
# its own way; anything larger is a real difference.
NEAR_TIE_LOGIT = 1e-3


def assert_greedy_agree(model, prompt_ids, got, want, tol=NEAR_TIE_LOGIT):
    """Greedy token sequences from two block paths agree token for token, or
    first differ where the reference logits (one full-cache pass over the
    prompt and the agreed tokens) put the two choices within ``tol``."""
    got, want = [int(t) for t in got], [int(t) for t in want]
    if got == want:
        return
    n = min(len(got), len(want))
    i = next((k for k in range(n) if got[k] != want[k]), None)
    assert i is not None, f"one output is a prefix of the other: {got} vs {want}"
    logits = model(mx.array(list(prompt_ids) + want[:i])[None])[0, -1].astype(mx.float32)
    gap = abs(logits[want[i]].item() - logits[got[i]].item())
    assert gap <= tol, f"outputs differ at token {i} ({got[i]} vs {want[i]}) with a logit gap of {gap:.2e} > {tol}"


class RecordingModel:
    """A model that records every token block it is called with, then delegates."""

    def __init__(self, model):
        from knorm_gen.models.support import model_support

        model_support(model)  # the model check's own few tokens run now, not among the recorded calls
        self._model = model
        self.inputs = []

    def __call__(self, x, *args, **kwargs):
        self.inputs.append([int(t) for t in np.array(x).reshape(-1)])
        return self._model(x, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_model_dir(path, layers: int = 4, seed: int = 0, head_dim: int = 16):
    """An mlx_lm model folder (config, safetensors, tokenizer) holding a tiny random
    llama with a byte-level tokenizer: ``--model <path>`` loads it in any process,
    in well under a second, so runner tests need no real weights."""
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TINY_CHAT_TEMPLATE,
                                 eos_token="<|im_end|>", bos_token=None)
    hf.save_pretrained(str(path))
    vocab = tok.get_vocab_size()
    model = tiny_llama(layers=layers, seed=seed, vocab=vocab, head_dim=head_dim)
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                  vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_dir_64(tmp_path_factory):
    """The same tiny model with heads of 64: every kv_group_size divides it but 128."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model-64"), head_dim=64)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A fresh GGUF conversion cache (KNORM_CACHE_DIR) for one test module."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("knorm-cache")
        mp.setenv("KNORM_CACHE_DIR", str(root))
        yield root


def document_span(tokenizer, ids, text):
    """``(start, end)`` of ``text``'s own tokens inside prompt ``ids``, found by a plain
    search (an independent account of where the evictable document lies)."""
    sub = list(tokenizer.encode(text, add_special_tokens=False))
    ids = list(ids)
    for i in range(len(ids) - len(sub) + 1):
        if ids[i : i + len(sub)] == sub:
            return i, i + len(sub)
    raise AssertionError(f"{text!r} is not in the prompt's tokens")


def kept_after(seen, span, budget, n_sink=4):
    """Positions a compressed layer holds after ``seen`` positions when only the
    document ``span`` is evictable: everything else, and at most ``budget - n_sink``
    of the document's tokens past the sinks."""
    start, end = span
    evictable = max(0, end - max(start, n_sink))
    return seen - evictable + min(evictable, budget - n_sink)


# ---- numpy references of the anchored rules (test_rules.py, test_cache.py) ----------------


def numpy_anchored_score(keep, keys, anchor):
    """float64 reference of the anchored rules: keys (H, N, D), anchor (H, D)."""
    norm = np.linalg.norm(keys, axis=-1)
    cos = np.einsum("hnd,hd->hn", keys / norm[..., None], anchor / np.linalg.norm(anchor, axis=-1, keepdims=True))
    return cos if keep == "keydiff" else cos + BLEND_WEIGHT * np.log(norm)


class LeverageReference:
    """float64 reference of ``keep="leverage"`` for one row, from its definition:
    after each block, the score of a key is ``-(k - m)^T (C + lam I)^-1 (k - m)``
    with ``m`` the mean of every key seen and ``C`` their scatter about it (computed
    from all the keys, not updated); ``lam`` = LEVERAGE_RIDGE x trace(C) / D (at
    least 1e-6 x that share of |m|^2), set at every block of more than one token and
    at the decode steps that reach position 1, 2, 4, ... or a multiple of
    LEVERAGE_REFRESH, and held in between."""

    def __init__(self, keys):
        self.keys = keys[0].astype(np.float64)  # (H, T, D)
        self.seen, self.lam = 0, None

    def feed(self, size):
        self.seen += size
        s, dim = self.seen, self.keys.shape[2]
        seen_keys = self.keys[:, :s]
        self.mean = seen_keys.mean(axis=1)
        centred = seen_keys - self.mean[:, None]
        scatter = np.einsum("hnd,hne->hde", centred, centred)
        if size > 1 or s & (s - 1) == 0 or s % LEVERAGE_REFRESH == 0:
            trace = np.trace(scatter, axis1=1, axis2=2)
            self.lam = LEVERAGE_RIDGE / dim * np.maximum(trace, 1e-6 * (self.mean ** 2).sum(axis=-1))
        self.inv = np.linalg.inv(scatter + self.lam[:, None, None] * np.eye(dim))

    def scores(self):
        """``(H, seen)``: every position's score against the state after the last block."""
        x = self.keys[:, : self.seen] - self.mean[:, None]
        return -np.einsum("hnd,hde,hne->hn", x, self.inv, x)


def numpy_running_kept(keys, splits, budget, n_sink, recent, keep, margins=None):
    """Kept positions per head of one row fed in ``splits``, with the anchor the mean
    unit key of everything seen up to and including each block (``leverage``: its
    :class:`LeverageReference`); a block of more than one token first re-scores the
    held keys against that anchor (attend first, evict after: over budget, the
    ``budget`` best of held + new by (protected, score, position)). ``margins``: a
    list that gets, per eviction and head, the relative gap between the worst score
    kept and the best evicted (a near-tie float32 may break either way)."""
    lev = LeverageReference(keys) if keep == "leverage" else None
    keys = keys[0].astype(np.float64)
    heads, dim = keys.shape[0], keys.shape[2]
    total, seen, held = np.zeros((heads, dim)), 0, [[] for _ in range(heads)]
    for size in splits:
        block = keys[:, seen : seen + size]
        if lev is not None:
            lev.feed(size)
            every = lev.scores()
            scores = every[:, seen:]
        else:
            total += (block / np.linalg.norm(block, axis=-1, keepdims=True)).sum(axis=1)
            anchor = total / (seen + size)
            scores = numpy_anchored_score(keep, block, anchor)
        seen += size
        for h in range(heads):
            if size > 1 and held[h]:
                pos = [p for _, p in held[h]]
                if lev is not None:
                    again = every[h, pos]
                else:
                    again = numpy_anchored_score(keep, keys[h : h + 1, pos], anchor[h : h + 1])[0]
                held[h] = list(zip(again, pos))
            held[h] += [(scores[h, i], seen - size + i) for i in range(size)]
            if len(held[h]) > budget:
                held[h].sort(key=lambda sp: (0, sp[1]) if sp[1] < n_sink or sp[1] >= seen - recent else (1, *sp))
                if margins is not None:
                    free = [sc for sc, p in held[h] if n_sink <= p < seen - recent]
                    cut = budget - (len(held[h]) - len(free))
                    if 0 < cut < len(free):
                        margins.append(abs(free[cut] - free[cut - 1]) / max(abs(free[cut]), abs(free[cut - 1]), 1e-30))
                held[h] = held[h][:budget]
    return [sorted(p for _, p in h) for h in held]


# ---- knorm-batch on a folder, driven in-process (test_folder_input.py, test_hostile_outputs.py) ----------


def batch_args(model_dir) -> list:
    """Fast knorm-batch options on a tiny model folder: budget 16, two new tokens, rows alone, quiet."""
    return ["--model", str(model_dir), "--budget", "16", "--max-tokens", "2", "--batch-size", "1", "-q"]


def invoke_batch(*args):
    """knorm-batch in-process (click's CliRunner), every argument as text."""
    from click.testing import CliRunner

    from knorm_gen.cli.batch import batch_command

    return CliRunner().invoke(batch_command, [str(a) for a in args], catch_exceptions=False)


def write_files(root, files: dict):
    """Write ``{relative path: text or bytes}`` under ``root``; returns ``root``."""
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return root


# ---- shards: scripts/test.sh runs the suite as one pytest process per core --------------------------

DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds per test file, summed from one run of the whole suite on the 2-core machine
(``KNORM_TEST_SHARDS=3 PYTEST_ADDOPTS=--durations=0 bash scripts/test.sh``): what the shards
balance, so only their proportions matter."""

ONE_SHARD = ("test_distributed.py", "test_folder_input.py", "test_hostile_rows.py", "test_benchmarks.py")
"""Files that run ``mlx.launch``: its ranks meet on fixed local ports, so two launches at once would collide."""


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only shard K of N (test files balanced by tests/durations.json); "
                          "scripts/test.sh runs every shard at once")


def shard_files(files: list[str], n: int) -> list[set[str]]:
    """The test files of each of ``n`` shards: the mlx.launch files together in the first, then
    the rest, longest first, each to the shard with the least time so far (unknown files: 5 s)."""
    seconds = json.loads(DURATIONS.read_text())
    shards: list[set[str]] = [set() for _ in range(n)]
    load = [0.0] * n
    for f in [f for f in files if f in ONE_SHARD]:
        shards[0].add(f)
        load[0] += seconds.get(f, 5.0)
    for f in sorted((f for f in files if f not in ONE_SHARD), key=lambda f: (-seconds.get(f, 5.0), f)):
        i = load.index(min(load))
        shards[i].add(f)
        load[i] += seconds.get(f, 5.0)
    return shards


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--shard takes K/N with 1 <= K <= N, e.g. 1/2; got {spec!r}") from None
    names = sorted({Path(str(item.fspath)).name for item in items})
    mine = shard_files(names, n)[k - 1]
    keep = [item for item in items if Path(str(item.fspath)).name in mine]
    config.hook.pytest_deselected(items=[item for item in items if Path(str(item.fspath)).name not in mine])
    items[:] = keep
