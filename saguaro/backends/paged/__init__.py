"""The paged backend, the GPU path: everything it runs, in one place.

=====================  ===============================================================================
metadata.py            ``PagedMetadata`` (block tables, per-row visibility) and a pass's paged form
model.py               ``PagedCausalLM``: the model in a few fused ops per layer (``ops_for`` picks them)
ops_torch.py           RMSNorm, RoPE + KV store, SiLU-mul: torch references (any device)
ops_triton.py          the same ops as Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``)
attention_rows.py      the per-row form of paged attention, and the checks both kernels share
attention_torch.py     paged attention in torch (the reference; the CPU stand-in)
attention_triton.py    paged attention as a split-K Triton kernel (``attention_kernels.py``)
graphs.py              CUDA graphs per row bucket, and their CPU stand-in
backend.py             ``PagedBackend``: replays a graph where a pass fits one, else runs eagerly
=====================  ===============================================================================

Importing this package imports neither triton nor CUDA.
"""
