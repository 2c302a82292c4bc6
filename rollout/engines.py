"""Which generation engine a rollout config names (``rollout.engine``), checked, built and fed.

    check_engine(config.rollout.engine, config.trainer.model.path)   # a command's early refusal: one line, exit 2
    engine = build_engine(model_config, rollout, version=0, weights=student)   # native or vLLM
    install_snapshot(engine, snapshot)            # a weight channel's version into either engine

``build_engine`` is the one place a rollout worker (``rollbook rollout``, the ray placement's actors)
and ``rollbook run``'s placements make the engine they generate with:

- ``native``: ``NativeEngine`` (rollout/engine.py) over a copy of ``weights`` (the trainer's student) or
  over the student ``model`` builds (``rollbook.language_models.build_student``), on ``rollout.device`` in
  ``rollout.dtype``;
- ``vllm``: ``VllmEngine`` (rollout/vllm_engine.py) on ``model.path``, the directory vLLM loads, in
  ``rollout.dtype`` with ``rollout.vllm_gpu_memory_utilization`` of its GPU; with ``weights`` their
  state dict is installed at ``version`` at once. vLLM's tokenizer is not loaded: prompts go in as ids,
  and stops are the worker's ids (``rollbook.language_models.stop_token_ids``).

Both record the same evidence: output token ids, behavior log-probs of the distribution sampled from
and one policy version per token; both take new weights by version (``update_weights``), the native
engine between decode steps, vLLM between ``generate`` calls. vLLM is imported only inside
``VllmEngine``; ``check_engine`` asks ``importlib.util.find_spec`` whether it is installed.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

from rollbook.config import ModelConfig, RolloutConfig
from rollbook.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rollbook.rollout.engine import GenerationEngine
    from rollbook.weights.base import WeightSnapshot

log = logging.getLogger("rollbook.rollout")


def check_engine(engine: str, model_path: str | None, *, field: str = "rollout.engine", device: str = "auto") -> None:
    """Refuse, in one line (``ConfigError``, exit 2), an engine this machine cannot build: ``vllm``
    without the vllm package, or without a model directory for it to load. Imports nothing heavy, so a
    command calls it before it starts anything. ``device`` set to anything but auto or CUDA has no
    effect with vLLM: a warning says so."""
    if engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"{field} = 'vllm': the vllm package is not installed here (pip install 'rollbook[vllm]' on a CUDA "
            f"machine), or set {field} = 'native'"
        )
    if not model_path:
        raise ConfigError(
            f"{field} = 'vllm' needs model.path: vLLM loads the model from a local Hugging Face directory "
            "(the built-in tiny model has none)"
        )
    if not (device == "auto" or device.startswith("cuda")):
        log.warning("device %r has no effect with %s = 'vllm': vLLM runs on the GPU it is given", device, field)


def build_engine(
    model: ModelConfig, rollout: RolloutConfig, *, version: int, weights: torch.nn.Module | None = None
) -> GenerationEngine:
    """The engine ``rollout.engine`` names, holding policy ``version``: the weights of ``weights`` (a live
    model, e.g. the trainer's student, copied), else those ``model`` loads or builds."""
    if rollout.engine == "vllm":
        return _vllm_engine(model, rollout, version, weights)
    import copy

    from rollbook.devices import place
    from rollbook.language_models import build_student
    from rollbook.rollout.engine import NativeEngine

    source = copy.deepcopy(weights) if weights is not None else build_student(model)
    return NativeEngine(place(source, rollout.device, rollout.dtype), version=version, seed=rollout.seed)


def install_snapshot(engine: GenerationEngine, snapshot: WeightSnapshot) -> None:
    """Install a weight channel's version: the native engine copies it into its model between decode
    steps; vLLM gets a copy of the tensors (the channel's views are reused two versions later). A
    snapshot rewritten during the copy raises ``TornSnapshot`` (a ``RuntimeError``) and installs
    nothing: fetch again."""
    from rollbook.rollout.vllm_engine import VllmEngine
    from rollbook.weights.base import TornSnapshot, load_into

    if not isinstance(engine, VllmEngine):
        engine.update_weights(lambda m: load_into(m, snapshot), snapshot.version)
        return
    state = {name: tensor.clone() for name, tensor in snapshot.state_dict.items()}
    if not snapshot.still_valid():
        raise TornSnapshot(f"version {snapshot.version} was overwritten during the copy; fetch again")
    engine.update_weights(state, snapshot.version)


def _vllm_engine(model: ModelConfig, rollout: RolloutConfig, version: int, weights: torch.nn.Module | None):
    from rollbook.rollout.vllm_engine import VllmEngine

    if not model.path:
        raise ConfigError("rollout.engine = 'vllm' needs model.path (a local Hugging Face directory for vLLM to load)")
    engine = VllmEngine(
        model.path,
        version=version if weights is None else version - 1,
        dtype=rollout.dtype,
        seed=rollout.seed,
        gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
        skip_tokenizer_init=True,
    )
    if weights is not None:  # the trainer's student, which may differ from the directory (a warm start)
        engine.update_weights(dict(weights.state_dict()), version)
    return engine
