"""Rollbook: a durable, queryable trajectory store for RL on language models.

The top-level folders of the repository install as subpackages: ``rollbook.store`` (ledger, gRPC
service, SQL), ``rollbook.validator`` (evidence rules, normalization), ``rollbook.trainer`` (losses,
loop), ``rollbook.rollout`` (engines, worker, spool) and ``rollbook.v1`` (wire contract). What several
of them share sits in this package, below them all (``config``, ``trajectories``, ``tasks``, ``models``,
``weights``, ``client``); the commands (``cli``, ``run``, ...) sit above them all. The rules:
``docs/design.md``, "What each folder may import", checked by ``tests/unit/test_imports.py``.
"""

__version__ = "0.1.0"
