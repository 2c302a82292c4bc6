"""What the placements of ``rollbook run`` (run.py: colocated, run_separated.py: separated, run_ray.py:
ray) share: the store's child process (``StoreProcess``), the metrics file, installing a published
version into an in-process engine, the console line of a step, and reading how far a run
directory's trainer got. Its own module so no placement imports another's internals."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from rollbook import env as rollbook_env
from rollbook.lifetime import child_env


class MetricsLog:
    """Appends one JSON object per line; remembers the latest evaluation."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._last_eval: dict = {}

    def write(self, row: dict) -> None:
        row = {"time": time.time(), **row}
        if "eval/reward" in row:
            self._last_eval = {k: v for k, v in row.items() if k.startswith("eval/") or k == "step"}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def last_eval(self) -> dict:
        return self._last_eval


def install_weights(engine, version: int, state_dict) -> None:
    """A weight publisher for an engine in this process: take ``version`` when it is newer."""
    if version > engine.version:
        engine.update_weights(state_dict, version)


def heldout_text(evals: dict) -> str:
    """``0.611 greedy, 0.540 sampled`` (the sampled figure when the evaluation made one)."""
    text = f"{evals['eval/reward']:.3f} greedy"
    if "eval/sampled_reward" in evals:
        text += f", {evals['eval/sampled_reward']:.3f} sampled"
    return text


def step_line(stats: dict, num_steps: int, *, extra: str = "") -> str:
    """The console line of a finished step. ``step`` is the ``train_steps.step`` of the row the
    trainer reported (0-based, as in SQL); ``done/num_steps`` counts the steps finished."""
    step = int(stats["step"])
    return (
        f"step {step:4d} ({step + 1}/{num_steps} done)  train reward {stats['reward/mean']:.3f}  "
        f"held-out {heldout_text(stats)}  loss {stats['loss/total']:+.4f}  {extra}"
        f"{stats['perf/tokens_per_s']:.0f} tok/s"
    )


def steps_done(run_dir: pathlib.Path) -> int:
    """Trainer steps the run directory's latest checkpoint holds (0 without one); reads JSON only."""
    root = pathlib.Path(run_dir) / "checkpoints"
    try:
        name = (root / "LATEST").read_text().strip()
        return int(json.loads((root / name / "trainer.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def check_inputs(config) -> int:
    """The local files a ``RunConfig`` names, checked before the store process starts (so a typo is one
    line and no ledger is created): the student, teacher and reference model directories, the dataset
    files and the tokenizer directory (loaded: it is small). Returns the vocabulary size to register
    (``rollout/worker.py`` ``registered_vocab_size``; a tiny model of unset size trained on a dataset
    takes its tokenizer's, which is then written into ``trainer.model.vocab_size`` so that the student
    built later has those rows). Raises ``ConfigError``."""
    from rollbook.errors import ConfigError
    from rollbook.models import check_model_dir
    from rollbook.rollout.worker import registered_vocab_size, tokenizer_for, use_model_tokenizer

    trainer, rollout = config.trainer, config.rollout
    if trainer.model.path:
        check_model_dir(trainer.model.path, "model.path")
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
    return vocab


class StoreProcess:
    """A ``rollbook serve`` child process on the run directory's ledger. The keys go to it through
    the environment (never the command line, which other users can read in ``ps``); a role given no
    key stays open (loopback only). ``tls`` (``rollbook.tls.ServerTLS``) turns TLS on; ``client()``
    then needs ``client_tls``."""

    def __init__(
        self,
        db: pathlib.Path,
        *,
        admin_key: str | None = None,
        trainer_key: str | None = None,
        worker_key: str | None = None,
        reader_key: str | None = None,
        port: int = 0,
        env: dict[str, str] | None = None,
        tls=None,
        client_tls=None,
        extra_args: tuple[str, ...] = (),
        config_file: str | pathlib.Path | None = None,
    ):
        self.db = pathlib.Path(db)
        self.keys = {"worker_key": worker_key, "trainer_key": trainer_key, "reader_key": reader_key, "admin_key": admin_key}
        self.admin_key, self.trainer_key = admin_key, trainer_key
        self.client_tls = client_tls
        env = rollbook_env.with_keys(dict(os.environ if env is None else env), self.keys)
        args = ["--db", str(db), "--port", str(port), "--log-level", "WARNING", *extra_args]
        if config_file is not None:  # store policies (StoreConfig fields); the flags above win
            args += ["--config", str(config_file)]
        if tls is not None:
            args += ["--tls-cert", tls.cert, "--tls-key", tls.key] + (["--tls-client-ca", tls.client_ca] if tls.client_ca else [])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollbook.cli", "serve", *args], stdout=subprocess.PIPE, text=True, env=child_env(env)
        )
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError(f"store did not start (exit {self.proc.wait()}): {line!r}")
        self.address = line.removeprefix("listening on ")

    def client(self, **kwargs):
        """A ``StoreClient`` holding every key."""
        from rollbook.client import StoreClient

        return StoreClient(self.address, **{**self.keys, "tls": self.client_tls, **kwargs})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
