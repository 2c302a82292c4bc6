"""rollbook/config/: dotted overrides, config files, one source of truth in RunConfig, the
[store] section, and the field listing behind ``--help-config``. No torch, no processes.

Run: ``python -m pytest tests/unit/test_config.py -q``.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from rollbook.config import RunConfig, load_config, parse_overrides

QUICKSTART = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml")


def _error_type():
    from rollbook.errors import ConfigError

    return ConfigError


# ---- overrides and files -------------------------------------------------------------------------


def test_overrides_nest_and_parse_toml_scalars():
    got = parse_overrides(
        [
            "--trainer.lr",
            "1e-4",
            "--placement=separated",
            "--rollout.domains",
            '["reverse"]',
            "--trainer.loss.dual-clip",
            "3",
            "--store.validate_evidence",
            "false",
        ]
    )
    assert got == {
        "trainer": {"lr": 1e-4, "loss": {"dual_clip": 3}},
        "placement": "separated",
        "rollout": {"domains": ["reverse"]},
        "store": {"validate_evidence": False},
    }


@pytest.mark.parametrize("argv", [["trainer.lr", "1"], ["--num_steps"]], ids=["no-dashes", "no-value"])
def test_a_malformed_override_is_a_config_error(argv):
    with pytest.raises(_error_type()):
        load_config(RunConfig, None, argv)


def test_a_missing_config_file_is_one_line_naming_it(tmp_path):
    with pytest.raises(_error_type()) as info:
        load_config(RunConfig, str(tmp_path / "nope.toml"), [])
    assert "nope.toml" in str(info.value) and "not found" in str(info.value) and "\n" not in str(info.value)


def test_a_config_file_that_does_not_parse_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("num_steps = = 3\n")
    with pytest.raises(_error_type()) as info:
        load_config(RunConfig, str(bad), [])
    assert "bad.toml" in str(info.value)


def test_an_unknown_field_anywhere_is_refused_with_its_dotted_name():
    for override in (
        ["--no_such", "1"],
        ["--trainer.no_such", "1"],
        ["--store.no_such", "1"],
        ["--store.validator.no_such", "1"],
        ["--store.ingest.no_such", "1"],
    ):
        with pytest.raises(_error_type()) as info:
            load_config(RunConfig, None, override)
        assert "no_such" in str(info.value) and "\n" not in str(info.value), override


def test_json_config_files_load(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"num_steps": 7, "trainer": {"lr": 0.01}}))
    config = load_config(RunConfig, str(path), [])
    assert config.num_steps == config.trainer.num_steps == 7 and config.trainer.lr == 0.01


# ---- one source of truth ---------------------------------------------------------------------------


def test_trainer_num_steps_alone_is_honoured_not_overwritten():
    config = load_config(RunConfig, None, ["--trainer.num_steps", "5"])
    assert config.num_steps == 5 and config.trainer.num_steps == 5


def test_run_level_num_steps_and_run_dir_reach_the_trainer():
    config = load_config(RunConfig, None, ["--num_steps", "12", "--run_dir", "runs/x"])
    assert (config.trainer.num_steps, config.trainer.run_dir) == (12, "runs/x")


def test_conflicting_num_steps_are_refused_not_silently_resolved():
    with pytest.raises(ValueError, match="num_steps"):  # the file says 40, the flag 5
        load_config(RunConfig, QUICKSTART, ["--trainer.num_steps", "5"])
    with pytest.raises(ValueError, match="run_dir"):
        load_config(RunConfig, None, ["--run_dir", "runs/a", "--trainer.run_dir", "runs/b"])


def test_agreeing_copies_are_accepted():
    config = load_config(RunConfig, None, ["--num_steps", "9", "--trainer.num_steps", "9"])
    assert config.trainer.num_steps == 9


def test_staleness_defaults_by_placement_and_one_bound_reaches_both_sides():
    colocated = load_config(RunConfig, None, [])
    assert colocated.max_staleness == colocated.trainer.max_staleness == colocated.rollout.max_staleness == 0
    separated = load_config(RunConfig, QUICKSTART, ["--placement", "separated"])
    assert separated.max_staleness == separated.trainer.max_staleness == separated.rollout.max_staleness == 2
    one_side = load_config(RunConfig, None, ["--placement", "separated", "--trainer.max_staleness", "3"])
    assert one_side.rollout.max_staleness == 3 and one_side.max_staleness == 3


def test_staleness_bounds_that_disagree_are_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        load_config(RunConfig, None, ["--trainer.max_staleness", "1", "--rollout.max_staleness", "2"])
    with pytest.raises(ValueError, match="max_staleness"):
        load_config(RunConfig, None, ["--max_staleness", "1", "--trainer.max_staleness", "0"])


def test_a_resolved_config_validates_again_unchanged():
    config = load_config(RunConfig, QUICKSTART, ["--placement", "separated"])
    again = RunConfig.model_validate(config.model_dump(mode="json"))
    assert again == config


# ---- the [store] section ---------------------------------------------------------------------------


def test_store_section_sets_policies_and_refuses_what_the_run_owns(tmp_path):
    config = load_config(RunConfig, None, ["--store.validator.norm.mode", "group_mean", "--store.query_max_rows", "7"])
    assert config.store.validator.norm.mode == "group_mean" and config.store.query_max_rows == 7
    import secrets

    for owned, value in (("db", "x.duckdb"), ("port", "1"), ("host", "localhost"), ("admin_key", secrets.token_hex(16))):
        with pytest.raises(_error_type(), match=f"store.{owned}"):
            load_config(RunConfig, None, [f"--store.{owned}", value])


def test_store_json_for_the_child_holds_the_policies_and_no_key(tmp_path):
    from rollbook.config import StoreConfig
    from rollbook.run.main import write_store_config

    config = load_config(RunConfig, None, ["--store.validator.incomplete_group_policy", "drop"])
    path = write_store_config(config, tmp_path)
    data = json.loads(path.read_text())
    assert not {"db", "host", "port", "admin_key", "worker_key"} & data.keys()
    assert StoreConfig.model_validate(data).validator.incomplete_group_policy == "drop"


def test_store_configs_forbid_unknown_fields():
    from rollbook.config import IngestConfig, StoreConfig, ValidatorConfig

    for model in (StoreConfig, IngestConfig, ValidatorConfig):
        with pytest.raises(ValueError, match="no_such"):
            model.model_validate({"no_such": 1})


# ---- --help-config ---------------------------------------------------------------------------------


def _leaves(model, prefix=""):
    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaves(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_field_help_lists_every_leaf_with_type_default_and_description():
    from rollbook.config import field_help

    text = "\n".join(field_help(RunConfig))
    for leaf in _leaves(RunConfig):
        assert f"--{leaf}  " in text, leaf
    assert "--store.validator.norm.mode  'none'|'group_mean_std'" in text
    assert "--trainer.lr  float  (default: 0.001)" in text
    assert "--store.admin_key  str | None  (default: from the environment)" in text
    assert "AdamW learning rate." in text


def test_ray_placement_takes_its_section_ranks_and_the_asynchronous_staleness_default():
    config = load_config(
        RunConfig,
        QUICKSTART,
        [
            "--placement",
            "ray",
            "--trainer.num_ranks",
            "2",
            "--ray.num_workers",
            "3",
            "--ray.worker_resources",
            "[{node_a = 1}, {node_b = 1}]",
        ],
    )
    assert config.max_staleness == 2 and config.trainer.num_ranks == 2
    assert config.ray.num_workers == 3 and config.ray.worker_resources == [{"node_a": 1}, {"node_b": 1}]


@pytest.mark.parametrize("placement", ["colocated", "separated"])
def test_several_trainer_ranks_outside_the_ray_placement_are_refused_in_one_line(placement):
    with pytest.raises(_error_type(), match="num_ranks = 2 needs placement 'ray'"):
        load_config(RunConfig, None, ["--placement", placement, "--trainer.num_ranks", "2"])


def test_the_student_mix_names_only_the_run_s_domains_with_a_positive_total():
    domains = {"rollout": {"domains": ["addition", "program"]}}
    ok = RunConfig.model_validate({**domains, "warm_start": {"student_mix": {"addition": 0.85, "program": 0.15}}})
    assert ok.warm_start.student_mix == {"addition": 0.85, "program": 0.15}
    assert RunConfig.model_validate(domains).warm_start.student_mix == {}  # default: the domains pooled
    with pytest.raises(ValueError, match="reverse"):
        RunConfig.model_validate({**domains, "warm_start": {"student_mix": {"reverse": 1.0}}})
    with pytest.raises(ValueError, match="positive sum"):
        RunConfig.model_validate({**domains, "warm_start": {"student_mix": {"addition": 0.0}}})
    with pytest.raises(ValueError, match="positive sum"):
        RunConfig.model_validate({**domains, "warm_start": {"student_mix": {"addition": -1.0, "program": 2.0}}})
    over = load_config(
        RunConfig, None, ["--rollout.domains", '["addition", "program"]', "--warm_start.student_mix.addition", "0.9"]
    )
    assert over.warm_start.student_mix == {"addition": 0.9}


# ---- the workload against the model ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["quickstart", "demo", "online", "smoke", "byod"])
def test_every_shipped_run_config_asks_for_no_longer_requests_than_its_model_holds(name):
    """rollout.max_prompt_tokens + rollout.max_new_tokens against the model the config builds (no
    model.path in any of them: the tiny model's 512 positions), as `rollbook run` checks before it
    starts anything (rollout/engines.py ``check_fits``; no torch is imported for it)."""
    from rollbook.rollout.engines import check_fits, model_positions, rollout_seq_len

    config = load_config(RunConfig, str(pathlib.Path(QUICKSTART).parent / f"{name}.toml"), [])
    assert config.trainer.model.path is None
    assert rollout_seq_len(config.rollout) <= model_positions(config.trainer.model) == 512  # type: ignore[operator]
    check_fits(config.trainer.model, config.rollout, field="trainer.model.path")


def test_byod_asking_for_more_than_its_model_holds_is_refused_naming_the_fields():
    from rollbook.rollout.engines import check_fits

    byod = str(pathlib.Path(QUICKSTART).parent / "byod.toml")
    config = load_config(RunConfig, byod, ["--rollout.max_new_tokens", "512"])
    with pytest.raises(
        _error_type(),
        match=r"^rollout.max_prompt_tokens \(256\) \+ rollout.max_new_tokens \(512\) = 768 is longer than the model's "
        r"max_position_embeddings \(512, the tiny model built when trainer.model.path is unset\): lower them to fit$",
    ):
        check_fits(config.trainer.model, config.rollout, field="trainer.model.path")


def test_the_sizing_fields_are_validated():
    from pydantic import ValidationError

    for bad in ({"max_prompt_tokens": 0}, {"max_batch_size": 0}):
        with pytest.raises(ValidationError):
            RunConfig.model_validate({"rollout": bad})
    assert RunConfig().rollout.max_prompt_tokens is None and RunConfig().rollout.max_batch_size is None  # by the workload
