"""harness.step_profile: kernels charged by how much later each one makes a step end (CPU, synthetic traces)."""
from __future__ import annotations

import pytest

from onepass.harness import step_profile


def _k(name, ts, dur, launch, grid=(1, 1, 1)):
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel", "args": {"correlation": launch, "grid": list(grid)}}


def test_charges_partition_each_step_and_overlap_is_not_double_counted():
    # step 1: a GEMM 0-10, a norm launched early (PDL) at 8 ending at 12, a side-stream kernel 2-6 inside the GEMM
    step = [_k("gemm<4, 8>", 0.0, 10.0, 1, grid=(132, 1, 1)), _k("norm", 8.0, 4.0, 1),
            _k("side", 2.0, 4.0, 1)]
    # step 2 (another graph launch): the same kernels 100 us later
    later = [dict(e, ts=e["ts"] + 100.0, args=dict(e["args"], correlation=2)) for e in step]
    steps = step_profile.charge_steps(step + later)
    assert len(steps) == 2
    for s in steps:
        charged = {k: sum(c for c, _ in v) for k, v in s.items()}
        # the side kernel ends inside the GEMM and takes the stretch it ends (0-6); the GEMM the rest (6-10)
        assert charged == pytest.approx({"gemm 132x1x1": 4.0, "norm 1x1x1": 2.0, "side 1x1x1": 6.0})
        assert sum(charged.values()) == pytest.approx(12.0)     # the span: first start to last end
    rows = step_profile.summarize(steps, B=4)
    by = {r["kernel"]: r for r in rows}
    assert by["gemm 132x1x1"]["duration_per_call_us"] == pytest.approx(10.0)
    assert by["norm 1x1x1"]["charged_per_call_us"] == pytest.approx(2.0)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert rows[0]["kernel"] == "side 1x1x1"     # sorted by what the step pays
    assert by["side 1x1x1"]["duration_per_call_us"] == pytest.approx(4.0)


def test_summary_leaves_out_launches_that_are_not_decode_steps():
    steps = [{"a 1x1x1": [[1.0, 1.0]] * 3}, {"a 1x1x1": [[1.0, 1.0]] * 3}, {"b 1x1x1": [[50.0, 50.0]]}]
    rows = step_profile.summarize(steps, B=1)
    assert [r["kernel"] for r in rows] == ["a 1x1x1"]
    assert rows[0]["calls"] == 3 and rows[0]["charged_us"] == pytest.approx(3.0)


def test_refuses_without_a_gpu(capsys):
    if step_profile.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert step_profile.main(["model=tiny-qwen35", "--batches", "1"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_profiles_a_graphed_step_on_the_gpu(tmp_path):
    """The tiny hybrid model's graphed decode steps traced: every step's kernels grouped under its graph launch, the
    charges adding up to a step's span, the rows written to the CSV."""
    import csv

    out = tmp_path / "p.csv"
    assert step_profile.main(["model=tiny-qwen35", "--batches", "2", "--steps", "3", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert rows and {r["B"] for r in rows} == {"2"}
    span = sum(float(r["charged_us"]) for r in rows)
    assert span > 0 and abs(sum(float(r["share"]) for r in rows) - 1.0) < 1e-6
    assert any("gdn_step" in r["kernel"] for r in rows)                      # the hybrid's own kernels are there
    assert all(float(r["charged_us"]) <= span for r in rows)
