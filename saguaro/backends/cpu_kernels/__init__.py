"""The CPU-kernel backend: packed weights and C++ kernels for bf16 models on CPU.

  * ``model.py``: ``FastCausalLM``, the eager model's forward over packed weights;
  * ``build.py``: builds and loads the C++ extension on first use;
  * ``csrc/``: the C++ kernels.
"""
