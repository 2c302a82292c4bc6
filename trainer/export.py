"""Hugging Face exports: the student as a directory ``from_pretrained`` loads (model + tokenizer).

    export_model(run_dir, step, model, config.model, keep_last=2)      # the loop, RUN_DIR/hf/step-NNNNNN/
    export_checkpoint("runs/x/checkpoints/step-000040", "out/")       # `rollbook export CHECKPOINT --to DIR`

The loop exports every ``export_every`` steps and after the last one (``export_final``), keeping the
newest ``export_keep_last`` under ``RUN_DIR/hf/``. An export is written to a temporary directory
and renamed into place, so a kill leaves the previous exports and no half-written one. It holds the
model (``save_pretrained``: config.json, generation_config.json, safetensors weights in the run's
``trainer.dtype``; the generation
config's end-of-sequence, padding and start ids filled in from the tokenizer where it has none, so
``generate`` stops on end of sequence) and the tokenizer the run used (``export_tokenizer``).

``rollbook export`` rebuilds the model of a kept checkpoint from the Hugging Face configs the
checkpoint holds (``config.json`` and ``generation_config.json`` beside ``state.pt``, written by
``save_hf_configs``; for a checkpoint written before them, from the run's resolved config,
``RUN_DIR/config.json``, and its ``model.path``), loads its weights strictly and writes the same
directory through the same ``write_hf_dir``: file for file what the run wrote to ``hf/step-NNNNNN``
for that step (generation config included: its end-of-sequence ids and sampling defaults).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

import torch

from rollbook.config import ModelConfig
from rollbook.fsync import fsync_dir
from rollbook.language_models import quiet_transformers

log = logging.getLogger("rollbook.trainer")

HF_DIR = "hf"  # RUN_DIR/hf/step-NNNNNN/
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


def export_due(config, step: int) -> bool:
    """Whether the loop exports after ``step`` steps are done (``TrainerConfig`` export fields)."""
    every = config.export_every is not None and step % config.export_every == 0
    return every or (config.export_final and step == config.num_steps)


def export_model(
    run_dir: pathlib.Path,
    step: int,
    model: torch.nn.Module,
    model_config: ModelConfig,
    *,
    keep_last: int = 2,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: str = "float32",
) -> pathlib.Path:
    """Write ``RUN_DIR/hf/step-NNNNNN/`` (model + tokenizer) and keep the newest ``keep_last``.
    ``tokenizer_dir``: the run's tokenizer directory (``TrainerConfig.tokenizer``), see ``export_tokenizer``;
    ``dtype``: the run's (``TrainerConfig.dtype``), the weights' in the export."""
    root = pathlib.Path(run_dir) / HF_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = write_hf_dir(model, model_config, root / f"step-{step:06d}", tokenizer_dir=tokenizer_dir, dtype=dtype)
    _prune(root, newest=final.name, keep_last=keep_last)
    log.info("exported step %d to %s", step, final)
    return final


def write_hf_dir(
    model: torch.nn.Module,
    model_config: ModelConfig,
    out: pathlib.Path,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: str = "float32",
) -> pathlib.Path:
    """``model`` and the run's tokenizer to ``out`` (replaced if it exists), through a temporary
    sibling renamed into place. ``tokenizer_dir``: the tokenizer directory the run used (``export_tokenizer``);
    ``dtype``: the weights' (a bfloat16 run trains float32 master weights and exports them cast, so
    ``from_pretrained(dtype="auto")`` loads bfloat16, as it would the model the run started from)."""
    from rollbook.devices import cast_floating

    quiet_transformers()
    out = pathlib.Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = cast_floating({k: v.detach().cpu() for k, v in model.state_dict().items()}, dtype)
    model.save_pretrained(tmp, state_dict=state)  # type: ignore[operator]  # a transformers PreTrainedModel, typed as its nn.Module base
    _record_dtype(tmp / "config.json", dtype)
    export_tokenizer(model_config, tmp, tokenizer_dir=tokenizer_dir)
    _fill_special_token_ids(tmp)
    for p in tmp.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out


def _record_dtype(config_json: pathlib.Path, dtype: str) -> None:
    """Say ``dtype`` in an export's config.json: ``save_pretrained`` records the live model's (the
    float32 master weights), not that of the tensors it was handed."""
    if not config_json.is_file():
        return
    data = json.loads(config_json.read_text())
    if data.get("dtype", dtype) != dtype:
        data["dtype"] = dtype
        config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_hf_configs(model: torch.nn.Module, directory: pathlib.Path) -> None:
    """``model``'s ``config.json`` (its architecture) and ``generation_config.json`` (its end-of-sequence
    ids, sampling defaults) into ``directory``, a checkpoint: what ``rollbook export`` rebuilds the
    model's configuration from (``_checkpoint_model``). Nothing for a model without them."""
    hf_config = getattr(model, "config", None)
    if hasattr(hf_config, "to_json_file"):
        hf_config.to_json_file(directory / "config.json")
    generation = getattr(model, "generation_config", None)
    if hasattr(generation, "to_json_file"):
        generation.to_json_file(directory / "generation_config.json")


def export_tokenizer(model_config: ModelConfig, out: pathlib.Path, *, tokenizer_dir: str | os.PathLike | None = None) -> None:
    """The tokenizer the run encoded with, into ``out``, as the rollout resolves it
    (``rollout/worker.py`` ``tokenizer_for`` after ``use_model_tokenizer``): the files of
    ``tokenizer_dir`` (``rollout.tokenizer`` through ``TrainerConfig.tokenizer``; a directory without
    tokenizer files is a ``FileNotFoundError``), else those of ``model.path`` when it has them, else the
    toy tasks' character tokenizer (``rollbook.tasks.TOKENIZER``, through its ``save_pretrained``).
    Files are copied byte for byte, so the export's ``AutoTokenizer`` is the run's (chat template too)."""
    if tokenizer_dir is not None:
        if not _copy_tokenizer_files(pathlib.Path(tokenizer_dir), out):
            raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...) in {tokenizer_dir}")
        return
    if model_config.path and _copy_tokenizer_files(pathlib.Path(model_config.path), out):
        return
    from rollbook.tasks import TOKENIZER

    _save_tokenizer(TOKENIZER, out)


def _save_tokenizer(tokenizer, out: pathlib.Path) -> None:
    """Write ``tokenizer`` as a Hugging Face tokenizer directory that ``AutoTokenizer`` loads.

    A tokenizer with ``save_pretrained(dir)`` writes itself. ``rollbook.tasks.CharTokenizer`` (which
    has no such method) becomes the equivalent ``tokenizers`` model: WordLevel over its tokens, one
    token per character, ``<bos>`` prepended by the post-processor (the rollout encodes prompts with
    ``add_bos=True``), decoded by concatenation, ``<pad>``/``<bos>``/``<eos>`` special; an unknown
    character is an error, as in ``CharTokenizer.encode``."""
    save = getattr(tokenizer, "save_pretrained", None)
    if callable(save):
        save(str(out))
        return
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rollbook.tasks import BOS, EOS, PAD

    vocab = {token: i for i, token in enumerate(tokenizer.tokens)}
    # an unk token absent from the vocabulary: encoding an unknown character raises
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tokenizer.bos_token_id)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.save_pretrained(str(out))


def export_checkpoint(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None
) -> pathlib.Path:
    """Convert a kept rollbook checkpoint into a Hugging Face directory at ``out``.

    ``checkpoint``: a checkpoint directory (``RUN_DIR/checkpoints/step-NNNNNN``), or a run directory
    or its ``checkpoints/`` (then the one ``LATEST`` names). ``out`` must not exist or be empty.
    Errors the user must fix (no checkpoint there, an unreadable or corrupt one, weights that do not
    fit the architecture) are one-line ``CommandError``s."""
    from rollbook.errors import CommandError

    path = resolve_checkpoint(checkpoint)
    if tokenizer_dir is not None and not any((pathlib.Path(tokenizer_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise CommandError(f"--tokenizer {tokenizer_dir}: no tokenizer files there ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"--to {out}: exists and is not an empty directory")
    try:
        blob = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        state = blob["model"]
        if not isinstance(state, dict):
            raise TypeError(f"'model' is a {type(state).__name__}, not a state dict")
    except Exception as exc:  # noqa: BLE001 - a checkpoint that does not load is the user's to fix
        raise CommandError(f"{path}: corrupt checkpoint: state.pt does not load ({' '.join(str(exc).split())[:200]})") from None
    model, model_config = _checkpoint_model(path)
    if tokenizer_dir is None:  # the tokenizer the run used, as its resolved config names it
        tokenizer_dir = _run_tokenizer(path)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), str(exc))
        raise CommandError(f"{path}: the weights do not fit the model's architecture ({first[:200]})") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_hf_dir(model, model_config, out, tokenizer_dir=tokenizer_dir, dtype=_run_dtype(path))


def resolve_checkpoint(checkpoint: str | os.PathLike) -> pathlib.Path:
    """The checkpoint directory meant by a checkpoint, ``checkpoints/`` or run directory path."""
    from rollbook.errors import CommandError

    p = pathlib.Path(checkpoint)
    if not p.exists():
        raise CommandError(f"{p}: no such checkpoint")
    if not (p / "state.pt").exists():
        for latest in (p / "LATEST", p / "checkpoints" / "LATEST"):
            if latest.is_file():
                p = latest.parent / latest.read_text().strip()
                break
    if not (p / "state.pt").is_file():
        raise CommandError(f"{p}: not a rollbook checkpoint (no state.pt; kept checkpoints are RUN_DIR/checkpoints/step-NNNNNN)")
    return p


def _checkpoint_model(path: pathlib.Path) -> tuple[torch.nn.Module, ModelConfig]:
    """An empty model of the checkpoint's architecture, and the run's ``ModelConfig`` (tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollbook.errors import CommandError
    from rollbook.language_models import build_student

    model_config = _run_model_config(path)
    if (path / "config.json").is_file():
        try:
            hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged config.json
            raise CommandError(
                f"{path}: corrupt checkpoint: config.json does not load ({' '.join(str(exc).split())[:200]})"
            ) from None
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        _restore_generation_config(model, path, model_config)
        return model, model_config or ModelConfig()
    if model_config is None:
        raise CommandError(
            f"{path}: no config.json in the checkpoint and no run config at {path.parent.parent / 'config.json'}: "
            "the model's architecture is unknown"
        )
    return build_student(model_config), model_config


def _restore_generation_config(model: torch.nn.Module, path: pathlib.Path, model_config: ModelConfig | None) -> None:
    """The generation config the run's model held: the checkpoint's ``generation_config.json``, else
    (a checkpoint written before it) the one of the run's ``model.path``, else the model's default."""
    from transformers import GenerationConfig

    from rollbook.errors import CommandError

    for source in (path, pathlib.Path(model_config.path) if model_config and model_config.path else None):
        if source is not None and (source / "generation_config.json").is_file():
            try:
                generation = GenerationConfig.from_pretrained(source, local_files_only=True)
            except Exception as exc:  # noqa: BLE001 - a damaged generation_config.json
                raise CommandError(
                    f"{source}: generation_config.json does not load ({' '.join(str(exc).split())[:200]})"
                ) from None
            model.generation_config = generation  # type: ignore[assignment]  # a transformers PreTrainedModel, typed as its nn.Module base
            return


def _run_model_config(path: pathlib.Path) -> ModelConfig | None:
    """The student's ``ModelConfig`` from the run's resolved config (a ``RunConfig`` or a
    ``TrainerConfig``), ``RUN_DIR/config.json`` beside ``checkpoints/``; None when there is none."""
    run_config = path.parent.parent / "config.json"
    if not run_config.is_file():
        return None
    try:
        data = json.loads(run_config.read_text())
        return ModelConfig(**data.get("trainer", data)["model"])
    except Exception:  # noqa: BLE001 - not a rollbook run config: fall back to the defaults
        log.warning("%s: no trainer model section; exporting with the task tokenizer", run_config)
        return None


def _run_dtype(path: pathlib.Path) -> str:
    """``trainer.dtype`` of the run's resolved config (``RUN_DIR/config.json``): what its own exports
    hold; float32 without one."""
    try:
        data = json.loads((path.parent.parent / "config.json").read_text())
        dtype = data.get("trainer", data).get("dtype", "float32")
    except (OSError, ValueError, AttributeError):
        return "float32"
    return dtype if dtype in ("float32", "bfloat16") else "float32"


def _run_tokenizer(path: pathlib.Path) -> str | None:
    """``trainer.tokenizer`` of the run's resolved config (``RUN_DIR/config.json``), if it names one
    that still exists; else None (the model's own or the character tokenizer)."""
    try:
        data = json.loads((path.parent.parent / "config.json").read_text())
        tokenizer = data.get("trainer", data).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(tokenizer, str) and pathlib.Path(tokenizer).is_dir():
        return tokenizer
    if tokenizer:
        log.warning("%s: the run's tokenizer %s is gone; exporting the model's", path, tokenizer)
    return None


def _copy_tokenizer_files(src: pathlib.Path, out: pathlib.Path) -> bool:
    copied = False
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            copied = True
    return copied


def _fill_special_token_ids(directory: pathlib.Path) -> None:
    """Give the export's generation config the tokenizer's eos / pad / bos ids where it has none, so
    ``generate`` stops on end of sequence (a tiny model is built without them). config.json is left
    as saved (its pad_token_id would become the embedding's padding_idx in a model built from it)."""
    from transformers import AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception:  # noqa: BLE001 - no loadable tokenizer: leave the model's ids as they are
        return
    path = directory / "generation_config.json"
    generation = GenerationConfig.from_pretrained(directory) if path.exists() else GenerationConfig()
    changed = False
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None and getattr(generation, name, None) is None:
            setattr(generation, name, value)
            changed = True
    if changed:
        generation.save_pretrained(directory)


def _prune(root: pathlib.Path, newest: str, keep_last: int) -> None:
    """Keep ``newest`` and the ``keep_last - 1`` exports before it (a later one, left by a run rolled
    back by hand, is removed, as in ``trainer.checkpoint``)."""
    older = sorted(p.name for p in root.glob("step-*") if p.name < newest)
    keep = {newest, *(older[len(older) - (keep_last - 1) :] if keep_last > 1 else [])}
    for p in root.glob("step-*"):
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
