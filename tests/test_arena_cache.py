"""The packed arena cached on disk: used on the second load, rebuilt (logged, never used) when truncated, corrupted,
stale or of another version, safe when two processes load at once, and never made for weights built in memory.

Every check compares logits with an arena packed from the weights (the cache off), bit for bit.
"""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from saguaro.backends.cpu_kernels import arena_cache, build as kernels
from saguaro.backends.cpu_kernels.model import FastCausalLM
from saguaro.host_memory import MappedPages
from saguaro.loading import load_model
from tests.memory_probe import first_logits
from tests.tiny import save_hf, tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels (AVX2 or better)")
FORMATS = [("bf16", None), ("int4", None), ("int8", torch.arange(0, 512, 3))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    loaded = tiny_model(seed=6, vocab=512, layers=2, hidden=256, sharpness=4.0)
    return save_hf(loaded, tmp_path_factory.mktemp("arena-model"), torch.bfloat16)


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    monkeypatch.delenv(arena_cache.ENV, raising=False)
    return tmp_path


def fast(model_dir, weights="bf16", head_ids=None):
    loaded = load_model(model_dir, dtype=torch.bfloat16, progress=False)
    model = FastCausalLM(loaded.model, weights, head_ids)
    arena_cache.wait_for_stores()  # the store runs in the background
    return model, loaded.config


@pytest.fixture(scope="module")
def packed(model_dir, tmp_path_factory):
    """Logits per format from an arena packed from the weights (no cache)."""
    os.environ[arena_cache.ENV] = "off"
    try:
        return {w: first_logits(*fast(model_dir, w, ids)) for w, ids in FORMATS}
    finally:
        del os.environ[arena_cache.ENV]


def arena_files(root):
    return sorted((root / "arenas").glob("*.arena"))


@pytest.mark.parametrize("weights,head_ids", FORMATS)
def test_second_load_maps_the_cached_arena(model_dir, packed, cache, caplog, monkeypatch, weights, head_ids):
    first, cfg = fast(model_dir, weights, head_ids)
    (path,) = arena_files(cache)
    assert MappedPages().path(first.arena) is None  # the first load packed into its own memory
    caplog.set_level("INFO", "saguaro.fast")
    packs = []
    monkeypatch.setattr(MappedPages, "release", lambda self, *tensors: packs.append(tensors))
    second, _ = fast(model_dir, weights, head_ids)
    assert MappedPages().path(second.arena) == str(path)
    assert "mapped the packed" in caplog.text and not packs  # nothing packed, no weight read
    assert torch.equal(first_logits(second, cfg), packed[weights])
    assert torch.equal(first_logits(first, cfg), packed[weights])


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(arena_cache.HEADER + (path.stat().st_size - arena_cache.HEADER) // 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))


def _garble_header(path):
    with open(path, "r+b") as f:
        f.write(b"{not json")


def _stale(model_dir):
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the weights changed since the arena


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "garbled header", "other version", "stale"])
def test_a_damaged_arena_is_rebuilt_never_used(model_dir, packed, cache, caplog, monkeypatch, damage):
    fast(model_dir)
    (path,) = arena_files(cache)
    if damage == "truncated":
        _truncate(path)
    elif damage == "flipped byte":
        _flip(path)
    elif damage == "garbled header":
        _garble_header(path)
    elif damage == "other version":
        monkeypatch.setattr(arena_cache, "ARENA_VERSION", arena_cache.ARENA_VERSION + 1)
    else:
        _stale(model_dir)
    caplog.set_level("INFO", "saguaro.fast")
    rebuilt, cfg = fast(model_dir)
    assert "packing again" in caplog.text
    assert MappedPages().path(rebuilt.arena) is None
    assert torch.equal(first_logits(rebuilt, cfg), packed["bf16"])
    caplog.clear()
    again, _ = fast(model_dir)  # the rebuilt file is whole and used
    assert "packing again" not in caplog.text and MappedPages().path(again.arena) == str(path)
    assert json.loads(path.read_bytes()[:arena_cache.HEADER].rstrip(b"\0"))["version"] == arena_cache.ARENA_VERSION
    assert torch.equal(first_logits(again, cfg), packed["bf16"])


LOAD = """
import hashlib, sys, torch
from saguaro.backends.cpu_kernels.model import FastCausalLM
from saguaro.loading import load_model
from tests.memory_probe import first_logits
loaded = load_model(sys.argv[1], dtype=torch.bfloat16, progress=False)
logits = first_logits(FastCausalLM(loaded.model), loaded.config)
print(hashlib.sha256(logits.numpy().tobytes()).hexdigest())
"""


def test_two_processes_loading_at_once_both_succeed(model_dir, packed, cache):
    env = {**os.environ, "SAGUARO_CACHE": str(cache), "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", LOAD, str(model_dir)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    import hashlib
    want = hashlib.sha256(packed["bf16"].numpy().tobytes()).hexdigest()
    assert [out.strip() for out, _ in outs] == [want, want]
    (path,) = arena_files(cache)
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]
    mapped, _ = fast(model_dir)
    assert MappedPages().path(mapped.arena) == str(path)


def test_the_load_returns_before_the_store_finishes(model_dir, packed, cache, monkeypatch):
    release, writing = threading.Event(), threading.Event()
    write = arena_cache._write

    def slow_write(f, header, buffer):  # a disk far slower than the load
        writing.set()
        assert release.wait(60)
        write(f, header, buffer)

    monkeypatch.setattr(arena_cache, "_write", slow_write)
    loaded = load_model(model_dir, dtype=torch.bfloat16, progress=False)
    model = FastCausalLM(loaded.model)
    try:
        assert writing.wait(60) and not arena_files(cache)  # returned while the store waits to write
        assert torch.equal(first_logits(model, loaded.config), packed["bf16"])  # serving meanwhile
    finally:
        release.set()
        arena_cache.wait_for_stores()
    (path,) = arena_files(cache)
    mapped, cfg = fast(model_dir)
    assert MappedPages().path(mapped.arena) == str(path)
    assert torch.equal(first_logits(mapped, cfg), packed["bf16"])


EXIT_MID_STORE = """
import os, sys, torch
from saguaro.backends.cpu_kernels import arena_cache
from saguaro.backends.cpu_kernels.model import FastCausalLM
from saguaro.loading import load_model

def dying_write(f, header, buffer):  # the process ends with half the arena written
    f.write(header)
    f.write(memoryview(buffer.numpy())[:buffer.numel() // 2])
    f.flush()
    os._exit(0)

arena_cache._write = dying_write
FastCausalLM(load_model(sys.argv[1], dtype=torch.bfloat16, progress=False).model)
arena_cache.wait_for_stores()
"""


def test_a_process_that_exits_mid_store_leaves_nothing_used(model_dir, packed, cache, caplog):
    env = {**os.environ, "SAGUARO_CACHE": str(cache), "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", EXIT_MID_STORE, str(model_dir)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not arena_files(cache) and [p for p in (cache / "arenas").iterdir() if ".tmp-" in p.name]
    caplog.set_level("INFO", "saguaro.fast")
    packed_again, cfg = fast(model_dir)
    assert MappedPages().path(packed_again.arena) is None and "mapped the packed" not in caplog.text
    assert torch.equal(first_logits(packed_again, cfg), packed["bf16"])
    (path,) = arena_files(cache)  # stored whole this time; the dead writer's temporary is gone
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]
    mapped, _ = fast(model_dir)
    assert MappedPages().path(mapped.arena) == str(path)


def test_weights_in_memory_are_never_cached(cache):
    model = tiny_model(seed=6, vocab=512, layers=2, hidden=256).model.to(torch.bfloat16)
    FastCausalLM(model)
    assert not (cache / "arenas").exists()


def test_turned_off_by_the_environment(model_dir, cache, monkeypatch):
    monkeypatch.setenv(arena_cache.ENV, "off")
    fast(model_dir)
    assert not (cache / "arenas").exists()
