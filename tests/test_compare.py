"""`onepass-report compare A B`: two sets of recorded runs (runs.csv files, commits of the recorded runs, run ids in
the tracking store) paired row by row by the key --record --merge uses, each headline figure of both with B/A, and a
regression past the threshold flagged (exit 1 with --fail-on-regression). Unknown runs are refused with what was
looked for."""
from __future__ import annotations

import pandas as pd
import pytest

from onepass.harness import compare, report


def scaling_row(i, B, tok, commit="a" * 40, device="NVIDIA H200", gemm="triton"):
    return {"run_id": f"r{commit[:2]}{i}", "start_time": f"2026-12-05 10:0{i}:00", "tags.table": "static_scaling",
            "tags.device": device, "tags.git_commit": commit, "params.model.name": "llama-3.2-1b",
            "params.engine.gemm": gemm, "params.batch.size": str(B), "metrics.throughput_tok_s": str(tok)}


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_csv_against_csv_pairs_rows_and_flags_a_regression(tmp_path, capsys):
    a = write(tmp_path / "a.csv", [scaling_row(0, 1, 200), scaling_row(1, 8, 1600),
                                   scaling_row(2, 8, 900, gemm="cublas")])
    b = write(tmp_path / "b.csv", [scaling_row(0, 1, 204), scaling_row(1, 8, 1400), scaling_row(2, 32, 5000),
                                   scaling_row(3, 1, 150, device="NVIDIA H100 80GB HBM3")])
    assert report.main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    head, _, *body = [line for line in out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in head.strip("|").split("|")] == ["batch.size", "tok/s A", "tok/s B", "tok/s B/A", "flag"]
    rows = {line.split("|")[1].strip(): line for line in body}
    assert set(rows) == {"1", "8"}                    # B = 32 and the H100's row have no counterpart in A
    assert "1.020" in rows["1"] and "REGRESSION" not in rows["1"]
    assert "1,600.0" in rows["8"] and "1,400.0" in rows["8"] and "0.875" in rows["8"]
    assert "REGRESSION tok/s -12.5%" in rows["8"]
    assert "1 configuration(s) of A and 2 of B have no counterpart" in out
    assert "2 rows compared; 1 regression(s) past 5%" in out
    assert "static_scaling batch.size=8: tok/s 1,600.0 -> 1,400.0 (-12.5%)" in out
    assert report.main(["compare", str(a), str(b), "--fail-on-regression"]) == 1
    assert report.main(["compare", str(a), str(b), "--fail-on-regression", "--threshold", "0.2"]) == 0


def test_a_kernel_time_regresses_upwards():
    """Where a table's headline is a time (decode_attention: us per call), a larger B/A is the regression."""
    def row(B, us):
        return {"run_id": f"d{B}{us}", "start_time": "2026-12-05", "tags.table": "decode_attention",
                "tags.device": "NVIDIA H200", "params.batch.size": str(B), "params.micro.ctx": "4096",
                "metrics.attn_us": str(us)}
    a = compare.Side("a", pd.DataFrame([row(1, 10.0), row(8, 20.0)]).assign(table="decode_attention"))
    b = compare.Side("b", pd.DataFrame([row(1, 9.0), row(8, 23.0)]).assign(table="decode_attention"))
    text, regressions, paired = compare.compare(a, b)
    assert paired == 2 and len(regressions) == 1 and "+15.0%" in regressions[0] and "batch.size=8" in regressions[0]
    assert "better us -10.0%" in text and "us (lower is better)" in text


def test_a_table_without_row_keys_never_pairs_two_configurations():
    """serving_schedule declares no row key: its rows pair by every param that takes more than one value over both
    sides, so a continuous row of A is not set against a static row of B."""
    def row(mode, tok, commit):
        return {"run_id": f"{mode}{commit}", "start_time": "2026-12-05", "tags.table": "serving_schedule",
                "tags.device": "NVIDIA H200", "params.scheduler.mode": mode, "params.batch.size": "16",
                "params.tracking.uri": f"sqlite:////{commit}.db", "metrics.throughput_tok_s": str(tok)}
    a = compare.Side("a", pd.DataFrame([row("continuous", 3000.0, "a")]).assign(table="serving_schedule"))
    b = compare.Side("b", pd.DataFrame([row("static", 2000.0, "b")]).assign(table="serving_schedule"))
    text, regressions, paired = compare.compare(a, b)
    assert paired == 0 and not regressions and "scheduler.mode" in text and "tracking.uri" not in text
    b2 = compare.Side("b", pd.DataFrame([row("static", 2000.0, "b"), row("continuous", 3300.0, "b")]).assign(
        table="serving_schedule"))
    text, regressions, paired = compare.compare(a, b2)
    assert paired == 1 and "1.100" in text and "continuous" in text


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """An experiments/ folder with static_scaling runs of two commits."""
    monkeypatch.setattr(report, "EXPERIMENTS", tmp_path / "experiments")
    write(tmp_path / "experiments" / "static_scaling" / "runs.csv",
          [scaling_row(0, 1, 200, commit="abcd1" + "0" * 35), scaling_row(1, 8, 1600, commit="abcd1" + "0" * 35),
           scaling_row(2, 1, 210, commit="abcd2" + "0" * 35), scaling_row(3, 8, 1700, commit="abcd2" + "0" * 35)])
    return tmp_path


def test_commits_name_the_rows_recorded_at_them(recorded, capsys):
    none = f"sqlite:///{recorded}/none.db"
    side = compare.resolve("abcd10", none)
    assert side.label.startswith("commit abcd100000") and list(side.runs["params.batch.size"]) == ["1", "8"]
    assert report.main(["compare", "abcd10", "ABCD2000", "--uri", none]) == 0
    assert "2 rows compared; 0 regression(s)" in capsys.readouterr().out
    assert not (recorded / "none.db").exists()            # looking up a commit leaves no store behind
    with pytest.raises(compare.CompareError, match="'abcd' is the start of 2 recorded commits"):
        compare.resolve("abcd", none)
    with pytest.raises(compare.CompareError, match=r"'abc' names no runs.*not a run id.*abcd200, abcd100"):
        compare.resolve("abc", none)                      # three digits: no sha, and no name git knows
    # a run that recorded a short sha is found by the full one
    write(recorded / "experiments" / "decode_attention" / "runs.csv", [{
        "run_id": "short", "start_time": "2026-12-04", "tags.table": "decode_attention", "tags.git_commit": "1234567",
        "params.batch.size": "1", "metrics.attn_us": "10.0"}])
    assert compare.resolve("1234567" + "89ab" * 8 + "0", none).runs["run_id"].tolist() == ["short"]
    assert report.main(["compare", "f00d", "abcd1"]) == 2
    assert "'f00d' names no runs" in capsys.readouterr().err
    assert report.main(["compare", "missing.csv", "abcd1"]) == 2
    assert "missing.csv: no such file" in capsys.readouterr().err
    no_table = write(recorded / "x.csv", [{k: v for k, v in scaling_row(0, 1, 1).items() if k != "tags.table"}])
    with pytest.raises(compare.CompareError, match="no tags.table column"):
        compare.resolve(str(no_table), "x")


def test_run_ids_are_looked_up_in_the_store(tmp_path, recorded, capsys):
    """A job's run id names that run; a sweep's parent run id names its finished jobs."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("t")
    parent = client.create_run(exp, tags={"onepass.kind": "sweep"}).info.run_id
    ids = []
    for B, tok in ((1, 190.0), (8, 1500.0)):
        run = client.create_run(exp, tags={"table": "static_scaling", "device": "NVIDIA H200",
                                           "mlflow.parentRunId": parent}).info.run_id
        for k, v in (("model.name", "llama-3.2-1b"), ("engine.gemm", "triton"), ("batch.size", str(B))):
            client.log_param(run, k, v)
        client.log_metric(run, "throughput_tok_s", tok)
        client.set_terminated(run)
        ids.append(run)
    one = compare.resolve(ids[1], uri)
    assert one.label == f"run {ids[1][:10]}" and list(one.runs["table"]) == ["static_scaling"]
    sweep = compare.resolve(parent, uri)
    assert sweep.label.startswith(f"sweep {parent[:10]} (2 runs)") and len(sweep.runs) == 2
    assert report.main(["compare", "abcd2", parent, "--uri", uri, "--fail-on-regression"]) == 1
    out = capsys.readouterr().out
    assert "-9.5%" in out and "-11.8%" in out and "2 regression(s)" in out
    with pytest.raises(compare.CompareError, match=f"no run of that id in {uri}"):
        compare.resolve("0" * 32, uri)
