"""Verification: exact rejection sampling of drafted tokens against the target."""
from saguaro.verify.rejection import VerifyResult, rejection_sample, rejection_sample_tensors

__all__ = ["VerifyResult", "rejection_sample", "rejection_sample_tensors"]
