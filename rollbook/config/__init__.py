"""Every configuration of rollbook, in one package that imports only pydantic, the standard library
and ``rollbook.errors``: ``import rollbook.config`` (to validate a config file, list its fields, or
write the resolved config) loads no store, trainer, rollout worker, DuckDB, gRPC, Arrow, numpy or
torch.

- ``run.py``: ``RunConfig`` (``rollbook run``) and its own sections: ``WarmStartConfig``,
  ``OnlineConfig``, ``TrackerConfig``, ``RayConfig``.
- ``store.py``: ``StoreConfig`` (``rollbook serve``, ``[store]``), ``ValidatorConfig``, ``NormConfig``,
  ``IngestConfig``, ``AgeingConfig``; the key and address rules a store config must pass.
- ``trainer.py``: ``TrainerConfig`` (``rollbook train``, ``[trainer]``), ``LossConfig``,
  ``TeacherConfig``, ``WeightStreamConfig`` (the trainer's network weight channel).
- ``rollout.py``: ``RolloutConfig`` (``[rollout]``), ``WorkerConfig`` (``rollbook rollout``),
  ``DatasetConfig``, ``FieldMap``, ``RewardConfig`` (your own data), ``ProxyConfig`` (``rollbook proxy``).
- ``language_model.py``: ``ModelConfig``, the student every component builds alike.
- ``load.py``: ``load_config`` (defaults, then ``--config FILE``, then dotted overrides),
  ``read_config_file``, ``parse_overrides``, ``field_help`` (``--help-config``), ``write_resolved``.

What a config means at run time (TLS credentials, the SQL sandbox's limits, the code sandbox's
limits, the environment's values) is computed by the module that uses it, from the config's fields
(e.g. ``store/server.py`` ``store_tls``). ``tests/unit/test_config_home.py`` checks the import rule.
"""

from rollbook.config.language_model import ModelConfig
from rollbook.config.load import field_help, load_config, parse_overrides, read_config_file, write_resolved
from rollbook.config.rollout import DatasetConfig, FieldMap, ProxyConfig, RewardConfig, RolloutConfig, WorkerConfig
from rollbook.config.run import (
    ONLINE_MAX_STALENESS,
    SEPARATED_MAX_STALENESS,
    OnlineConfig,
    RayConfig,
    RunConfig,
    TrackerConfig,
    WarmStartConfig,
)
from rollbook.config.store import AgeingConfig, IngestConfig, NormConfig, StoreConfig, ValidatorConfig
from rollbook.config.trainer import LossConfig, TeacherConfig, TrainerConfig, WeightStreamConfig

__all__ = [
    "AgeingConfig",
    "ONLINE_MAX_STALENESS",
    "SEPARATED_MAX_STALENESS",
    "DatasetConfig",
    "FieldMap",
    "IngestConfig",
    "LossConfig",
    "ModelConfig",
    "NormConfig",
    "OnlineConfig",
    "ProxyConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "StoreConfig",
    "TeacherConfig",
    "TrackerConfig",
    "TrainerConfig",
    "ValidatorConfig",
    "WarmStartConfig",
    "WeightStreamConfig",
    "WorkerConfig",
    "field_help",
    "load_config",
    "parse_overrides",
    "read_config_file",
    "write_resolved",
]
