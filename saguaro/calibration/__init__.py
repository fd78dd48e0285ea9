"""Calibration of a target/draft pair and the choices made from it (paper Secs. 4.1-4.3).

``profile`` -- the stored profile (JSON in the cache directory, keyed by target/draft/dtype) and the
documented defaults used when there is none; ``measure`` -- ``calibrate(...)``: acceptance, per-depth
cache-hit curves from bonus-token ranks, power-law fits, timings; ``policy`` -- fan-outs (Thm 12 / 13),
branch budget, Saguaro C, K and the critical batch size b* (Thm 18) from a profile.
"""
from saguaro.calibration.profile import default_profile, load_profile, profile_path, save_profile

__all__ = ["default_profile", "load_profile", "profile_path", "save_profile"]
