"""Paged attention in the per-row form (``paged_rows.py``): a torch reference and a Triton GPU kernel.

``paged_attention_torch`` runs anywhere (the CPU stand-in and CI reference); ``paged_attention_triton``
is the GPU fast path, capturable in a CUDA graph. Both take the same arguments and return the same result.
"""
from saguaro.attention.paged_torch import paged_attention_torch
from saguaro.attention.paged_triton import choose_splits, paged_attention_triton

__all__ = ["paged_attention_torch", "paged_attention_triton", "choose_splits"]
