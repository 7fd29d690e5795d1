"""`clover.load` refuses, before reading any weights, a model that cannot fit in the available memory
(clover.runtime.check_memory; on a GPU, the device's free memory): its estimate equals the bytes the loaded model really holds (safetensors,
a quantized checkpoint, a GGUF file), the error names both sizes and the way out, CLOVER_MEMORY_CHECK=0
skips it, and the CLI reports it as an error line, not a traceback."""

import pytest
import torch

import clover
from clover import runtime
from clover.checkpoint import plan_checkpoint, planned_nbytes
from clover.config import CloverConfig


def _held_bytes(model) -> int:
    """What the model's saved tensors occupy (parameters, quantized codes and scales), tied ones once."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture
def little_memory(monkeypatch):
    """MemAvailable as 1 MB: every model is too large."""
    monkeypatch.delenv("CLOVER_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(runtime, "available_memory", lambda: 1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_is_what_the_loaded_model_holds(dtype):
    path = clover.DEMO_MODEL_DIR
    plan = plan_checkpoint(path, CloverConfig.from_file(path))
    model = clover.load(path, dtype=dtype, backend="reference")
    assert planned_nbytes(plan, dtype) == _held_bytes(model)


def test_quantized_estimate(tmp_path):
    from clover.cli import main

    dst = tmp_path / "int4"
    assert main(["quantize", str(clover.DEMO_MODEL_DIR), str(dst), "--bits", "4"]) == 0
    plan = plan_checkpoint(dst, CloverConfig.from_file(dst))
    model = clover.load(dst, dtype=torch.bfloat16, backend="reference")
    assert planned_nbytes(plan, torch.bfloat16) == _held_bytes(model)


def test_gguf_estimate(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from gguf_files import write_gguf
    from test_gguf import Q32, TOKENIZER, tiny

    from clover.gguf import loader

    path = tmp_path / "q.gguf"
    write_gguf(path, tiny(**Q32), T.Q8_0, tokenizer=TOKENIZER)
    seen = []
    real = loader._planned_nbytes
    monkeypatch.setattr(loader, "_planned_nbytes", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    model = clover.load(path, backend="reference")
    assert seen == [_held_bytes(model)]
    left = loader.load_gguf(path, table_in_file=True)      # the token table left in the file: not counted
    assert seen[-1] == _held_bytes(left) < seen[0]


def test_a_model_too_large_is_refused_before_loading(little_memory, setenv):
    with pytest.raises(runtime.InsufficientMemoryError) as err:
        clover.load(backend="reference")
    message = str(err.value)
    assert str(clover.DEMO_MODEL_DIR) in message and "GB of memory as loaded" in message
    assert "0.00 GB available" in message and "CLOVER_MEMORY_CHECK=0" in message
    assert isinstance(err.value, MemoryError) and isinstance(err.value, ValueError)
    setenv("CLOVER_MEMORY_CHECK", "0")
    assert clover.load(backend="reference") is not None


def test_unknown_available_memory_does_not_refuse(monkeypatch):
    monkeypatch.setattr(runtime, "available_memory", lambda: None)
    runtime.check_memory(1 << 60, "a model")            # no /proc/meminfo: nothing to compare against


def test_available_memory_reads_meminfo():
    value = runtime.available_memory()
    assert value is None or value > 0


def test_cli_reports_it_as_an_error(little_memory, capsys):
    from clover.cli import main

    assert main(["generate", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "GB of memory as loaded" in err and "Traceback" not in err


@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_a_model_too_large_for_the_gpu_is_refused_before_loading(form, tmp_path, monkeypatch):
    """On a CUDA device the check compares with the device's free memory (`torch.cuda.mem_get_info`,
    here 1.2 GB free of 24 GB, all of it kept for a step's activations: the tiny models cannot fit),
    before anything is allocated there — this machine has no GPU, so touching one would fail otherwise."""
    monkeypatch.delenv("CLOVER_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(1.2e9), int(24e9)))
    monkeypatch.setattr(runtime, "GPU_HEADROOM", int(1.2e9))
    path = clover.DEMO_MODEL_DIR
    if form == "gguf":
        pytest.importorskip("gguf")
        from gguf import GGMLQuantizationType as T
        from gguf_files import write_gguf
        from test_gguf import Q32, TOKENIZER, tiny

        path = tmp_path / "q.gguf"
        write_gguf(path, tiny(**Q32), T.Q8_0, tokenizer=TOKENIZER)
    with pytest.raises(runtime.InsufficientMemoryError) as err:
        clover.load(path, device="cuda", backend="reference")
    message = str(err.value)
    assert str(path) in message and "on cuda" in message and "1.20 GB free of 24.00 GB" in message
    assert "clover quantize" in message and "CLOVER_MEMORY_CHECK=0" in message
