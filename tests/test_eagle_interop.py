"""EAGLE-3 heads other engines read and heads they wrote: a one-layer Llama config.json (transformers' AutoConfig),
RoPE scaling read as transformers reads it, pytorch_model.bin weights, tapped layers in ascending order, and
EAGLE-3's training loss (7 chained steps, step j weighted 0.8^j)."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from saguaro import LLM, SamplingParams
from saguaro.eagle.checkpoint import (Eagle3Config, EagleCheckpointError, default_taps, load_eagle3,
                                      load_eagle3_config, save_eagle3)
from saguaro.eagle.head import load_head
from saguaro.eagle.train import TrainSettings, draft_index, new_head, pick_vocabulary, ttt_forward, ttt_loss
from tests.eagle_heads import random_head_state
from tests.test_eagle_train import examples_for
from tests.tiny import PROMPTS, greedy_tokens, tiny_model

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}  # wavelengths of 16-dim heads fall in all three bands


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, layers=4, sharpness=3.0)


def test_a_saved_head_is_one_llama_layer_to_transformers(target, tmp_path):
    cfg, state = random_head_state(target, draft_vocab=40)
    cfg.taps = default_taps(4)
    save_eagle3(tmp_path, cfg, state)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "llama" and hf.num_hidden_layers == 1 and hf.hidden_act == "silu"
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads) == (64, 4, 2)
    assert hf.draft_vocab_size == 40 and hf.eagle_aux_hidden_state_layer_ids == [1, 2, 2]


def test_llama3_rope_scaling_gives_transformers_frequencies(target, tmp_path):
    """The head's inverse frequencies equal transformers' Llama rotary init on the config.json we wrote; a head
    that ignored the scaling (the negative control) would not."""
    cfg, state = random_head_state(target)
    cfg.rope_theta, cfg.rope_scaling = 500000.0, dict(LLAMA3_SCALING)
    save_eagle3(tmp_path, cfg, state)
    theirs = LlamaRotaryEmbedding(transformers.AutoConfig.from_pretrained(tmp_path)).inv_freq
    head = load_head(str(tmp_path), target.model)
    assert head.config.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(head.rotary.inv_freq, theirs, rtol=1e-6, atol=0)
    plain = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=500000.0)
    assert not torch.allclose(LlamaRotaryEmbedding(plain).inv_freq, theirs)


def test_rope_parameters_of_transformers_5_are_read(target, tmp_path):
    cfg, state = random_head_state(target)
    save_eagle3(tmp_path, cfg, state)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_theta"), raw.pop("rope_scaling")
    raw["rope_parameters"] = {**LLAMA3_SCALING, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    read = load_eagle3_config(tmp_path)
    assert read.rope_theta == 500000.0 and read.rope_scaling["factor"] == 8.0


def test_pytorch_model_bin_loads_the_same_head(target, tmp_path):
    """The EAGLE authors' releases ship pytorch_model.bin under midlayer.* names."""
    cfg, state = random_head_state(target, draft_vocab=40, seed=5)
    save_eagle3(tmp_path, cfg, state)
    (tmp_path / "model.safetensors").unlink()
    torch.save({("midlayer." + n[len("layer."):] if n.startswith("layer.") else n): t for n, t in state.items()},
               tmp_path / "pytorch_model.bin")
    _, normalized, layout = load_eagle3(tmp_path)
    assert layout == "midlayer"
    head = load_head(str(tmp_path), target.model)
    for name, value in state.items():
        assert torch.equal(head.state_dict()[name], value), name


def test_a_bin_that_is_no_state_dict_is_refused(target, tmp_path):
    cfg, state = random_head_state(target)
    save_eagle3(tmp_path, cfg, state)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(EagleCheckpointError, match="no weights"):
        load_eagle3(tmp_path)
    torch.save({"fc.weight": torch.zeros(1), "code": Eagle3Config}, tmp_path / "pytorch_model.bin")  # a class
    with pytest.raises(EagleCheckpointError, match="weights-only"):
        load_eagle3(tmp_path)


def test_tapped_layers_are_ascending(target, tmp_path):
    assert default_taps(32) == [2, 16, 29] and default_taps(4) == [1, 2, 2]
    cfg, state = random_head_state(target)
    cfg = dataclasses.replace(cfg, taps=[3, 0, 2])
    assert cfg.taps == [0, 2, 3]
    save_eagle3(tmp_path, cfg, state)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    raw["eagle_aux_hidden_state_layer_ids"] = [3, 0, 2]  # as another tool may write them
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_eagle3_config(tmp_path).taps_for(4) == [0, 2, 3]
    expected = greedy_tokens(target, PROMPTS, 12)
    with LLM(target=target, draft=str(tmp_path), mode="sd", num_speculative_tokens=3, block_size=4) as llm:
        assert llm.engine.decoder.proposer.head.taps == [0, 2, 3]
        assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12))] == expected


def test_training_loss_weights_step_j_by_0_8_to_the_j(target):
    """The loss is sum_j 0.8^j CE_j, each CE_j recomputed here from the logits and the target's top-k labels."""
    assert TrainSettings().ttt_steps == 7
    examples = examples_for(target, n=1, length=12)
    head = new_head(target.model, pick_vocabulary(examples, 48, target.config.vocab_size))
    ex, steps = examples[0], 3
    with torch.no_grad():
        loss, _ = ttt_loss(head, ex, steps, draft_index(head))
        logits, positions = ttt_forward(head, ex, steps)
    n = len(ex.tokens) - 1
    to_draft = draft_index(head)
    expected = 0.0
    for j, (step_logits, pos) in enumerate(zip(logits, positions)):
        ces = []
        for row in range(n):
            if pos[row] > n:
                continue
            label = torch.zeros(step_logits.shape[1])
            for tid, p in zip(ex.top_ids[pos[row]].tolist(), ex.top_probs[pos[row]].tolist()):
                if to_draft[tid] >= 0:
                    label[to_draft[tid]] += p
            if label.sum() > 0:
                ces.append(-(label / label.sum() * F.log_softmax(step_logits[row], -1)).sum())
        expected += 0.8 ** j * torch.stack(ces).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
