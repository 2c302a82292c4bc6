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
  and stops are the worker's ids (``rollbook.language_models.stop_token_ids``). Built with vLLM's sleep
  mode when its caller frees the engine's memory between rounds (``releases_memory``: the colocated
  placement with ``trainer.offload_optimizer``).

Sizing: the workload, not the model's positions, sizes an engine. The longest request of a rollout is
``rollout.max_prompt_tokens + rollout.max_new_tokens`` (``rollout_seq_len``; an unset prompt budget is
``rollout_prompt_tokens``'s default, 64 for the toy tasks, 256 with a dataset): the native engine's
``max_seq_len`` (its KV cache holds ``max_batch_size`` sequences of that many positions per layer) and
vLLM's ``max_model_len``; ``rollout_batch_size`` is the native engine's ``max_batch_size`` (one generate
call of a round unless ``rollout.max_batch_size`` says otherwise). ``native_engine`` builds a native
engine so sized over a model already placed (the held-out evaluators beside a trainer use it too).
``check_fits`` (and ``check_proxy_fits`` for ``rollbook proxy``'s ``max_context_tokens``) refuses, in one
line before anything starts, a workload longer than the model's ``max_position_embeddings``
(``model_positions`` reads it from the model directory's config.json, or the tiny model's).

Both record the same evidence: output token ids, behavior log-probs of the distribution sampled from
and one policy version per token; both take new weights by version (``update_weights``), the native
engine between decode steps, vLLM between ``generate`` calls. vLLM is imported only inside
``VllmEngine``; ``check_engine`` asks ``importlib.util.find_spec`` whether it is installed.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

from rollbook.config import ModelConfig, ProxyConfig, RolloutConfig
from rollbook.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rollbook.rollout.engine import GenerationEngine, NativeEngine
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


TOY_PROMPT_TOKENS = 64  # rollout.max_prompt_tokens unset, the toy tasks: their longest prompt is 21 tokens
DATASET_PROMPT_TOKENS = 256  # rollout.max_prompt_tokens unset, with a dataset


def rollout_prompt_tokens(rollout: RolloutConfig) -> int:
    """The longest prompt a rollout takes: ``rollout.max_prompt_tokens``, else ``TOY_PROMPT_TOKENS`` for
    the toy tasks and ``DATASET_PROMPT_TOKENS`` with a dataset."""
    if rollout.max_prompt_tokens is not None:
        return rollout.max_prompt_tokens
    return DATASET_PROMPT_TOKENS if rollout.dataset is not None else TOY_PROMPT_TOKENS


def rollout_seq_len(rollout: RolloutConfig) -> int:
    """The longest request a rollout makes: ``rollout_prompt_tokens + max_new_tokens``."""
    return rollout_prompt_tokens(rollout) + rollout.max_new_tokens


def rollout_batch_size(rollout: RolloutConfig) -> int:
    """The native engine's slots for a rollout: ``rollout.max_batch_size``, else the requests of one
    generate call of a round (``group_size`` x ``num_prompts``, or x ``chunk_prompts`` when a dataset
    generates in chunks)."""
    if rollout.max_batch_size is not None:
        return rollout.max_batch_size
    prompts = rollout.chunk_prompts if rollout.dataset is not None and rollout.chunk_prompts else rollout.num_prompts
    return rollout.group_size * prompts


def proxy_batch_size(config: ProxyConfig) -> int:
    """The native engine's slots for ``rollbook proxy``: ``max_batch_size``, at most what can be in
    flight (``max_concurrent`` completions of ``max_n`` choices)."""
    return min(config.max_batch_size, config.max_concurrent * config.max_n)


def model_positions(model: ModelConfig, *, field: str = "model.path") -> int | None:
    """The ``max_position_embeddings`` of the model ``model`` loads or builds, without building it: its
    directory's config.json (or the config's ``text_config``), else the tiny model's. None when the
    config.json names none. A ``model.path`` that is not a model directory is a ``ConfigError``."""
    if not model.path:
        from rollbook.language_models import TinyModelSpec

        return TinyModelSpec.max_position_embeddings
    import json

    from rollbook.language_models import check_model_dir

    config = json.loads((check_model_dir(model.path, field) / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(section.get(key), int):
                return section[key]
    return None


def check_fits(model: ModelConfig, rollout: RolloutConfig, *, field: str = "model.path") -> None:
    """Refuse, in one line (``ConfigError``, exit 2), a rollout whose longest request
    (``rollout.max_prompt_tokens + rollout.max_new_tokens``) is longer than the model's
    ``max_position_embeddings``. ``field`` names the model's path in the message."""
    _refuse_longer(rollout_seq_len(rollout), _asked(rollout), model_positions(model, field=field), _which_model(model, field))


def check_proxy_fits(config: ProxyConfig, *, prefix: str = "") -> None:
    """Refuse, in one line (``ConfigError``, exit 2), a proxy whose ``max_context_tokens`` is longer than
    its model's ``max_position_embeddings``. ``prefix`` goes before the field names in the message."""
    field = f"{prefix}model.path"
    _refuse_longer(
        config.max_context_tokens,
        f"{prefix}max_context_tokens ({config.max_context_tokens})",
        model_positions(config.model, field=field),
        _which_model(config.model, field),
        "lower it to fit",
    )


def _asked(rollout: RolloutConfig) -> str:
    return (
        f"rollout.max_prompt_tokens ({rollout_prompt_tokens(rollout)}) + rollout.max_new_tokens ({rollout.max_new_tokens}) "
        f"= {rollout_seq_len(rollout)}"
    )


def _which_model(model: ModelConfig, field: str) -> str:
    return f"{field} {model.path!r}" if model.path else f"the tiny model built when {field} is unset"


def _refuse_longer(tokens: int, asked: str, positions: int | None, which: str, fix: str = "lower them to fit") -> None:
    if positions is not None and tokens > positions:
        raise ConfigError(f"{asked} is longer than the model's max_position_embeddings ({positions}, {which}): {fix}")


def native_engine(model: torch.nn.Module, rollout: RolloutConfig, *, version: int) -> NativeEngine:
    """A ``NativeEngine`` over ``model`` (already placed) sized by the rollout's workload: ``rollout_batch_size``
    slots of ``rollout_seq_len`` positions, sampling with ``rollout.seed``. A workload longer than the
    model's ``max_position_embeddings`` is a ``ConfigError`` naming the fields."""
    from rollbook.rollout.engine import NativeEngine

    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    which = "the model the engine holds"
    _refuse_longer(rollout_seq_len(rollout), _asked(rollout), positions if isinstance(positions, int) else None, which)
    return NativeEngine(
        model,
        version=version,
        seed=rollout.seed,
        max_batch_size=rollout_batch_size(rollout),
        max_seq_len=rollout_seq_len(rollout),
    )


def build_engine(
    model: ModelConfig,
    rollout: RolloutConfig,
    *,
    version: int,
    weights: torch.nn.Module | None = None,
    releases_memory: bool = False,
) -> GenerationEngine:
    """The engine ``rollout.engine`` names, holding policy ``version``: the weights of ``weights`` (a live
    model, e.g. the trainer's student, copied), else those ``model`` loads or builds; sized by the
    rollout's workload (``rollout_seq_len``, ``rollout_batch_size``). ``releases_memory``: the caller
    calls ``release_memory`` between rounds (vLLM is then built with its sleep mode)."""
    if rollout.engine == "vllm":
        return _vllm_engine(model, rollout, version, weights, sleep_mode=releases_memory)
    import copy

    from rollbook.devices import place
    from rollbook.language_models import build_student

    source = copy.deepcopy(weights) if weights is not None else build_student(model)
    return native_engine(place(source, rollout.device, rollout.dtype), rollout, version=version)


def close_engine(engine: object) -> None:
    """Close ``engine`` if it can be closed: a native engine's scheduler thread (an engine process's
    child) ends here, not while the interpreter exits; the vLLM engine has no ``close``."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


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


def _vllm_engine(model: ModelConfig, rollout: RolloutConfig, version: int, weights: torch.nn.Module | None, *, sleep_mode: bool):
    from rollbook.rollout.vllm_engine import VllmEngine

    if not model.path:
        raise ConfigError("rollout.engine = 'vllm' needs model.path (a local Hugging Face directory for vLLM to load)")
    check_fits(model, rollout)
    engine = VllmEngine(
        model.path,
        version=version if weights is None else version - 1,
        sleep_mode=sleep_mode,
        dtype=rollout.dtype,
        seed=rollout.seed,
        gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
        max_model_len=rollout_seq_len(rollout),
        skip_tokenizer_init=True,
    )
    if weights is not None:  # the trainer's student, which may differ from the directory (a warm start)
        engine.update_weights(dict(weights.state_dict()), version)
    return engine
