"""The training teacher's attention is the model's own, for every family kvchat serves: q/k norms (Qwen3, Gemma3),
the query scale and logit softcap (Gemma2), per-layer RoPE, compared with transformers' eager attention."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import random_ids, tiny_model, with_kvchat_attention

from kvchat.config import IndexMemConfig, TrainConfig
from kvchat.errors import UserError
from kvchat.kv.indexer import Indexer, IndexMemShape
from kvchat.kv.methods import SNAPKV_QUERIES
from kvchat.training import train
from kvchat.training.chunks import Chunk
from kvchat.training.memory_stage import memory_targets
from kvchat.training.teacher import capture, layer_attention

FAMILIES = ["llama", "qwen3", "gemma2", "gemma3"]
# Gemma3 keeps `attn_logit_softcapping` in its config but does not pass it to attention: the teacher follows the
# model, not the config.
VARIANTS = [(arch, {}) for arch in FAMILIES] + [("gemma3", {"attn_logit_softcapping": 0.5})]
N = 96


def _eager_run(model, ids) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[tuple]]:
    """The model under transformers' eager attention: each layer's softmax weights `[q_heads, n, n]`, attention
    output before o_proj `[n, q_heads * d]`, attention input and position embeddings."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    outputs, inputs = {}, {}

    def before_o_proj(module, args):
        outputs[module.layer] = args[0][0]

    def before_attention(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"][0], kwargs["position_embeddings"])

    handles = []
    for index, layer in enumerate(eager.model.layers):
        layer.self_attn.o_proj.layer = index
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(before_o_proj))
        handles.append(layer.self_attn.register_forward_pre_hook(before_attention, with_kwargs=True))
    with torch.no_grad():
        weights = eager(input_ids=ids, output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    layers = range(len(weights))
    return ([w[0] for w in weights], [outputs[i] for i in layers], [inputs[i][0] for i in layers],
            [inputs[i][1] for i in layers])


@pytest.mark.parametrize(("arch", "settings"), VARIANTS, ids=lambda v: v if isinstance(v, str) else "softcap" * bool(v))
def test_the_teachers_logits_are_the_models_attention(arch, settings):
    """Softmax of the teacher's logits is eager attention's weights, layer by layer and row by row; the held-out
    SnapKV-like score `capture` derives from them too. A teacher without the family's q/k norms or softcap
    (queries and keys rebuilt from the projections) fails here for Qwen3, Gemma2 and Gemma3."""
    model = with_kvchat_attention(tiny_model(arch, **settings))
    ids = random_ids(N)
    weights, _, hidden, rope = _eager_run(model, ids)
    captured = capture(SimpleNamespace(model=model), Chunk(ids[0], 4, "test"), with_snapkv=True)
    for layer, expected in enumerate(weights):
        logits = layer_attention(model, layer, hidden[layer], rope[layer]).logits()      # [kv, group, n, n]
        assert torch.allclose(logits.softmax(-1).flatten(0, 1), expected, atol=1e-5), f"layer {layer}"
        snapkv = expected[:, -SNAPKV_QUERIES:].mean(1).unflatten(0, (logits.shape[0], -1)).amax(1)
        assert torch.allclose(captured.snapkv[layer], snapkv, atol=1e-5), f"layer {layer}"
        assert torch.allclose(captured.teacher[layer], logits.amax(dim=(1, 2)), atol=1e-4), f"layer {layer}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_memory_stage_reads_the_models_attention_outputs(arch):
    """With nothing evicted (a budget above the chunk) what the memory's readers attend to is the model's own
    attention output, and the memory sees the keys the model caches, unrotated (after the q/k norms)."""
    model = with_kvchat_attention(tiny_model(arch))
    ids = random_ids(N)
    _, outputs, _, _ = _eager_run(model, ids)
    lm = SimpleNamespace(model=model)
    item = capture(lm, Chunk(ids[0], 4, "test"))
    config = TrainConfig(memory_queries=16, memory_block=32, memory_budgets=(N,))
    targets = memory_targets(lm, Indexer(IndexMemShape.of(model.config)), item, N, config, IndexMemConfig())
    for layer, output in enumerate(outputs):
        readers = output[-16:].unflatten(-1, (model.config.num_attention_heads, -1)).transpose(0, 1)
        assert torch.allclose(targets.attended[layer].float(), readers, atol=2e-3, rtol=1e-2), f"layer {layer}"
        assert not targets.residual[layer].any()
        attention = model.model.layers[layer].self_attn
        keys = attention.k_proj(item.hidden[layer].float()[:-16]).unflatten(-1, (model.config.num_key_value_heads,
                                                                                 -1))
        if hasattr(attention, "k_norm"):
            keys = attention.k_norm(keys)
        assert torch.allclose(targets.keys[layer].float(), keys.transpose(0, 1).detach(), atol=2e-3, rtol=1e-2)


def test_chunks_longer_than_a_sliding_window_are_refused_in_one_line(tmp_path):
    """kvchat's attention shows a layer the whole chunk: past a sliding window that is not the model's teacher."""
    lm = SimpleNamespace(model=tiny_model("gemma2", sliding_window=64), spec="tiny-gemma2")
    with pytest.raises(UserError, match="sliding-window attention layers of 64 tokens: train on chunks of at most 64"
                       ) as caught:
        train(lm, tmp_path / "w.indexmem.safetensors", TrainConfig(chunk_tokens=96))
    assert "\n" not in str(caught.value) and not (tmp_path / "w.indexmem.safetensors").exists()
