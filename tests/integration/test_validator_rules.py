"""One minimal trajectory per evidence rule, over the real gRPC path.

Each case breaks exactly one rule of ``docs/evidence.md`` and must get exactly that code:
ingest-time codes in the ``Submit`` verdict (and in ``rejections``, stage ``ingest``, never in
``trajectories``); ``RETRY_ORPHAN`` and ``STALE`` through a real ``rollbook serve`` process and
``PullBatch``; ``INCOMPLETE_GROUP`` (policies wait / drop / keep) and ``SINGLETON_DROPPED`` through
an in-process ``create_server`` (the CLI cannot set ``ValidatorConfig``), still a real gRPC server
on port 0 over a real DuckDB file.

Run: python -m pytest tests/integration/test_validator_rules.py -q   (about 15 s)
"""

from __future__ import annotations

import math
import time

import grpc
import pytest

from rollbook.config import NormConfig, ValidatorConfig
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.reasons import Reason
from tests.integration.procs import InProcessStore, ServeProcess, ids_in, rows, rpc_code, trajectory

MODEL = "rules-model"
VOCAB = 64
PUBLISHED = (0, 1, 3)  # version 2 is a gap (never published); 3 is the latest

# code -> variants: (name, field overrides of the minimal valid trajectory `procs.trajectory`)
INGEST_CASES: dict[Reason, list[tuple[str, dict]]] = {
    Reason.MISSING_ID: [("empty id", {"trajectory_id": ""})],
    Reason.OVERSIZED: [
        ("id over 256 chars", {"trajectory_id": "x" * 300}),
        ("session id over 256 chars", {"session_id": "s" * 257}),
        ("task id over 256 chars", {"task_id": "t" * 257}),
        ("finish reason over 256 chars", {"finish_reason": "f" * 257}),
        (
            "output over 262144 tokens",
            {"output_token_ids": [1] * 262_145, "output_logprobs": [-0.5] * 262_145, "output_versions": [0] * 262_145},
        ),
    ],
    Reason.EMPTY_OUTPUT: [("no output tokens", {"output_token_ids": [], "output_logprobs": [], "output_versions": []})],
    Reason.MISSING_LOGPROBS: [("no logprobs", {"output_logprobs": []})],
    Reason.LENGTH_MISMATCH: [
        ("one logprob short", {"output_logprobs": [-0.5] * 3}),
        ("one version short", {"output_versions": [0] * 3}),
    ],
    Reason.INVALID_TOKEN_ID: [
        ("negative output token", {"output_token_ids": [5, -1, 6, 7]}),
        ("negative prompt token", {"prompt_token_ids": [1, -3]}),
    ],
    Reason.NONFINITE_LOGPROB: [
        ("nan", {"output_logprobs": [-0.5, math.nan, -0.5, -0.5]}),
        ("-inf", {"output_logprobs": [-0.5, -0.5, -math.inf, -0.5]}),
    ],
    Reason.SENTINEL_LOGPROB: [("vllm -9999", {"output_logprobs": [-0.5, -0.5, -0.5, -9999.0]})],
    Reason.POSITIVE_LOGPROB: [("0.5", {"output_logprobs": [-0.5, 0.5, -0.5, -0.5]})],
    Reason.UNPUBLISHED_VERSION: [
        ("gap version 2", {"output_versions": [1, 2, 2, 3]}),
        ("negative version", {"output_versions": [-1, -1, -1, -1]}),
    ],
    Reason.DECREASING_VERSIONS: [("1 then 0", {"output_versions": [1, 1, 0, 0]})],
    Reason.MISSING_SAMPLING_PARAMS: [("no temperature", {"temperature": None}), ("no top_p", {"top_p": None})],
    Reason.INVALID_SAMPLING_PARAMS: [("negative temperature", {"temperature": -1.0}), ("top_p above 1", {"top_p": 1.5})],
    Reason.NONFINITE_REWARD: [("nan", {"reward": math.nan}), ("inf", {"reward": math.inf})],
    Reason.REWARD_OUT_OF_RANGE: [("1e200", {"reward": 1e200})],
    Reason.NONFINITE_CREATED_AT: [("nan", {"created_at": math.nan})],
    Reason.INVALID_GROUP_SIZE: [("2^32 - 1", {"group_size": 2**32 - 1})],
    Reason.BRANCH_WITHOUT_PARENT: [("branched, no parent", {"request_id": "turn-2.0", "branched": True})],
    Reason.UNREGISTERED_MODEL: [("unknown model", {"model_id": "never-registered"})],
    Reason.TOKEN_OUT_OF_VOCAB: [
        ("output token = vocab", {"output_token_ids": [5, VOCAB, 6, 7]}),
        ("prompt token = vocab", {"prompt_token_ids": [1, VOCAB + 10]}),
    ],
    Reason.FUTURE_VERSION: [("version 4 > latest 3", {"output_versions": [3, 3, 4, 4]})],
}
GROUP_OR_PULL_CODES = {Reason.RETRY_ORPHAN, Reason.INCOMPLETE_GROUP, Reason.STALE, Reason.SINGLETON_DROPPED}
PARAMS = [pytest.param(code, overrides, id=f"{code}-{name}") for code, cases in INGEST_CASES.items() for name, overrides in cases]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("rules") / "rollbook.duckdb")
    client = proc.client()
    client.register_model(MODEL, vocab_size=VOCAB)
    for v in PUBLISHED:
        client.publish_version(MODEL, v, checksum=f"c{v}")
    yield client
    client.close()
    proc.stop()


def test_every_reason_code_has_a_case_here():
    assert set(INGEST_CASES) | GROUP_OR_PULL_CODES == set(Reason)


def test_the_minimal_trajectory_breaks_no_rule(store):
    result = store.submit([trajectory("baseline-ok", model_id=MODEL, output_versions=[0, 1, 1, 3])])
    assert result.verdicts["baseline-ok"].status == pb.Verdict.ACCEPTED
    assert ids_in(store, "trajectories", "trajectory_id = 'baseline-ok'") == {"baseline-ok"}


@pytest.mark.parametrize("code,overrides", PARAMS)
def test_ingest_rule_gets_exactly_its_code(store, request, code, overrides):
    session = f"sess-{request.node.callspec.id}"
    t = trajectory(f"t-{request.node.callspec.id}", model_id=MODEL, session_id=session)
    t.update(overrides)
    tid = t["trajectory_id"]
    result = store.submit([t])
    verdict = result.verdicts[tid]
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, str(code)), verdict.detail
    assert verdict.detail
    where = f"session_id = '{t['session_id']}'"
    rejected = rows(store, f"SELECT trajectory_id, reason, stage, detail FROM rejections WHERE {where}")
    assert [(r["trajectory_id"], r["reason"], r["stage"]) for r in rejected] == [(tid, str(code), "ingest")]
    assert rejected[0]["detail"] == verdict.detail
    assert rows(store, f"SELECT count(*) AS n FROM trajectories WHERE {where}") == [{"n": 0}]


def test_set_reward_refuses_a_nonfinite_reward(store):
    store.submit([trajectory("reward-later", model_id=MODEL, reward=None)])
    assert rpc_code(lambda: store.set_reward(math.nan, trajectory_id="reward-later")) == grpc.StatusCode.INVALID_ARGUMENT
    assert rows(store, "SELECT original_reward FROM trajectories WHERE trajectory_id = 'reward-later'") == [
        {"original_reward": None}
    ]


# ---- group time: retry orphans (default config, `rollbook serve`) ---------------------------------


def _pull_all(client, model_id: str, *, trainer_version: int = 3, max_staleness: int = 100):
    return client.pull_batch(
        trainer_id="rules", trainer_version=trainer_version, max_staleness=max_staleness, num_samples=1000, model_id=model_id
    )


def _own_model(client, model_id: str, versions=(0,)) -> None:
    client.register_model(model_id, vocab_size=VOCAB)
    for v in versions:
        client.publish_version(model_id, v)


def test_retry_orphans_are_the_unconsumed_attempts_and_never_served(store):
    """Attempts of one call share (model_id, session_id, request_id)."""
    _own_model(store, "orphan-m")
    t0 = time.time()
    # three attempts of one call; the caller consumed the middle one (not the latest)
    attempts = [
        trajectory(
            f"orph-{k}",
            model_id="orphan-m",
            session_id="sess-1",
            request_id="req-1",
            attempt=k,
            consumed=(k == 1),
            created_at=t0 + k,
        )
        for k in range(3)
    ]
    # two attempts with none marked consumed: the latest by created_at is kept
    unmarked = [
        trajectory(
            f"unmarked-{k}",
            model_id="orphan-m",
            session_id="sess-2",
            request_id="req-2",
            attempt=k,
            consumed=False,
            created_at=t0 + k,
        )
        for k in range(2)
    ]
    result = store.submit(attempts + unmarked)
    assert result.accepted == 5  # ingest does not know yet; the group step decides
    batch = _pull_all(store, "orphan-m")
    assert sorted(batch.table.column("trajectory_id").to_pylist()) == ["orph-1", "unmarked-1"]
    rejected = rows(
        store, "SELECT trajectory_id, reason, stage, detail FROM rejections WHERE model_id = 'orphan-m' ORDER BY trajectory_id"
    )
    assert [(r["trajectory_id"], r["reason"], r["stage"]) for r in rejected] == [
        ("orph-0", "RETRY_ORPHAN", "group"),
        ("orph-2", "RETRY_ORPHAN", "group"),
        ("unmarked-0", "RETRY_ORPHAN", "group"),
    ]
    assert "consumed" in rejected[0]["detail"] and "latest created_at" in rejected[2]["detail"]
    assert ids_in(store, "trajectories", "model_id = 'orphan-m'") == {"orph-1", "unmarked-1"}


def test_consumed_attempt_arriving_after_a_rewarded_retry_still_wins(store):
    """The unconsumed attempt arrives first with a reward (so its group of one is ready), the consumed
    one later: the consumed one is kept; only an attempt already *served* could beat it."""
    _own_model(store, "late-m")
    t0 = time.time()
    call = dict(model_id="late-m", session_id="sess-late", request_id="req-late")
    store.submit([trajectory("late-0", **call, attempt=0, consumed=False, created_at=t0)])
    assert rows(store, "SELECT status FROM trajectories WHERE trajectory_id = 'late-0'") == [{"status": "ready"}]
    store.submit([trajectory("late-1", **call, attempt=1, consumed=True, created_at=t0 - 1)])
    batch = _pull_all(store, "late-m")
    assert batch.table.column("trajectory_id").to_pylist() == ["late-1"]
    assert rows(store, "SELECT trajectory_id, reason FROM rejections WHERE model_id = 'late-m'") == [
        {"trajectory_id": "late-0", "reason": "RETRY_ORPHAN"}
    ]


def test_attempt_arriving_after_its_request_was_served_is_an_orphan(store):
    _own_model(store, "served-m")
    call = dict(model_id="served-m", session_id="sess-served", request_id="req-served")
    store.submit([trajectory("served-0", **call, attempt=0, consumed=False)])
    assert _pull_all(store, "served-m").table.column("trajectory_id").to_pylist() == ["served-0"]
    store.submit([trajectory("served-1", **call, attempt=1, consumed=True)])
    assert _pull_all(store, "served-m").num_rows == 0
    assert rows(store, "SELECT trajectory_id, reason FROM rejections WHERE model_id = 'served-m'") == [
        {"trajectory_id": "served-1", "reason": "RETRY_ORPHAN"}
    ]


# ---- pull time: staleness (default config, `rollbook serve`) -----------------------------------


def test_rows_older_than_the_staleness_bound_are_stale_not_served(store):
    _own_model(store, "stale-m", versions=range(6))
    store.submit(
        [
            trajectory("old", model_id="stale-m", output_versions=[0, 0, 1, 1]),
            trajectory("edge", model_id="stale-m", output_versions=[3, 3, 3, 3]),
            trajectory("fresh", model_id="stale-m", version=5),
        ]
    )
    batch = _pull_all(store, "stale-m", trainer_version=5, max_staleness=2)
    assert sorted(batch.table.column("trajectory_id").to_pylist()) == ["edge", "fresh"]
    assert batch.stats["events"]["stale"] == 1
    assert rows(store, "SELECT trajectory_id, reason, stage FROM rejections WHERE model_id = 'stale-m'") == [
        {"trajectory_id": "old", "reason": "STALE", "stage": "pull"}
    ]
    assert "old" not in ids_in(store, "trajectories", "model_id = 'stale-m'")


# ---- group and pull policies that need a ValidatorConfig (in-process create_server) --------------


@pytest.fixture
def configured_store(tmp_path):
    started: list[InProcessStore] = []

    def start(**validator) -> object:
        s = InProcessStore(tmp_path / f"store{len(started)}.duckdb", validator=ValidatorConfig(**validator))
        started.append(s)
        client = s.client()
        _own_model(client, MODEL)
        return client

    yield start
    for s in started:
        s.stop()


def _group(prefix: str, size: int, rewards: list[float | None], **fields) -> list[dict]:
    return [
        trajectory(f"{prefix}-{i}", model_id=MODEL, group_id=prefix, group_size=size, reward=r, **fields)
        for i, r in enumerate(rewards)
    ]


def _rejections(client) -> list[tuple[str, str, str]]:
    return [
        (r["trajectory_id"], r["reason"], r["stage"])
        for r in rows(client, "SELECT trajectory_id, reason, stage FROM rejections ORDER BY trajectory_id")
    ]


def test_incomplete_group_policy_wait_rejects_after_the_timeout(configured_store):
    client = configured_store(incomplete_group_policy="wait", group_timeout_s=1.0)
    client.submit(_group("short", 3, [1.0, 0.0]) + _group("full", 3, [1.0, 0.0, 1.0]))
    first = _pull_all(client, MODEL)
    assert sorted(first.table.column("trajectory_id").to_pylist()) == ["full-0", "full-1", "full-2"]
    assert _rejections(client) == []  # still waiting for the third member
    time.sleep(1.2)
    assert _pull_all(client, MODEL).num_rows == 0
    assert _rejections(client) == [("short-0", "INCOMPLETE_GROUP", "group"), ("short-1", "INCOMPLETE_GROUP", "group")]


def test_incomplete_group_policy_drop_rejects_once_present_members_are_rewarded(configured_store):
    client = configured_store(incomplete_group_policy="drop")
    client.submit(_group("short", 3, [1.0, 0.0]) + _group("unrewarded", 3, [1.0, None]))
    assert _pull_all(client, MODEL).num_rows == 0
    assert _rejections(client) == [("short-0", "INCOMPLETE_GROUP", "group"), ("short-1", "INCOMPLETE_GROUP", "group")]
    client.set_reward(0.0, trajectory_id="unrewarded-1")  # now all present members are rewarded
    assert _pull_all(client, MODEL).num_rows == 0
    assert [r for r in _rejections(client) if r[0].startswith("unrewarded")] == [
        ("unrewarded-0", "INCOMPLETE_GROUP", "group"),
        ("unrewarded-1", "INCOMPLETE_GROUP", "group"),
    ]


def test_incomplete_group_policy_keep_serves_the_true_size_after_the_timeout(configured_store):
    client = configured_store(incomplete_group_policy="keep", group_timeout_s=1.0)
    client.submit(_group("kept", 4, [1.0, 0.0, None]))  # 3 of 4 present, one never rewarded
    assert _pull_all(client, MODEL).num_rows == 0
    time.sleep(1.2)
    batch = _pull_all(client, MODEL)
    served = dict(zip(batch.table.column("trajectory_id").to_pylist(), batch.table.column("reward").to_pylist()))
    assert sorted(served) == ["kept-0", "kept-1"]
    # group_mean_std over the true size 2: (1 - 0.5) / 0.5 = +1 and -1 (a stride of 4 would differ)
    assert served["kept-0"] == pytest.approx(1.0, abs=1e-3) and served["kept-1"] == pytest.approx(-1.0, abs=1e-3)
    assert _rejections(client) == [("kept-2", "INCOMPLETE_GROUP", "group")]


def test_singleton_policy_drop_rejects_groups_of_one_at_pull(configured_store):
    client = configured_store(norm=NormConfig(singleton_policy="drop"))
    client.submit(
        [
            trajectory("lonely-a", model_id=MODEL, group_id=""),
            trajectory("lonely-b", model_id=MODEL, group_id="solo", group_size=1),
        ]
        + _group("pair", 2, [1.0, 0.0])
    )
    batch = _pull_all(client, MODEL)
    assert sorted(batch.table.column("trajectory_id").to_pylist()) == ["pair-0", "pair-1"]
    assert _rejections(client) == [("lonely-a", "SINGLETON_DROPPED", "pull"), ("lonely-b", "SINGLETON_DROPPED", "pull")]
    assert ids_in(client, "trajectories") == {"pair-0", "pair-1"}


# ---- groups are per model (default config, `rollbook serve`) ------------------------------------


def test_a_group_id_shared_by_two_models_is_one_group_per_model(store):
    """A group is the samples of one prompt from one policy: the same ``group_id`` under two models
    is two groups, counted, completed, served and normalized each on its own."""
    _own_model(store, "shared-a")
    _own_model(store, "shared-b")
    group = dict(group_id="g-shared", group_size=2)
    store.submit(
        [
            trajectory("shared-a-0", model_id="shared-a", reward=1.0, **group),
            trajectory("shared-b-0", model_id="shared-b", reward=3.0, **group),
        ]
    )
    # one member of two in each model's group: neither is complete (policy wait: not served yet)
    assert _pull_all(store, "shared-a").num_rows == 0
    assert _pull_all(store, "shared-b").num_rows == 0
    store.submit(
        [
            trajectory("shared-a-1", model_id="shared-a", reward=0.0, **group),
            trajectory("shared-b-1", model_id="shared-b", reward=5.0, **group),
        ]
    )
    served = {}
    for model in ("shared-a", "shared-b"):
        batch = _pull_all(store, model)
        served.update(zip(batch.table.column("trajectory_id").to_pylist(), batch.table.column("reward").to_pylist()))
    # group_mean_std within each model's pair: [1, 0] -> [+1, -1] and [3, 5] -> [-1, +1]
    assert served == {
        "shared-a-0": pytest.approx(1.0, abs=1e-3),
        "shared-a-1": pytest.approx(-1.0, abs=1e-3),
        "shared-b-0": pytest.approx(-1.0, abs=1e-3),
        "shared-b-1": pytest.approx(1.0, abs=1e-3),
    }
    assert rows(store, "SELECT model_id, group_id, num_members FROM groups WHERE group_id = 'g-shared' ORDER BY model_id") == [
        {"model_id": "shared-a", "group_id": "g-shared", "num_members": 2},
        {"model_id": "shared-b", "group_id": "g-shared", "num_members": 2},
    ]


# ---- SetReward: where a session's reward goes, and its range ------------------------------------


def test_set_reward_by_session_refuses_when_the_last_interaction_was_rejected(store):
    """The session's last call was consumed but rejected (a NaN log-prob): its reward goes nowhere,
    never to the earlier call."""
    _own_model(store, "turns-m")
    t0 = time.time()
    turn = dict(model_id="turns-m", session_id="sess-turns", consumed=True, reward=None)
    result = store.submit(
        [
            trajectory("turn-1", request_id="r1", created_at=t0, **turn),
            trajectory("turn-2", request_id="r2", created_at=t0 + 1, output_logprobs=[-0.5, math.nan, -0.5, -0.5], **turn),
        ]
    )
    assert result.verdicts["turn-2"].reason == "NONFINITE_LOGPROB"
    try:
        store.set_reward(1.0, session_id="sess-turns")
    except grpc.RpcError as exc:
        err = exc
    else:
        raise AssertionError("SetReward by session rewarded an earlier call")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert err.details() == "the last interaction of session 'sess-turns' (trajectory 'turn-2') was rejected (NONFINITE_LOGPROB)"
    assert rows(store, "SELECT original_reward FROM trajectories WHERE trajectory_id = 'turn-1'") == [{"original_reward": None}]
    assert rows(store, "SELECT count(*) AS n FROM rewards WHERE session_id = 'sess-turns'") == [{"n": 0}]


@pytest.mark.parametrize("reward", [2e9, -2e9, 1000000.5])
def test_set_reward_out_of_range_is_reward_out_of_range_with_the_exact_value(store, reward):
    tid = f"range-{reward!r}"
    store.submit([trajectory(tid, model_id=MODEL, reward=None)])
    try:
        store.set_reward(reward, trajectory_id=tid)
    except grpc.RpcError as exc:
        err = exc
    else:
        raise AssertionError(f"SetReward accepted {reward!r}")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details() == f"REWARD_OUT_OF_RANGE: reward = {reward!r}; |reward| must be <= max_abs_reward 1000000.0"
    assert rows(store, f"SELECT original_reward FROM trajectories WHERE trajectory_id = '{tid}'") == [{"original_reward": None}]


def test_a_submitted_reward_out_of_range_shows_the_exact_value(store):
    verdict = store.submit([trajectory("range-submit", model_id=MODEL, reward=1000000.5)]).verdicts["range-submit"]
    assert verdict.reason == "REWARD_OUT_OF_RANGE"
    assert verdict.detail == "reward = 1000000.5; |reward| must be <= max_abs_reward 1000000.0"


# ---- RegisterModel: a model's vocabulary is fixed -----------------------------------------------


def test_registering_a_model_again_keeps_its_vocab_size_or_refuses(store):
    store.register_model("vocab-m", vocab_size=VOCAB)
    store.register_model("vocab-m", vocab_size=VOCAB)  # the same again: nothing changes
    try:
        store.register_model("vocab-m", vocab_size=VOCAB * 2)
    except grpc.RpcError as exc:
        err = exc
    else:
        raise AssertionError("a second RegisterModel changed the model's vocab_size")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    details = err.details()
    assert "'vocab-m'" in details and f"vocab_size {VOCAB}" in details and str(VOCAB * 2) in details, details
    assert "new model_id" in details, details
    assert store.get_model("vocab-m").vocab_size == VOCAB
    assert rows(store, "SELECT vocab_size FROM models WHERE model_id = 'vocab-m'") == [{"vocab_size": VOCAB}]
