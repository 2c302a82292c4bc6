"""``rollbook train``: the trainer as its own process against a running store (weights are
published to the store's version registry; rollout workers get them through a weight channel).

The model must be registered first (``rollbook admin register-model``, admin key); with
``ROLLBOOK_ADMIN_KEY`` in its environment ``train`` registers it itself. While no batch is ready it
logs one progress line every ``PROGRESS_EVERY_S`` seconds (a third of ``max_wait_s`` if less), and gives up after ``max_wait_s`` in one
line (a ``CommandError``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from rollbook.client import StoreClient
from rollbook.config import TrainerConfig

if TYPE_CHECKING:
    from rollbook.trainer.drive import Outcome

log = logging.getLogger("rollbook.trainer")

PROGRESS_EVERY_S = 10.0


def train(config: TrainerConfig) -> list[dict]:
    """Train to ``num_steps``; with ``num_ranks > 1`` (or under torchrun) as rank 0 of a data-parallel
    group whose other ranks this process starts, replicated or sharded (``data_parallel``; every rank
    reads it from the same config). Under torchrun (the launcher started every rank) each rank exits
    with status 0 once it is done (``_leave``) instead of returning."""
    import torch.distributed as dist

    size_for_tokenizer(config)  # before any rank builds its student: every rank sizes it alike
    if dist.is_torchelastic_launched():  # torchrun: env:// rendezvous, every rank runs this same command
        from rollbook.trainer.distributed import init_group

        rank, _ = init_group(backend=config.dist_backend, device=config.device, timeout_s=config.dist_timeout_s)
        try:
            if rank == 0:
                train_rank(config)
            else:
                follow(config)
        finally:
            dist.destroy_process_group()
        _leave()  # every rank here is a trained gloo rank (see _leave); the launcher reads exit code 0
    if config.num_ranks == 1:
        return train_rank(config).history
    return _spawned(config)


def train_rank(
    config: TrainerConfig,
    *,
    publishers: list | None = None,
    build=None,
    on_weight_port=None,
    on_start=None,
    drive_with: dict | None = None,
) -> Outcome:
    """The trainer (rank 0 of a joined process group, or the only one): store client, weight
    publishers, the drive loop (trainer/drive.py). ``publishers``, ``build`` (returns (student,
    teacher)), ``on_weight_port`` (told the weight server's bound port), ``on_start`` (called once the
    first version is published and announced, before the first pull) and ``drive_with`` (more
    arguments of ``drive``: a placement that evaluates, ``eval_every``, ``metrics``, ``say``) let a
    launcher (the ray placement of ``rollbook run``) add its own."""
    import torch
    import torch.distributed as dist

    from rollbook.errors import ConfigError
    from rollbook.language_models import build_student
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.model_builders import build_teachers

    if config.loss.distill_coef > 0 and not config.teachers and build is None:
        raise ConfigError("loss.distill_coef > 0 needs at least one [[teachers]] entry (or set loss.distill_coef = 0)")
    size_for_tokenizer(config)  # a tiny student of the tokenizer's vocabulary: before any model is built
    torch.set_num_threads(2 if not dist.is_initialized() else 1)
    publishers, weight_server = list(publishers or []), None
    if config.weight_server:
        from rollbook.tls import ServerTLS
        from rollbook.weights.network import NetworkPublisher, create_weight_server

        host, _, port = config.weight_server.rpartition(":")
        publisher = NetworkPublisher()
        # TLS with the same certificate as the store's when ROLLBOOK_TLS_CERT/ROLLBOOK_TLS_KEY are set
        weight_server, bound = create_weight_server(publisher, host or "127.0.0.1", int(port), tls=ServerTLS.from_env())
        weight_server.start()
        publishers.append(publisher.publish)
        log.info("serving weights on %s:%d", host or "127.0.0.1", bound)
        if on_weight_port is not None:
            on_weight_port(bound)
    cls: type[Trainer] = Trainer
    if dist.is_initialized():
        from rollbook.trainer.distributed import DistributedTrainer

        cls = DistributedTrainer
    student, teacher = build() if build is not None else (build_student(config.model), build_teachers(config))
    try:
        with StoreClient.from_env(config.server, trainer_key=config.trainer_key) as client:
            trainer = cls(config, client, model=student, teacher=teacher, publishers=publishers)
            _start(trainer, client, config)
            if on_start is not None:
                on_start()
            outcome = _run(trainer, config, **(drive_with or {}))
    finally:
        if weight_server is not None:
            weight_server.stop(grace=5)
    log.info("done: %d steps, version %d", trainer.state.step, trainer.state.version)
    return outcome


def size_for_tokenizer(config: TrainerConfig) -> int | None:
    """The vocabulary size of ``config.tokenizer`` (None without one), loaded from its local
    directory; a tiny student of unset ``model.vocab_size`` is given that size (``model.vocab_size`` is
    set), as ``rollbook run`` and ``rollbook rollout`` size it for the same tokenizer. Call it before
    the student is built. A directory that is not a tokenizer is a one-line ``ConfigError``."""
    if config.tokenizer is None:
        return None
    from rollbook.errors import ConfigError
    from rollbook.tasks import TOKENIZER
    from rollbook.tokenizers import load_tokenizer

    try:
        vocab = load_tokenizer(config.tokenizer, default=TOKENIZER).vocab_size
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer: {exc}") from None
    if config.model.path is None and config.model.vocab_size is None:
        config.model.vocab_size = vocab
    return vocab


def registered_vocab(student, config: TrainerConfig, tokenizer_vocab: int | None = None) -> int:
    """The vocabulary ``rollbook train`` registers: the student's embedding rows
    (``rollbook.language_models.model_vocab_size``), the ids the store's token check admits. A tokenizer with
    more ids than that (``tokenizer_vocab``) is a ``ConfigError``: the model could not read them."""
    from rollbook.errors import ConfigError
    from rollbook.language_models import model_vocab_size

    vocab = model_vocab_size(student)
    if tokenizer_vocab is not None and tokenizer_vocab > vocab:
        raise ConfigError(
            f"the tokenizer {config.tokenizer} has {tokenizer_vocab} ids, the model {vocab}: the model "
            "cannot read or emit all of its ids (model.vocab_size, model.path)"
        )
    return vocab


def follow(config: TrainerConfig, *, build=None) -> list[dict]:
    """Ranks 1..N-1: no store client, no publisher; every step follows rank 0's pull."""
    import torch

    from rollbook.language_models import build_student
    from rollbook.trainer.distributed import DistributedTrainer
    from rollbook.trainer.model_builders import build_teachers

    torch.set_num_threads(1)
    student, teacher = build() if build is not None else (build_student(config.model), build_teachers(config))
    trainer = DistributedTrainer(config, None, model=student, teacher=teacher)
    trainer.start()
    history = []
    while trainer.state.step < config.num_steps:
        stats = trainer.step()
        if stats is not None:
            history.append(stats)
    return history


def _spawned(config: TrainerConfig) -> list[dict]:
    """``num_ranks`` ranks on this host: this process is rank 0, ranks 1..N-1 are spawned children
    (a tcp:// rendezvous on a free loopback port); a child that fails fails rank 0's next collective."""
    import multiprocessing
    import socket

    import torch.distributed as dist

    from rollbook.trainer.distributed import init_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    children = [
        ctx.Process(
            target=_child,
            args=(config, rank, init_method, logging.getLogger().level),
            daemon=True,
            name=f"rollbook-trainer-rank{rank}",
        )
        for rank in range(1, config.num_ranks)
    ]
    for child in children:
        child.start()
    try:
        init_group(
            0, config.num_ranks, init_method, backend=config.dist_backend, device=config.device, timeout_s=config.dist_timeout_s
        )
        history = train_rank(config).history
        for child in children:
            child.join(timeout=60)
        return history
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for child in children:
            if child.is_alive():
                child.terminate()
                child.join(timeout=10)


def _child(config: TrainerConfig, rank: int, init_method: str, level: int) -> None:
    import multiprocessing

    import torch.distributed as dist

    from rollbook.lifetime import exit_with_parent
    from rollbook.trainer.distributed import init_group

    parent = multiprocessing.parent_process()
    exit_with_parent(parent.pid if parent is not None else None)  # rank 0 killed (SIGKILL runs no `finally`)

    logging.basicConfig(level=level, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    init_group(
        rank, config.num_ranks, init_method, backend=config.dist_backend, device=config.device, timeout_s=config.dist_timeout_s
    )
    try:
        follow(config)
    finally:
        dist.destroy_process_group()
    _leave()


def _leave() -> NoReturn:
    """A rank that finished: flush and exit 0 without the interpreter's teardown. There a rank that
    trained (a transformers model, backward, gloo collectives) aborted now and then in C++ ("terminate
    called without an active exception", SIGABRT: a thread still joinable when its owner is destroyed
    at exit): 7 of 40 two-rank runs in a reproduction, 0 of 40 leaving this way; a torchrun rank 1
    did it once in CI. Only after success: an exception in the rank still propagates as usual."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(trainer, client, config: TrainerConfig) -> None:
    """``trainer.start()``, registering the model first when the admin key is at hand (its vocabulary:
    ``registered_vocab``); a store that is down or a model nobody registered is a one-line ``CommandError``."""
    import grpc

    from rollbook.errors import CommandError, unreachable

    vocab = registered_vocab(trainer.model, config, size_for_tokenizer(config))
    if client.admin_key:
        client.register_model(config.model_id, vocab_size=vocab)
    try:
        trainer.start()
    except grpc.RpcError as exc:
        reason = unreachable(exc, config.server)
        if reason is not None:
            raise CommandError(reason) from None
        if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION) and "register" in exc.details():
            raise CommandError(
                f"{exc.details()} at {config.server}: register it first with `rollbook admin "
                f"register-model {config.model_id}` (admin key in ROLLBOOK_ADMIN_KEY)"
            ) from None
        raise


def _run(trainer, config: TrainerConfig, **drive_with) -> Outcome:
    """Train to ``num_steps`` (trainer/drive.py); while no batch is ready, say so every
    ``PROGRESS_EVERY_S`` seconds (a third of ``max_wait_s`` if less)."""
    from rollbook.trainer.drive import drive

    return drive(
        trainer,
        num_steps=config.num_steps,
        max_wait_s=config.max_wait_s,
        poll_interval_s=config.poll_interval_s,
        progress_every_s=min(PROGRESS_EVERY_S, config.max_wait_s / 3),
        **drive_with,
    )
