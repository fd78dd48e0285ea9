"""Calibration of a target/draft pair and the choices made from it (paper Secs. 4.1-4.3).

``profile`` -- what a calibration measured, as typed dataclasses (``Profile``), and the documented defaults
used when there is none; ``store`` -- where profiles live (JSON in the cache directory, keyed by
target/draft/format/dtype/fast path/workload) and which one the engine reads; ``measure`` --
``calibrate(...)``: acceptance, per-depth cache-hit curves from bonus-token ranks, power-law fits, timings;
``policy`` -- fan-outs (Thm 12 / 13), branch budget, Saguaro C, K and the critical batch size b* (Thm 18)
from a profile; ``resolve`` -- the engine's "auto" settings from the pair's profile.
"""
from saguaro.calibration.profile import Profile, default_profile
from saguaro.calibration.store import load_profile, profile_path, resolve_profile, save_profile

__all__ = ["Profile", "default_profile", "load_profile", "profile_path", "resolve_profile", "save_profile"]
