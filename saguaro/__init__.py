"""Saguaro: lossless speculative speculative decoding (SSD) in PyTorch."""
from saguaro.sampling.params import SamplingParams
from saguaro.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
