"""``rollbook train``: the trainer as its own process against a running store (weights are
published to the store's version registry; rollout workers get them through a weight channel)."""

from __future__ import annotations

import logging

from rollbook.client import StoreClient
from rollbook.trainer.config import TrainerConfig

log = logging.getLogger("rollbook.trainer")


def train(config: TrainerConfig) -> list[dict]:
    import torch

    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.setup import build_student, build_teachers

    if config.loss.distill_coef > 0 and not config.teachers:
        raise ValueError("loss.distill_coef > 0 needs at least one [[teachers]] entry (or set loss.distill_coef = 0)")
    torch.set_num_threads(2)
    publishers, weight_server = [], None
    if config.weight_server:
        from rollbook.rollout.weights.network import NetworkPublisher, create_weight_server
        from rollbook.tls import ServerTLS

        host, _, port = config.weight_server.rpartition(":")
        publisher = NetworkPublisher()
        # TLS with the same certificate as the store's when ROLLBOOK_TLS_CERT/ROLLBOOK_TLS_KEY are set
        weight_server, bound = create_weight_server(publisher, host or "127.0.0.1", int(port), tls=ServerTLS.from_env())
        weight_server.start()
        publishers.append(publisher.publish)
        log.info("serving weights on %s:%d", host or "127.0.0.1", bound)
    try:
        with StoreClient.from_env(config.server, trainer_key=config.trainer_key) as client:
            trainer = Trainer(config, client, model=build_student(config.model), teacher=build_teachers(config),
                              publishers=publishers)
            history = trainer.run()
    finally:
        if weight_server is not None:
            weight_server.stop(grace=5)
    log.info("done: %d steps, version %d", trainer.state.step, trainer.state.version)
    return history
