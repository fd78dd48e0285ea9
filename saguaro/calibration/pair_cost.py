"""Without a calibration profile: a draft step's cost relative to a verification, from the pair's weight bytes.

On the CPU a decode pass streams every weight once, so its time follows its bytes (``pass_bytes``: the packed
formats, the draft's reduced head) plus a fixed cost per pass (Python, dispatch, attention, the epilogues),
counted here as ``PASS_OVERHEAD_BYTES`` of weights. The documented default (``DEFAULTS["draft_ratio"]``, 0.38)
describes a draft about a third the target's size; a pair whose draft streams a tenth of the target's bytes
(the 0.5B in int4 beside the 1.5B in bf16: 0.09) would otherwise be modelled as three times too dear, and every
request that chooses K from the profile alone (a seeded sampled one: ``AdaptiveK``) would speculate too
little. So the estimate replaces the default where it is lower; where it is higher (a draft as large as its
target, the tests' tiny pairs, whose passes are all overhead) the default stands. On a GPU passes of small
models are bound by their launches rather than their bytes: the default stands there too.
"""
from __future__ import annotations

import logging

from saguaro.calibration.profile import DEFAULTS
from saguaro.config import Config

log = logging.getLogger("saguaro.calibration")

PASS_OVERHEAD_BYTES = 32 << 20  # about 1.5 ms of a pass that is not its weights, at ~20 GB/s


def byte_ratio(target_bytes: int, draft_bytes: int) -> float:
    return (draft_bytes + PASS_OVERHEAD_BYTES) / (target_bytes + PASS_OVERHEAD_BYTES)


def draft_ratio(cfg: Config) -> float | None:
    """The default profile's draft cost for ``cfg``'s pair: the weight-byte estimate where it is below the
    documented default, None (the default) otherwise, on a GPU, or where either model's config cannot be read
    (an n-gram matcher, an EAGLE-3 head, a model given in memory)."""
    if cfg.device != "cpu" or cfg.draft_device not in (None, "cpu") or not isinstance(cfg.draft, str):
        return None
    from saguaro.backends.cpu_kernels.model import pass_bytes
    from saguaro.loading import load_config
    try:
        target, draft = load_config(cfg.target, progress=False), load_config(cfg.draft, progress=False)
    except (OSError, ValueError, LookupError, RuntimeError):  # not a model we can read: the defaults apply
        return None
    fmt = cfg.draft_format
    head = min(fmt.vocab, draft.vocab_size) if fmt.vocab is not None else draft.vocab_size
    ratio = byte_ratio(pass_bytes(target, cfg.target_weights), pass_bytes(draft, fmt.weights, head))
    if ratio >= DEFAULTS["draft_ratio"]:
        return None
    log.info("no calibration profile: a draft step is taken as %.3f of a verification (the pair's weight bytes)",
             ratio)
    return ratio
