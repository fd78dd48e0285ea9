"""What every stored profile shares (the calibration's, the GPU lanes'): the error for one this engine cannot
read, the check of its keys against a dataclass, and the file-name slug of a model or card name."""
from __future__ import annotations

import os
import re
from dataclasses import MISSING, fields
from typing import Any


class ProfileError(ValueError):
    """A stored profile this engine cannot read: another version, or keys that do not match the schema."""


def checked_fields(cls: type, data: Any, where: str) -> dict:
    """``data`` as keyword arguments of ``cls``; ``ProfileError`` naming the keys that do not match."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where} is {type(data).__name__}, not an object")
    known = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    unknown, missing = sorted(set(data) - known), sorted(required - set(data))
    if unknown or missing:
        raise ProfileError(f"{where} " + "; ".join(([f"lacks {missing}"] if missing else [])
                                                  + ([f"has unknown keys {unknown}"] if unknown else [])))
    return dict(data)


def slug(name: str) -> str:
    """``name`` (a registry name, a path, a card) as a file-name part."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(str(name).rstrip("/")) or str(name))
