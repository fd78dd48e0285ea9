"""Speculation that adapts to each request as it runs: a running acceptance estimate per request
(``estimate.py``) and, each round, the K (0 = AR) with the best predicted speed (``speed.py``) from the measured
pass costs (``costs.py``), chosen by ``schedule.AdaptiveK`` over what it holds (``state.py``); in SSD also the
round's cache tree among the plan's and a few more fixed at start-up (``trees.py``), each scored by what it
predicts (``tree_choice.py``), and the depth of the batch's build, which caps every request's K (``depth.py``);
``build.k_schedule`` / ``build.ssd_schedule`` make the engine's from its Config. The settings live beside the
package (``saguaro.adapt_settings``, as ``ssd_settings``): Config reads them.
"""
