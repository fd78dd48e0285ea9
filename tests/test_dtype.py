"""dtype="auto" (the default) is the checkpoint's own dtype; an explicit dtype wins."""
import json

import pytest

gguf = pytest.importorskip("gguf")  # absent on the GPU machine unless its wheel is carried
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from saguaro import LLM  # noqa: E402
from saguaro.config import Config  # noqa: E402
from saguaro.loading.place import place  # noqa: E402
from saguaro.loading import MODELS, installed  # noqa: E402
from saguaro.loading.dtype import checkpoint_dtype  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"])
def test_registered_models_are_bf16(name):
    assert checkpoint_dtype(name) == "bfloat16"
    assert Config(target=name).dtype == "auto"  # Config only validates; LLM reads the checkpoint's dtype


def test_a_model_in_memory_keeps_its_own_dtype():
    tiny = tiny_model()
    assert checkpoint_dtype(tiny) == "float32"
    with LLM(tiny, block_size=4) as llm:
        assert llm.config.dtype == "float32"
        assert next(llm.target.model.parameters()).dtype == torch.float32
    bf16 = place(tiny, "cpu", torch.bfloat16)
    with LLM(bf16, block_size=4) as llm:
        assert llm.config.dtype == "bfloat16"
    with LLM(bf16, block_size=4, dtype="float32") as llm:  # explicit wins
        assert next(llm.target.model.parameters()).dtype == torch.float32


def test_hf_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no name: the weights tell
    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    assert checkpoint_dtype(tmp_path) == "bfloat16"


@pytest.mark.parametrize("file_type, expected", [(gguf.LlamaFileType.ALL_F32, "float32"),
                                                 (gguf.LlamaFileType.MOSTLY_F16, "float16"),
                                                 (gguf.LlamaFileType.MOSTLY_Q4_K_M, "bfloat16"), (None, "bfloat16")])
def test_gguf_file_type(tmp_path, file_type, expected):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert checkpoint_dtype(path) == expected


def test_unknown_source_is_float32_and_the_load_reports_it():
    assert checkpoint_dtype("no-such-model") == "float32"
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        Config(target="smollm2-135m", dtype="float8")


@pytest.mark.slow
def test_llm_loads_smollm2_in_bf16_by_default():
    if not installed(MODELS["smollm2-135m"]):
        pytest.skip("smollm2-135m is not installed")
    with LLM("smollm2-135m", kv_cache_tokens=256) as llm:
        assert llm.config.dtype == "bfloat16"
        assert next(llm.target.model.parameters()).dtype == torch.bfloat16
