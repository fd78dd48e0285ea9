"""Host memory: one resident copy of the weights after packing, quantized packs one matrix at a time, and a KV
cache that costs what it holds.

The model is a tiny one scaled up (about 70 MB in bf16) and written as an HF directory, so ``load_model`` maps
it from its file exactly as it maps a real checkpoint. What each test counts is the resident part of the weights
file's mapping (``/proc/self/smaps``), which nothing else in the process touches; each has a negative control (the
pages not handed back) showing the count would catch a second copy.
"""
import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.backends.cpu_kernels import build as kernels
from saguaro.backends.cpu_kernels.model import FastCausalLM, pass_bytes
from saguaro.host_memory import MappedPages, lazy_zeros, resident_bytes
from saguaro.kv.kv_cache import KVCache
from saguaro.loading import load_model
from saguaro.models.model_config import ModelConfig
from tests.memory_probe import first_logits, mapped_resident
from tests.tiny import save_hf, tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernels (AVX2 or better)")
MB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    loaded = tiny_model(seed=5, vocab=2048, layers=6, hidden=512, sharpness=4.0)  # 4 heads of 128
    return save_hf(loaded, tmp_path_factory.mktemp("scaled"), torch.bfloat16)


@pytest.fixture(autouse=True)
def packing(monkeypatch, tmp_path):
    """Every load packs (an arena mapped from the cache reads no weights at all; test_arena_cache.py)."""
    monkeypatch.setenv("SAGUARO_ARENA_CACHE", "off")
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))


def _load(model_dir):
    return load_model(model_dir, dtype=torch.bfloat16, progress=False)


def test_packing_leaves_one_resident_copy(model_dir, monkeypatch):
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    kept = _load(model_dir)
    FastCausalLM(kept.model)
    assert mapped_resident(weights) < 0.02 * size  # norms and the edge pages of each matrix
    monkeypatch.setattr(MappedPages, "release", lambda self, *tensors: None)  # negative control: a second copy
    both = _load(model_dir)
    FastCausalLM(both.model)
    assert mapped_resident(weights) > 0.9 * size


def test_released_weights_give_unchanged_outputs(model_dir):
    """Handing pages back loses nothing: the fast model equals one packed from weights in memory, bit for bit,
    and the eager model (reading its weights again from the file) still equals a fresh eager load."""
    released = _load(model_dir)
    fast = FastCausalLM(released.model)
    in_memory = _load(model_dir)
    for p in in_memory.model.parameters():
        p.data = p.data.clone()  # anonymous memory: nothing to hand back
    cfg = released.config
    assert torch.equal(first_logits(fast, cfg), first_logits(FastCausalLM(in_memory.model), cfg))
    assert torch.equal(first_logits(released.model, cfg), first_logits(_load(model_dir).model, cfg))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_pack_holds_one_bf16_matrix_at_a_time(model_dir, monkeypatch, fmt):
    weights = model_dir / "model.safetensors"
    loaded = _load(model_dir)
    mapped = mapped_resident(weights)  # pages the kernel maps around those safetensors reads (its header)
    assert mapped < 0.3 * weights.stat().st_size
    largest = 2 * loaded.config.intermediate_size * loaded.config.hidden_size * 2  # gate and up, packed together
    peak = []
    release = MappedPages.release

    def measured(self, *tensors):
        peak.append(mapped_resident(weights))  # sources just packed, not yet handed back
        release(self, *tensors)

    monkeypatch.setattr(MappedPages, "release", measured)
    llm = LLM(loaded, dtype="bfloat16", target_weights=fmt, block_size=4, kv_cache_tokens=128)
    assert len(peak) > 6 * 4
    assert max(peak) <= mapped + largest + MB
    assert mapped_resident(weights) < 2 * MB
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids
    llm.close()
    monkeypatch.setattr(MappedPages, "release", lambda self, *tensors: peak.append(mapped_resident(weights)))
    LLM(_load(model_dir), dtype="bfloat16", target_weights=fmt, block_size=4, kv_cache_tokens=128).close()
    assert peak[-1] > 0.9 * weights.stat().st_size  # negative control: nothing handed back


def test_engine_resident_memory_is_the_arena(model_dir):
    """Resident memory grows by about the packed arena (plus the embedding rows read), not arena + weights."""
    cfg = _load(model_dir).config
    arena = pass_bytes(cfg)
    kernels.load()
    before = resident_bytes()
    llm = LLM(_load(model_dir), dtype="bfloat16", block_size=16, kv_cache_tokens=32768)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    grown = resident_bytes() - before
    llm.close()
    assert grown < arena + 24 * MB, (grown / MB, arena / MB)


def test_idle_kv_cache_is_not_resident():
    cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=1536, intermediate_size=8960, num_layers=28,
                      num_heads=12, num_kv_heads=2, head_dim=128, max_position_embeddings=32768)
    before = resident_bytes()
    cache = KVCache(cfg, 32768 // 16, 16, torch.bfloat16)
    assert cache.data.numel() * 2 > 0.9e9
    assert resident_bytes() - before < 8 * MB
    cache.data[:, :, :16] = 1.0  # one block of every layer
    grown = resident_bytes() - before
    assert grown < 16 * MB
    assert cache.data[:, :, 16:].abs().sum() == 0 and cache.data[:, :, :16].sum() == cache.data[:, :, :16].numel()


def test_lazy_zeros_are_zero_at_every_size():
    for shape in [(3,), (1000, 1000), (2, 1 << 20)]:
        t = lazy_zeros(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.abs().sum() == 0


def _peak_growth(work) -> int:
    """The largest resident memory while ``work()`` ran, over what was resident before (VmHWM, reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets this process's peak resident memory to its current resident memory
    before = resident_bytes()
    work()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return peak - before


@pytest.fixture(scope="module")
def wide_head_dir(tmp_path_factory):
    """A head of 65,536 rows (32 MB in bf16) beside 4 MB of other weights: the head decides a pack's peak."""
    loaded = tiny_model(seed=7, vocab=65536, layers=2, hidden=256)
    return save_hf(loaded, tmp_path_factory.mktemp("wide"), torch.bfloat16)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_pack_holds_a_chunk_of_the_head_not_the_head(wide_head_dir, monkeypatch, fmt):
    """An RSS ceiling: packing grows resident memory by its arena plus about a chunk of rows, where packing the
    head whole held its bf16 source and the packer's staging copy of it (the negative control)."""
    import saguaro.backends.cpu_kernels.model as fast_model
    kernels.load()
    cfg = _load(wide_head_dir).config
    arena, head = pass_bytes(cfg, fmt), cfg.vocab_size * cfg.hidden_size * 2
    monkeypatch.setattr(fast_model, "PACK_ROWS", 1024)
    chunked = _peak_growth(lambda: FastCausalLM(_load(wide_head_dir).model, fmt))
    assert chunked < arena + head / 2, (chunked / MB, arena / MB, head / MB)
    monkeypatch.setattr(fast_model, "PACK_ROWS", cfg.vocab_size)  # the whole head in one call
    whole = _peak_growth(lambda: FastCausalLM(_load(wide_head_dir).model, fmt))
    assert whole > arena + head, (whole / MB, arena / MB, head / MB)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_packing_in_chunks_changes_no_byte(wide_head_dir, monkeypatch, fmt):
    import saguaro.backends.cpu_kernels.model as fast_model
    ids = torch.arange(3, 65536, 7)  # a reduced head: rows spread over the whole table
    monkeypatch.setattr(fast_model, "PACK_ROWS", 64 * 5)  # chunks that end inside the last tile
    chunked = [FastCausalLM(_load(wide_head_dir).model, fmt, head_ids=h).arena for h in (None, ids)]
    monkeypatch.setattr(fast_model, "PACK_ROWS", 1 << 20)
    whole = [FastCausalLM(_load(wide_head_dir).model, fmt, head_ids=h).arena for h in (None, ids)]
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
