"""The question rule's ``question_key_bias="remove"``: on a model whose key projection has a bias
(Qwen2), the cached keys' bias part is the key a model with that bias zeroed would cache, less
nothing else; scoring without it equals scoring the zero-bias model's keys. The reference is the
model itself run twice (with its bias and with the bias set to zero), not the rule's own formula.
On a model without a key bias the setting changes nothing; at its default it stays out of the
record, so records written before it keep their fingerprints."""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from knorm_gen import EvictionConfig
from knorm_gen.eviction.rules.question import PROBE_SINK, Probe, Question, ProbeBatch, make_probe

from . import zoo

IDS = [(7 * i + 3) % 200 + 5 for i in range(96)]
START, END = PROBE_SINK, 80  # the document; the rest is the request the probe reads


def cached_keys(model, layer=0):
    cache = make_prompt_cache(model)
    model(mx.array(IDS)[None], cache=cache)
    return cache[layer].state[0].astype(mx.float32)


def with_key_bias(model, scale):
    """The model with layer 0's key bias multiplied by ``scale`` (0: none)."""
    attn = model.layers[0].self_attn
    attn.k_proj.bias = attn.k_proj.bias * scale
    return model


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids)) + ("." if ids and ids[-1] % 9 == 0 else "")


def test_the_bias_part_is_what_a_zero_bias_model_caches_less():
    model = with_key_bias(zoo.tiny_model("qwen2"), 40.0)  # Qwen2's first layers hold biases of norm 100-300
    keys = cached_keys(model)
    probe = make_probe(model, Tok(), IDS, [(START, END)])[0]
    assert probe.key_bias is not None
    positions = mx.arange(START, END)[None]
    bias_part = probe.key_bias.at(positions)
    content = cached_keys(with_key_bias(model, 0.0))[:, :, START:END]  # layer 0's keys without the bias
    got, want = np.array(keys[:, :, START:END] - bias_part), np.array(content)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(np.array(keys)).max()

    # scoring without the bias part is scoring the zero-bias keys; with it, another ranking
    state = ProbeBatch.stack([probe])
    pos3 = positions[:, None, :]
    removed = np.array(Question(key_bias="remove").score(keys[:, :, START:END], pos3, state))
    plain = np.array(Question().score(mx.array(want), pos3, state))
    kept = np.array(Question().score(keys[:, :, START:END], pos3, state))
    assert np.allclose(removed, plain, atol=1e-3)
    assert not np.allclose(kept, plain, atol=1e-3)


def test_no_key_bias_no_change_and_the_record_names_it_only_when_set():
    model = zoo.tiny_model("llama")
    probe = make_probe(model, Tok(), IDS, [(START, END)])[0]
    assert isinstance(probe, Probe) and probe.key_bias is None
    keys = cached_keys(model)[:, :, START:END]
    state, pos3 = ProbeBatch.stack([probe]), mx.arange(START, END)[None, None, :]
    # two runs of one computation may round apart where BLAS splits it differently (DESIGN.md section 4)
    assert np.allclose(np.array(Question(key_bias="remove").score(keys, pos3, state)),
                       np.array(Question().score(keys, pos3, state)), atol=1e-4)
    assert "question_key_bias" not in EvictionConfig().to_dict()
    assert EvictionConfig(question_key_bias="remove").to_dict()["question_key_bias"] == "remove"
    assert EvictionConfig(question_key_bias="remove") != EvictionConfig()
