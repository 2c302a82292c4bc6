"""The local files a run names, checked before its store starts (``check_inputs``), so a typo or a
bad dataset row is one line and no ledger is created."""

from __future__ import annotations

import pathlib


def check_inputs(config) -> int:
    """The local files a ``RunConfig`` names, checked before the store process starts (so a typo is one
    line and no ledger is created): the experiment trackers turned on (installed?), the devices and
    dtypes (there? able?), the student, teacher and reference model directories, the rollout's
    longest request against the student's positions (``rollout.max_prompt_tokens +
    rollout.max_new_tokens``, rollout/engines.py ``check_fits``), the dataset
    files (every row too, under ``on_bad_row = "fail"``) and the tokenizer directory (loaded: it is small). Returns the vocabulary size to register
    (``rollout/worker.py`` ``registered_vocab_size``; a tiny model of unset size trained on a dataset
    takes its tokenizer's, which is then written into ``trainer.model.vocab_size`` so that the student
    built later has those rows). Raises ``ConfigError``."""
    from rollbook.errors import ConfigError
    from rollbook.language_models import check_model_dir
    from rollbook.rollout.worker import registered_vocab_size, tokenizer_for, use_model_tokenizer
    from rollbook.tracking import check_tracker

    check_tracker(config.tracker)  # a tracker turned on but not installed: one line now, not an ImportError mid-run
    if config.placement != "ray":  # under ray the models run on the actors' nodes, which check there
        from rollbook import devices

        devices.check(config.trainer.device, config.trainer.dtype)
        devices.check(config.rollout.device, config.rollout.dtype)
    trainer, rollout = config.trainer, config.rollout
    if trainer.model.path:
        check_model_dir(trainer.model.path, "model.path")
    if config.online is None:  # the rollout's longest request fits the model (the online proxy sizes itself)
        from rollbook.rollout.engines import check_fits

        check_fits(trainer.model, rollout, field="trainer.model.path")
    for teacher in trainer.teachers:
        check_model_dir(teacher.path, "teacher")
    if trainer.loss.kl_coef > 0 and trainer.reference != "initial":
        check_model_dir(trainer.reference, "reference")
    if rollout.dataset is None:
        if trainer.tokenizer is not None:
            raise ConfigError(
                "trainer.tokenizer applies with [rollout.dataset] (the toy tasks use their character "
                "tokenizer): set rollout.tokenizer with a dataset, or remove it"
            )
        return registered_vocab_size(rollout, trainer.model)
    for name in [*rollout.dataset.train_files, *rollout.dataset.heldout_files]:
        if not pathlib.Path(name).is_file():
            raise ConfigError(f"rollout.dataset: dataset file {name} does not exist")
    if trainer.tokenizer and rollout.tokenizer and trainer.tokenizer != rollout.tokenizer:
        raise ConfigError(
            f"trainer.tokenizer {trainer.tokenizer!r} and rollout.tokenizer {rollout.tokenizer!r} differ: "
            "set rollout.tokenizer only (the trainer exports the tokenizer the rollout encodes with)"
        )
    rollout.tokenizer = rollout.tokenizer or trainer.tokenizer
    use_model_tokenizer(rollout, trainer.model)  # no tokenizer given: the model directory's
    tokenizer = tokenizer_for(rollout)
    trainer.tokenizer = rollout.tokenizer  # exported with the model (trainer/export.py export_tokenizer)
    vocab = registered_vocab_size(rollout, trainer.model)
    if trainer.model.path is None and trainer.model.vocab_size is None:
        trainer.model.vocab_size = vocab
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer {rollout.tokenizer or '(characters)'} has {tokenizer.vocab_size} ids, the model "
            f"{vocab}: the model cannot read or emit all of its ids (model.vocab_size, model.path)"
        )
    if rollout.dataset.on_bad_row == "fail":
        _refuse_bad_rows(rollout, tokenizer)
    return vocab


def _refuse_bad_rows(rollout, tokenizer) -> None:
    """``on_bad_row = "fail"``: every row read and checked now as the rollout will check it (the
    fields its domain's reward needs, a domain with a reward, a prompt the tokenizer encodes within
    ``rollout.max_prompt_tokens``), so a bad row refuses the run in one line (``DatasetError``) before
    its store starts."""
    from rollbook.datasets import BadRow, DatasetError, load_dataset
    from rollbook.rollout.engines import rollout_prompt_tokens
    from rollbook.rollout.worker import _NEEDS, encode_row

    dataset = rollout.dataset
    needs = {domain: _NEEDS.get(r.kind, ()) for domain, r in rollout.rewards.items()}
    data = load_dataset(dataset, requirements=needs, known_domains=set(rollout.rewards))  # raises on a bad field
    bad = []
    for row in [*data.train, *data.heldout]:
        _, problem = encode_row(tokenizer, row, rollout_prompt_tokens(rollout))
        if problem is not None:
            path, _, line = row.source.rpartition(":")
            bad.append(BadRow(path, int(line) if line.isdigit() else 0, problem))
    if bad:
        shown = "; ".join(str(b) for b in bad[:20]) + (f"; ... and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise DatasetError(f"{len(bad)} bad rows (on_bad_row = 'fail'): {shown}")
