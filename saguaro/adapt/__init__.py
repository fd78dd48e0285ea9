"""Speculation that adapts to each request as it runs: a running acceptance estimate per request
(``estimate.py``) and, each round, the K (0 = AR) with the best predicted speed (``speed.py``) from the measured
pass costs (``costs.py``), chosen by ``schedule.AdaptiveK``; ``build.k_schedule`` makes the engine's from its
Config. The settings live beside the package (``saguaro.adapt_settings``, as ``ssd_settings``): Config reads them.
"""
