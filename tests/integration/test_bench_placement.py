"""``bench/placement.py --json`` runs each placement end to end (real store, real trainer, a local Ray
instance for ``ray``), the kill-and-restart of each and the online scenario, and prints one JSON
line, the markdown tables and, with ``--png``, a PNG. Tiny sizes: this checks that the benchmark
works and that what it reports is true of the ledgers it leaves, not how fast anything is.

Two invocations, each checking every figure of the placements it ran: colocated and separated with
separated's kill-and-restart, the online scenario and the PNG; and ray alone, without the kill (a killed
trainer rank and the group started again from its checkpoint are tests/integration/test_ray_placement.py's,
which the suite runs anyway). Only the ray one starts a Ray instance, so only it waits in the suite's
Ray group (tests/conftest.py); the other runs beside it on the second worker.

Run: python -m pytest tests/integration/test_bench_placement.py -q   (a few minutes: five runs)
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import duckdb
import pytest

from tests.integration.procs import AUDIT

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

KILL_AFTER, STEPS_AFTER_KILL = 2, 3


def _bench(tmp_path: pathlib.Path, *options: str) -> tuple[dict, str]:
    """The bench's JSON report and its stderr, on the tiny configuration."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "placement.py"),
            "--json",
            *options,
            "--steps",
            "2",
            "--samples",
            "16",
            "--warm-steps",
            "5",
            "--ray-workers",
            "2",
            "--ranks",
            "2",
            "--kill-after",
            str(KILL_AFTER),
            "--steps-after-kill",
            str(STEPS_AFTER_KILL),
            "--kill-delay",
            "0",  # tiny steps: a later kill could find the run already done
            "--work-dir",
            str(tmp_path),
            "--",
            "--rollout.group_size",
            "4",
            "--rollout.num_prompts",
            "2",
            "--rollout.num_eval_tasks",
            "4",
            "--rollout.num_eval_samples",
            "1",
            "--trainer.model.hidden_size",
            "64",
            "--trainer.model.intermediate_size",
            "128",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    return json.loads(line), done.stderr


def _check_placements(report: dict, tmp_path: pathlib.Path, names: set[str], recovered: set[str]) -> dict:
    """Every figure of each placement is reported, and the recovery claims of those in ``recovered``
    hold in their ledgers."""
    rows = {r["placement"]: r for r in report["placements"]}
    assert set(rows) == names
    for name, row in rows.items():
        assert row["trained_tokens"] > 0 and row["trained_tok_s"] > 0, name
        assert 0 < row["trained_tok_s_from_first_rollout"] <= row["trained_tok_s"], name  # a longer span, never shorter
        assert row["heldout_first"] is not None and row["heldout_final"] is not None, name
        assert row["weight_sync_s_per_step"] > 0, name
        roles = row["peak_rss_mib_by_role"]
        assert roles["store"] > 0 and roles["trainer"] > 0, (name, roles)
        assert row["largest_process_mib"] == max(roles.values()) and row["peak_pss_mib_total"] > 0, name
        if name not in recovered:
            assert row["recovery"] is None and row["restart_recovery_s"] is None, name
            continue
        assert row["restart_recovery_s"] is not None and row["restart_recovery_s"] > 0, (name, row["recovery"])

    steps = KILL_AFTER + STEPS_AFTER_KILL
    for name in recovered:
        recovery = rows[name]["recovery"]
        assert recovery["exactly_once"] is True and recovery["checkpointed_steps_at_kill"] >= KILL_AFTER, (name, recovery)
        con = duckdb.connect(str(tmp_path / f"{name}-recovery" / "rollbook.duckdb"), read_only=True)
        cursor = con.execute(AUDIT)
        audit = dict(zip([c[0] for c in cursor.description], cursor.fetchone(), strict=True))
        con.close()
        assert audit["acked_twice"] == audit["acked_outside_steps"] == audit["steps_without_acked_lease"] == 0, (name, audit)
        assert audit["steps"] == list(range(steps)), (name, audit)
        # the kill and the restart really happened: a second start evaluated at the checkpoint's step
        log = (tmp_path / f"{name}-recovery.log").read_text()
        assert "held-out reward before step 0" in log, log[-3000:]
        assert f"held-out reward before step {recovery['checkpointed_steps_at_kill']}" in log, log[-3000:]
    return rows


def test_the_placement_bench_reports_every_figure_and_its_recovery_claims_hold_in_the_ledgers(tmp_path):
    """Colocated and separated (the kill and restart on separated: colocated's is the same code,
    killing and restarting the same command), the online scenario and the PNG."""
    png = tmp_path / "placement.png"
    report, stderr = _bench(
        tmp_path, "--placements", "colocated,separated", "--recovery-placements", "separated", "--png", str(png)
    )
    rows = _check_placements(report, tmp_path, {"colocated", "separated"}, {"separated"})
    # colocated samples in the trainer's process; separated has a rollout process of its own
    assert "rollout" not in rows["colocated"]["peak_rss_mib_by_role"]
    assert rows["separated"]["processes_by_role"]["rollout"] == 1
    assert rows["colocated"]["workers"] == 1

    online = report["online"]
    assert online["completions_received"] == online["accepted_rows"] == online["served_rows"] == 12
    assert online["attempts"] > online["completions_received"], "no retry was injected"
    assert online["retry_orphans"] == online["attempts"] - online["completions_received"]
    assert online["served_equals_experienced"] is True

    from PIL import Image

    with Image.open(png) as image:
        image.load()  # decodes every pixel
        assert image.size[0] > 400 and image.size[1] > 200
    assert "| placement |" in stderr and "served_equals_experienced" in stderr


@pytest.mark.xdist_group(name="ray")  # a local Ray instance: one at a time on the machine (tests/conftest.py)
def test_the_placement_bench_reports_every_figure_of_the_ray_placement(tmp_path):
    """Two rollout actors and two trainer ranks."""
    report, stderr = _bench(tmp_path, "--placements", "ray", "--no-online", "--no-recovery")
    rows = _check_placements(report, tmp_path, {"ray"}, set())
    ray = rows["ray"]
    assert ray["processes_by_role"]["rollout"] == 2 and ray["processes_by_role"]["trainer"] >= 2
    assert ray["peak_rss_mib_by_role"]["ray"] > 0 and ray["peak_rss_mib_by_role"]["driver"] > 0
    assert ray["workers"] >= 1  # two steps: an actor may not have submitted yet
    assert "online" not in report and "| placement |" in stderr
