"""Re-scoring a ledger (rollbook/rescore.py, rollbook/cli/replay.py) on ledgers written through the
store's own ingest path (``bench/rescore.py`` ``make_ledger``): the predicate's check and sandbox, the
run's rows and tokenizer, errors per row (a raising verifier, one that kills its process, one that
never answers), and resuming a version cut short so that every selected row is scored exactly once.

Run: ``python -m pytest tests/unit/test_rescore.py -q``.
"""

from __future__ import annotations

import pathlib

import duckdb
import pytest

from bench.rescore import make_ledger
from rollbook.cli import replay
from rollbook.cli.replay import check_predicate, parse_options, rescore
from rollbook.config import RewardConfig
from rollbook.errors import CommandError, ConfigError
from rollbook.rescore import RowSource, Scorer, build_scorer, load_run_config, run_tokenizer
from rollbook.tasks import TOKENIZER

ROWS = 96  # 12 groups of 8


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> pathlib.Path:
    return make_ledger(tmp_path_factory.mktemp("rescore") / "run", ROWS)


@pytest.fixture
def db(made, tmp_path) -> pathlib.Path:
    """A fresh copy of the module's ledger and its config.json for each test."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("rollbook.duckdb", "config.json"):
        (run / name).write_bytes((made.parent / name).read_bytes())
    return run / "rollbook.duckdb"


def sql(db: pathlib.Path, query: str, params: list | None = None) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(query, params or []).fetchall()
    finally:
        con.close()


@pytest.mark.parametrize(
    "predicate",
    [
        "domain = 'arithmetic'",
        "original_reward > 0 AND num_output_tokens < 5",
        "trajectory_id IN (SELECT trajectory_id FROM rewards) OR group_id LIKE 'a%'",
        "TRUE -- a comment ends at the line's end",
    ],
)
def test_a_predicate_becomes_the_whole_where(predicate):
    assert check_predicate(predicate).endswith(f"WHERE (\n{predicate}\n)")


@pytest.mark.parametrize(
    "predicate",
    [
        "TRUE) UNION ALL (SELECT 'x'",
        "TRUE) ORDER BY 1 LIMIT (3",
        "TRUE) GROUP BY trajectory_id HAVING (TRUE",
        "TRUE); DELETE FROM trajectories; SELECT (1",
        "",
        "domain = ",
    ],
)
def test_a_predicate_that_escapes_its_where_is_refused(predicate):
    with pytest.raises(ConfigError, match="--where"):
        check_predicate(predicate)


def test_options_are_key_value_and_never_the_kind():
    assert parse_options(["pattern=a=(\\d+)", "timeout_s=3"]) == {"pattern": "a=(\\d+)", "timeout_s": "3"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_options(["pattern"])
    with pytest.raises(ConfigError, match="the kind is --reward"):
        parse_options(["kind=math"])


def test_the_run_rows_are_its_toy_tasks_and_others_come_from_the_ledger(db):
    config = load_run_config(db.parent / "config.json")
    tokenizer, described = run_tokenizer(config)
    assert described == "toy character tokenizer" and tokenizer.decode([1, 5, 2, 6]) == "2"
    rows = RowSource.for_run(config)
    task_id, domain, prompt = sql(db, "SELECT task_id, domain, prompt_token_ids FROM trajectories LIMIT 1")[0]
    row, found = rows.row(task_id, domain, prompt, tokenizer)
    assert found and row["answer"] == rows.toy[task_id].answer and row["prompt"] == rows.toy[task_id].prompt
    row, found = rows.row("agent/123", "arithmetic", TOKENIZER.encode("1+2=", add_bos=True), tokenizer)
    assert not found and row["prompt"] == "1+2=" and row["answer"] is None and row["source"] == "ledger"


def test_bad_rewards_are_refused_before_any_work(db):
    config = load_run_config(db.parent / "config.json")
    rows = RowSource.for_run(config)
    with pytest.raises(ConfigError, match="kind must be one of"):
        build_scorer("nonsense", {}, config, rows)
    with pytest.raises(ConfigError, match="no_such_module"):
        build_scorer("no_such_module:f", {}, config, rows)
    with pytest.raises(ConfigError, match="run takes no --reward-option"):
        build_scorer("run", {"pattern": "x"}, config, rows)
    with pytest.raises(ConfigError, match="--reward 'exact'"):
        build_scorer("exact", {"timeout_s": "-1"}, config, rows)
    with pytest.raises(ConfigError, match="regex reward needs `pattern`"):
        build_scorer("regex", {}, config, rows)


def test_a_verifier_that_raises_errs_on_its_rows_alone(db):
    config = load_run_config(db.parent / "config.json")
    scorer, _ = build_scorer("tests.rescore_rewards:refuses_reverse", {}, config, RowSource.for_run(config), workers=0)
    with scorer:
        items = [
            scorer.item("reverse", "ab", {"domain": "reverse"}, True),
            scorer.item("arithmetic", "3", {"domain": "arithmetic"}, True),
            scorer.item("arithmetic", "3", {"domain": "arithmetic"}, False),
        ]
        bad, good, unfound = scorer.collect(scorer.submit(items))
    assert bad.outcome.status == "error" and bad.outcome.reward is None
    assert bad.outcome.error == "ValueError: this verifier cannot judge reversals"
    assert (good.outcome.status, good.outcome.reward, unfound.outcome.reward) == ("ok", 1.0, 1.0)
    assert unfound.info == {"row_found": False} and "row_found" not in good.info


def test_a_chunk_that_loses_its_process_or_hangs_is_scored_again_row_by_row():
    """One chunk of five rows in one pool process: ``crash`` kills the process (the whole chunk fails),
    so each row is scored alone; then ``crash`` errs alone, ``hang`` runs past its time and errs
    alone (its process killed), ``nan`` is not a reward, and the others get their scores."""
    pools = {"replay": RewardConfig(kind="tests.rescore_rewards:misbehaves")}
    scorer = Scorer(pools, RowSource(rows={}, described=""), workers=1, timeout_s=2.0)
    with scorer:
        texts = ["ok", "crash", "four", "hang", "nan", "sixsix"]
        items = [scorer.item("d", text, {"domain": "d"}, True) for text in texts]
        got = scorer.collect(scorer.submit(items))
    assert [s.outcome.reward for s in got] == [2.0, None, 4.0, None, None, 6.0], [s.outcome.error for s in got]
    assert [s.outcome.status for s in got] == ["ok", "error", "ok", "error", "error", "ok"]
    assert got[1].outcome.error == "the verifier's process died scoring this row"
    assert got[3].outcome.error == "verifier did not answer within 2 s"
    assert "non-finite" in got[4].outcome.error
    assert scorer.retried_rows == len(texts)


def test_the_run_reward_gives_back_the_original_rewards_and_changes_no_row(db):
    before = sql(db, "SELECT * EXCLUDE (status) FROM trajectories ORDER BY trajectory_id")
    result = rescore(db, reward="run", name="same", workers=0)
    assert (result.selected, result.scored, result.errors, result.already) == (ROWS, ROWS, 0, 0)
    differ = sql(
        db,
        "SELECT count(*) FROM reward_versions v JOIN trajectories t USING (trajectory_id) "
        "WHERE v.name = 'same' AND v.reward IS DISTINCT FROM t.original_reward",
    )
    assert differ == [(0,)]
    assert sql(db, "SELECT * EXCLUDE (status) FROM trajectories ORDER BY trajectory_id") == before
    assert sql(db, "SELECT selected, scored, errors, starts, finished_at IS NOT NULL FROM reward_version_runs") == [
        (ROWS, ROWS, 0, 1, True)
    ]
    assert not (db.parent / "rollbook.duckdb.replay").exists()


def test_a_version_cut_short_resumes_and_scores_each_selected_row_once(db, monkeypatch):
    where = "domain = 'arithmetic'"
    selected = sql(db, f"SELECT count(*) FROM trajectories WHERE {where}")[0][0]
    assert 32 < selected < ROWS
    real_write, commits = replay._write, []

    def dies_on_the_third_commit(*args, **kwargs):
        if len(commits) == 2:
            raise KeyboardInterrupt  # the process stops between two batches
        commits.append(1)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(replay, "_write", dies_on_the_third_commit)
    with pytest.raises(KeyboardInterrupt):
        rescore(db, reward="tests.rescore_rewards:answer_length", name="len", where=where, workers=0, batch_rows=16)
    assert sql(db, "SELECT count(*) FROM reward_versions") == [(32,)]
    assert sql(db, "SELECT scored, finished_at FROM reward_version_runs") == [(32, None)]
    monkeypatch.setattr(replay, "_write", real_write)
    result = rescore(db, reward="tests.rescore_rewards:answer_length", name="len", where=where, workers=0, batch_rows=16)
    assert (result.already, result.scored, result.version_scored) == (32, selected - 32, selected)
    once = sql(
        db,
        "SELECT count(*), count(DISTINCT v.trajectory_id), count(*) FILTER (WHERE t.domain = 'arithmetic') "
        "FROM reward_versions v JOIN trajectories t USING (trajectory_id)",
    )
    assert once == [(selected, selected, selected)]
    assert sql(db, "SELECT starts, scored, finished_at IS NOT NULL FROM reward_version_runs") == [(2, selected, True)]
    again = rescore(db, reward="tests.rescore_rewards:answer_length", name="len", where=where, workers=0)
    assert (again.already, again.scored) == (selected, 0)


def test_another_reward_under_a_used_name_is_refused(db):
    rescore(db, reward="run", name="v", where="domain = 'reverse'", workers=0)
    with pytest.raises(ConfigError, match="another --where \"domain = 'reverse'\" \\(now 'TRUE'\\)"):
        rescore(db, reward="run", name="v", workers=0)
    with pytest.raises(ConfigError, match="another reward 'run'"):
        rescore(db, reward="exact", name="v", where="domain = 'reverse'", workers=0)


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        ("length(read_text('/etc/passwd')) > 0", "read_text\\(\\) is not allowed"),
        ("trajectory_id IN (SELECT * FROM query('SELECT 1'))", "query\\(\\) is not allowed"),
        ("no_such_column = 1", "no_such_column"),
    ],
)
def test_the_predicate_runs_in_the_sql_sandbox(db, where, reason):
    with pytest.raises(ConfigError, match=reason):
        rescore(db, reward="run", name="x", where=where, workers=0)
    assert sql(db, "SELECT count(*) FROM reward_version_runs") == [(0,)]


def test_a_missing_ledger_or_run_config_is_one_line(db, tmp_path):
    with pytest.raises(CommandError, match="no such ledger file"):
        rescore(tmp_path / "nothing" / "rollbook.duckdb", reward="run", name="x", run_config=db.parent / "config.json")
    (db.parent / "config.json").unlink()
    with pytest.raises(ConfigError, match="no run config .*--run-config"):
        rescore(db, reward="run", name="x")
