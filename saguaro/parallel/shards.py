"""Loading one rank's shard: each rank reads only the slices its shard names.

A registry name or a path is read by slice from its safetensors file(s) (a GGUF goes through the
converted cache first, so it is dequantized once and then sliced like any safetensors file); a model
already in memory (``LoadedModel``, or one shared with a rank's process through a ``SharedFile``) is
sliced in place. Replicated tensors (norms) are read whole.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open

from saguaro.loading import LoadedModel, locate_weights
from saguaro.loading.hf_loader import read_config, read_tokenizer, weight_files
from saguaro.loading.model_builder import build_model
from saguaro.models.model_config import ModelConfig
from saguaro.parallel.groups import TPGroups
from saguaro.parallel.layers import TPCausalLM
from saguaro.parallel.rank_shard import RankShard, Slice, rank_shard
from saguaro.workers.shipment import Shipment


def cut(read: Callable[[Slice | None], torch.Tensor], s: Slice | None) -> torch.Tensor:
    """The slice ``s`` that ``read`` returns, zero-padded along its dim to ``s.size`` (the last vocab shard)."""
    t = read(s)
    if s is None or t.shape[s.dim] == s.size:
        return t
    pad = list(t.shape)
    pad[s.dim] = s.size - t.shape[s.dim]
    return torch.cat([t, t.new_zeros(pad)], dim=s.dim)


def shard_state(state: Mapping[str, torch.Tensor], shard: RankShard, vocab_size: int) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor in a whole state dict (views: nothing is copied but padding)."""
    def reader(t: torch.Tensor) -> Callable[[Slice | None], torch.Tensor]:
        return lambda s: t if s is None else t.narrow(s.dim, s.start, s.stop - s.start)
    return {name: cut(reader(t), shard.slice_for(name, vocab_size)) for name, t in state.items()}


def read_shard(files: list[Path], shard: RankShard, vocab_size: int) -> dict[str, torch.Tensor]:
    """This rank's slices read from safetensors files: only those bytes are read."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)

                def read(s: Slice | None, part=part) -> torch.Tensor:
                    if s is None:
                        return part[:]
                    return part[s.start:s.stop] if s.dim == 0 else part[:, s.start:s.stop]
                state[name] = cut(read, shard.slice_for(name, vocab_size))
    return state


def build_shard(config: ModelConfig, state: Mapping[str, torch.Tensor], groups: TPGroups, dtype: torch.dtype,
                device: torch.device | str, sliced: bool = False) -> TPCausalLM:
    """This rank's ``TPCausalLM`` holding its slices of ``state`` (a whole state dict, or this rank's slices
    already when ``sliced``)."""
    shard = rank_shard(config, groups.world, groups.rank)
    if not sliced:
        state = shard_state(state, shard, config.vocab_size)
    return build_model(config, state, dtype, device, make=lambda cfg: TPCausalLM(cfg, shard, groups))  # type: ignore


def load_shard(source: Any, groups: TPGroups, dtype: torch.dtype, device: torch.device | str,
               progress: bool = True) -> LoadedModel:
    """This rank's shard of ``source``: a registry name or path (read by slice), a ``LoadedModel`` in memory,
    or a ``Shipment`` of either (``saguaro.workers``)."""
    if isinstance(source, LoadedModel):
        model = build_shard(source.config, source.model.state_dict(), groups, dtype, device)
        return LoadedModel(source.name, source.config, model, source.tokenizer, source.source,
                           source.weights_dir, source.cache_hit)
    if isinstance(source, Shipment) and source.name is not None:
        source = source.name
    if isinstance(source, Shipment):  # a model shared in memory
        saved = source.saved()
        model = build_shard(saved["config"], saved["state"], groups, dtype, device)
        return LoadedModel(saved["name"], saved["config"], model, saved["tokenizer"], Path("."), Path("."), True)
    name, path, weights_dir, hit, weights_name = locate_weights(source, dtype, progress)
    config = read_config(weights_dir)
    state = read_shard(weight_files(weights_dir, weights_name), rank_shard(config, groups.world, groups.rank),
                       config.vocab_size)
    model = build_shard(config, state, groups, dtype, device, sliced=True)
    return LoadedModel(name, config, model, read_tokenizer(weights_dir, config), path, weights_dir, hit)


def read_whole(source: str, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint tensor ``name`` of the model ``source`` names, whole (e.g. the embedding table an EAGLE-3 head
    reads, which no rank holds whole)."""
    _, _, weights_dir, _, weights_name = locate_weights(source, dtype, progress=False)
    for path in weight_files(weights_dir, weights_name):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name).to(dtype)
    raise KeyError(f"{source} has no tensor {name}")
