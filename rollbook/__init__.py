"""Rollbook: a durable, queryable trajectory store for RL on language models.

The top-level folders of the repository install as subpackages: ``rollbook.store`` (ledger, gRPC
service, SQL), ``rollbook.validator`` (evidence rules, normalization), ``rollbook.trainer`` (losses,
loop), ``rollbook.rollout`` (engines, tasks, weight channel) and ``rollbook.v1`` (wire contract).
"""

__version__ = "0.1.0"
