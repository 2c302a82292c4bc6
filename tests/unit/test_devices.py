"""Device and dtype settings (rollbook/devices.py): what each names, what this machine refuses in one
line (exit 2 from every command, before anything starts), and what the trainer and the exports do with
bfloat16."""

from __future__ import annotations

import json

import pytest
import torch

from rollbook import devices
from rollbook.cli import main as cli
from rollbook.config import RunConfig
from rollbook.errors import ConfigError
from rollbook.language_models import TinyModelSpec, build_tiny_model

CUDA = torch.cuda.is_available()


def test_cpu_and_auto_resolve_here():
    assert devices.resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if CUDA else "cpu"
    assert devices.resolve_device("auto").type == expected


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_is_one_line(name):
    with pytest.raises(ConfigError) as err:
        devices.resolve_device(name)
    message = str(err.value)
    assert "\n" not in message and f"device {name!r}" in message and "sees no CUDA device" in message


def test_a_cuda_index_past_the_machines_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"device 'cuda:2': this machine has 2 such device\(s\) \(0 to 1\)"):
        devices.resolve_device("cuda:2")
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)


def test_npu_without_torch_npu_is_one_line(monkeypatch):
    monkeypatch.setattr(devices, "_npu_import", lambda: "torch_npu is not installed")
    with pytest.raises(ConfigError, match=r"^device 'npu': torch_npu is not installed; use device = 'cpu' or 'auto'$"):
        devices.resolve_device("npu")
    assert devices.resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")  # auto skips a missing NPU


def test_bfloat16_on_a_gpu_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(ConfigError, match=r"dtype 'bfloat16': Tesla V100 \(cuda:0\) has no bfloat16 arithmetic"):
        devices.resolve_dtype("bfloat16", torch.device("cuda", 0))
    assert devices.resolve_dtype("float32", torch.device("cuda", 0)) is torch.float32


def test_the_cpu_computes_in_bfloat16():
    assert devices.resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


def test_place_casts_a_forward_only_model_and_the_trained_student_stays_float32():
    model = build_tiny_model(TinyModelSpec(vocab_size=16), seed=0)
    assert {p.dtype for p in devices.place(build_tiny_model(TinyModelSpec(vocab_size=16)), "cpu", "bfloat16").parameters()} == {
        torch.bfloat16
    }
    assert {p.dtype for p in devices.place_trained(model.to(torch.bfloat16), "cpu").parameters()} == {torch.float32}


def test_autocast_is_nothing_at_float32_and_bfloat16_matmuls_otherwise():
    a = torch.randn(4, 4)
    with devices.autocast(torch.device("cpu"), "float32"):
        assert (a @ a).dtype == torch.float32
    with devices.autocast(torch.device("cpu"), "bfloat16"):
        assert (a @ a).dtype == torch.bfloat16


def test_cast_floating_leaves_integer_tensors():
    state = {"w": torch.ones(2), "step": torch.tensor(3), "b": torch.zeros(1, dtype=torch.bfloat16)}
    cast = devices.cast_floating(state, "bfloat16")
    assert cast["w"].dtype == torch.bfloat16 and cast["step"].dtype == torch.int64 and cast["b"] is state["b"]


def test_device_and_dtype_are_set_once_for_a_run_or_apart_per_side():
    both = RunConfig(device="cpu", dtype="bfloat16")
    assert (both.trainer.device, both.rollout.device, both.trainer.dtype, both.rollout.dtype) == (
        "cpu",
        "cpu",
        "bfloat16",
        "bfloat16",
    )
    apart = RunConfig(trainer={"device": "cuda:0"}, rollout={"device": "cuda:1"})
    assert (apart.trainer.device, apart.rollout.device) == ("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="dtype = 'bfloat16', trainer.dtype = 'float32' disagree"):
        RunConfig(dtype="bfloat16", trainer={"dtype": "float32"})
    with pytest.raises(ValueError, match="device"):
        RunConfig(device="gpu")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--device", "cuda"], "device 'cuda'"),
        (["run", "--trainer.device", "cuda:1"], "device 'cuda:1'"),
        (["train", "--device", "cuda"], "device 'cuda'"),
        (["rollout", "--weights", "shm:x", "--rollout.device", "cuda"], "device 'cuda'"),
        (["proxy", "--device", "npu"], "device 'npu'"),
    ],
)
def test_every_command_refuses_a_missing_device_in_one_line_before_it_starts(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(devices, "_npu_import", lambda: "torch_npu is not installed")
    run_dir = tmp_path / "run"
    extra = ["--run_dir", str(run_dir)] if argv[0] in ("run", "train") else []
    assert cli.main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not run_dir.exists()  # nothing written: no ledger, no resolved config


def test_a_bfloat16_export_holds_bfloat16_and_loads_as_it(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rollbook.config import ModelConfig
    from rollbook.trainer.export import export_model

    model = build_tiny_model(TinyModelSpec(vocab_size=40), seed=1)
    out = export_model(tmp_path, 3, model, ModelConfig(), dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto", local_files_only=True)
    assert loaded.dtype == torch.bfloat16
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, model.state_dict()[name].to(torch.bfloat16)), name
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the trained model itself is untouched


def test_state_checksum_reads_bfloat16_bytes():
    from rollbook.trainer.loop import state_checksum

    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    b = {"w": torch.tensor([1.0, 2.015625], dtype=torch.bfloat16)}  # the next bfloat16 after 2.0
    assert state_checksum(a) == state_checksum({"w": a["w"].clone()}) != state_checksum(b)
    assert state_checksum({"w": torch.tensor([1.0, 2.0])}) != state_checksum(a)


def test_a_bfloat16_state_passes_the_shared_memory_channel(tmp_path):
    import uuid

    from rollbook.weights.shm import SharedMemoryPublisher, SharedMemoryReceiver

    state = devices.cast_floating(build_tiny_model(TinyModelSpec(vocab_size=24), seed=2).state_dict(), "bfloat16")
    name = f"rollbook-test-{uuid.uuid4().hex[:8]}"
    publisher = SharedMemoryPublisher(name, state, checksum=True)
    try:
        publisher.publish(5, state)
        receiver = SharedMemoryReceiver(name)
        snapshot = receiver.fetch()
        receiver.close()
        assert snapshot is not None and snapshot.version == 5
        assert all(
            torch.equal(snapshot.state_dict[k], v) and snapshot.state_dict[k].dtype == torch.bfloat16 for k, v in state.items()
        )
    finally:
        publisher.close()


def test_a_weight_changed_inside_one_autocast_context_is_seen_by_the_next_forward():
    """One context spans a whole update (several minibatches): a cached bfloat16 copy would keep the
    weights from before an optimizer step."""
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with devices.autocast(torch.device("cpu"), "bfloat16"):
        before = layer(x)
        with torch.no_grad():
            layer.weight.add_(1.0)
        after = layer(x)
    assert not torch.equal(before, after)
