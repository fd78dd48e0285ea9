"""Fused per-layer ops of the GPU model: ``fused_torch`` (the reference) and ``fused_triton`` (the kernels)."""
