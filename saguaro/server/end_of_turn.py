"""The token a chat template ends an assistant turn with (``<|im_end|>``, ``<|eot_id|>``, ...).

A chat model ends its answer with it, and it need not be one of the tokenizer's EOS ids (SmolLM2's
EOS is ``<|endoftext|>``; its turns end with ``<|im_end|>``): chat requests stop on it too, so the
answer ends there and the marker never reaches the content.
"""
from __future__ import annotations

from saguaro.loading.tokenizer import Tokenizer

_MARK = "\u2063saguaro-turn\u2063"  # content no template rewrites, found again in the rendering


def end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    """The special tokens the template writes right after an assistant message's content (often one); [] when it
    writes none or has no template."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": _MARK}], add_generation_prompt=False)
    except Exception:  # no template, or one that refuses this conversation: nothing to add
        return []
    if _MARK not in text:
        return []
    special = set(tokenizer.special_ids())
    ids = []
    for token in tokenizer.encode(text.split(_MARK, 1)[1].lstrip(" "), add_special_tokens=False):
        if token not in special:
            break
        ids.append(token)
    return ids
