"""Recorded runs are never lost by a report: a record that would drop rows is refused unless asked, and every
generated file is written whole or not at all."""
from __future__ import annotations

import pandas as pd
import pytest

from onepass.harness import report


def runs(*ids):
    return pd.DataFrame({"run_id": list(ids), "start_time": [f"2026-12-0{i + 1}" for i in range(len(ids))],
                         "status": "FINISHED", "metrics.throughput_tok_s": [1.0] * len(ids)})


@pytest.fixture
def experiments(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "EXPERIMENTS", tmp_path)
    report.record_csv("t", runs("a", "b", "c"))
    return tmp_path / "t" / "runs.csv"


def test_a_record_that_would_drop_rows_is_refused(experiments):
    """An interrupted sweep's one run must not replace six recorded ones silently."""
    before = experiments.read_text()
    with pytest.raises(ValueError, match=r"drop 2 of the 3 runs.*--merge.*--replace"):
        report.record_csv("t", runs("a"))
    assert experiments.read_text() == before
    report.record_csv("t", runs("a", "b", "c", "d"))               # adding runs drops nothing
    assert list(pd.read_csv(experiments)["run_id"]) == ["a", "b", "c", "d"]
    report.record_csv("t", runs("z"), replace=True)                 # asked for
    assert list(pd.read_csv(experiments)["run_id"]) == ["z"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "r.md"
    path.write_text("old")

    def half(tmp):
        tmp.write_text("half of the new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        report.atomic_write(path, half)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.md"]


def test_record_command_refuses_and_keeps_the_csv(experiments, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "runs_from_store", lambda name, uri, newest=True: runs("a").assign(
        **{"params.batch.size": "1", "tags.device": "cpu"}))
    monkeypatch.setitem(report.TABLES, "t", lambda df: ("### Headline\n\n| B |\n|---|\n| 1 |\n", None))
    before = experiments.read_text()
    assert report.main(["t", "--record", "--out", str(tmp_path / "out")]) == 1
    assert "would drop 2" in capsys.readouterr().err and experiments.read_text() == before


def test_record_from_an_unreadable_store_records_nothing_and_says_so(experiments, tmp_path, monkeypatch, capsys):
    """--record takes runs from the tracking store only: a store it cannot read (here one whose schema a newer MLflow
    wrote) fails the command and names the fix, instead of regenerating the report from runs.csv as if recorded."""
    def newer(name, uri, newest=True):
        raise RuntimeError("Detected out-of-date database schema (found version f4a9b2c7d1e6, but expected "
                           "dc11669786a5)")

    monkeypatch.setattr(report, "runs_from_store", newer)
    monkeypatch.setitem(report.TABLES, "t", lambda df: ("### Headline\n\n| B |\n|---|\n| 1 |\n", None))
    before = experiments.read_text()
    assert report.main(["t", "--record", "--merge", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot be read" in err and "nothing recorded" in err and "newer MLflow is read with that version" in err
    assert experiments.read_text() == before and not (tmp_path / "out").exists()


def test_a_merge_replaces_the_rows_it_remeasures_and_keeps_the_rest(experiments, tmp_path, monkeypatch):
    """--record --merge: a store run of a recorded row's key takes that row's place (not refused as a drop), every other
    recorded row stays."""
    monkeypatch.setitem(report.ROW_KEYS, "t", ("params.batch.size",))
    recorded = runs("a", "b", "c").assign(**{"params.batch.size": ["1", "2", "4"], "tags.device": "cpu"})
    report.record_csv("t", recorded, replace=True)
    store = runs("n").assign(**{"params.batch.size": "2", "tags.device": "cpu", "start_time": "2026-12-09"})
    monkeypatch.setattr(report, "runs_from_store", lambda name, uri, newest=True: store)
    monkeypatch.setitem(report.TABLES, "t", lambda df: ("### Headline\n\n| B |\n|---|\n| 1 |\n", None))
    monkeypatch.setattr(report, "REPORTS", tmp_path / "committed")
    assert report.main(["t", "--record", "--merge"]) == 0
    assert sorted(pd.read_csv(experiments)["run_id"]) == ["a", "c", "n"]


def test_record_refuses_noisy_runs_unless_asked(experiments, tmp_path, monkeypatch, capsys):
    """Runs the noise guard marked noisy are not recorded without --allow-noisy; the report regenerated from a record
    is made from the runs.csv just written, into the committed reports folder."""
    store = runs("a", "b", "c", "d").assign(**{"params.batch.size": "1", "tags.device": "cpu",
                                               "tags.noisy": ["false", "true", "false", "false"],
                                               "tags.noise_reason": ["", "other processes used 1.2 of 2 CPU cores",
                                                                     "", ""]})
    monkeypatch.setattr(report, "runs_from_store", lambda name, uri, newest=True: store)
    monkeypatch.setitem(report.TABLES, "t", lambda df: ("### Headline\n\n| B |\n|---|\n| 1 |\n", None))
    monkeypatch.setattr(report, "REPORTS", tmp_path / "committed")
    before = experiments.read_text()
    assert report.main(["t", "--record"]) == 1
    err = capsys.readouterr().err
    assert "1 of the 4 runs are noisy (first, B=1: other processes used 1.2 of 2 CPU cores)" in err
    assert "--allow-noisy" in err and experiments.read_text() == before
    assert report.main(["t", "--record", "--allow-noisy"]) == 0
    assert list(pd.read_csv(experiments)["run_id"]) == ["a", "b", "c", "d"]
    assert "experiments/t/runs.csv" in (tmp_path / "committed" / "t.md").read_text()
    # the results book quotes every committed report's headline: recording a table rewrites it too
    assert "[Full report](t.md)" in (tmp_path / "committed" / "README.md").read_text()
