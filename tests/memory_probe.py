"""What the host-memory tests read (not a test file): the resident part of a file's mappings, and a model's
first logits."""
from __future__ import annotations

import torch

from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata


def mapped_resident(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) > 5 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def first_logits(net, config) -> torch.Tensor:
    """Logits of a 20-token prefill and one decode step, as an engine's first rounds run them."""
    cache = KVCache(config, 4, 16, torch.bfloat16)
    ids = torch.arange(3, 24) * 37 % config.vocab_size
    with torch.inference_mode():
        first = net.logits(net(ids[:20], torch.arange(20), cache, build_metadata([list(range(20))], [20])))
        step = net.logits(net(ids[20:], torch.arange(20, 21), cache, build_metadata([list(range(21))], [1])))
    return torch.cat((first, step))
