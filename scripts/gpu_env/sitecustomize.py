"""Imports as on the GPU machine: every installed package it lacks raises ModuleNotFoundError.

``scripts/gpu_check.sh --dry-run`` puts this folder first on ``PYTHONPATH``, so Python runs this file at
start-up. The GPU machine has python3 with the packages in ``GPU_MACHINE`` (``/work/shared/GPU.md``) and
whatever they require; ``pytest`` runs the check, and ``SAGUARO_GPU_CARRIED`` names the packages that travel
as wheels (``scripts/gpu_wheels.sh``). Every other installed distribution is hidden: a module whose top-level
name only such distributions provide cannot be imported. The standard library and this checkout are untouched.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata as md
import os
import re
import site
import sys

GPU_MACHINE = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "jinja2", "tqdm", "rich")
CHECK_TOOLS = ("pytest",)
OWN = "saguaro"  # this checkout, which travels with the check (its own requirements do not)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: md.Distribution) -> list[str]:
    """Names of what ``dist`` requires outside any extra (markers evaluated for this interpreter)."""
    from packaging.requirements import Requirement
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def available() -> set[str]:
    """Normalized names of the distributions the GPU machine has: the roots and everything they require."""
    installed = {_norm(d.metadata["Name"]): d for d in md.distributions() if d.metadata["Name"]}
    carried = [x for x in os.environ.get("SAGUARO_GPU_CARRIED", "").split(",") if x.strip()]
    todo = [_norm(n) for n in GPU_MACHINE + CHECK_TOOLS + tuple(carried)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in installed:
            continue
        seen.add(name)
        todo += [_norm(r) for r in _requirements(installed[name])]
    return seen


def hidden_modules() -> set[str]:
    """Top-level module names that only distributions missing on the GPU machine provide."""
    keep = available() | {OWN}
    return {top for top, dists in md.packages_distributions().items()
            if not any(_norm(d) in keep for d in dists)}


SITE = {os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}


def _outside_site(path):
    return [p for p in (sys.path if path is None else path) if p and os.path.realpath(p) not in SITE]


class _Hide(importlib.abc.MetaPathFinder):
    """Stands in for the finders present at start-up: finds nothing hidden, so an import fails as on the GPU
    machine and ``importlib.util.find_spec`` (how libraries probe for optional packages) answers None."""

    def __init__(self, names: set[str], finders: list):
        self.names = names
        self.finders = finders

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            # a hidden name may still come from a library's own vendored copy (setuptools appends its _vendor
            # folder to sys.path): search every path entry but the installed distributions' folders
            return importlib.machinery.PathFinder.find_spec(fullname, _outside_site(path), target)
        for finder in self.finders:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, *args, **kwargs):
        """Package metadata stays visible (installed is not importable, as with a broken install)."""
        for finder in self.finders:
            if hasattr(finder, "find_distributions"):
                yield from finder.find_distributions(*args, **kwargs)

    def invalidate_caches(self) -> None:
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


sys.meta_path[:] = [_Hide(hidden_modules(), list(sys.meta_path))]
