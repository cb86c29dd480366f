"""onepass.harness.switch_ab: module switches parsed, applied, compared and restored, on the tiny qwen35 model (CPU)."""
import sys
import types

import pytest

from onepass.kernels.errors import ConfigError
from onepass.engine.fused_qwen35 import Projection
from onepass.harness import switch_ab


def test_parse_switch_finds_the_module_and_the_attribute_chain():
    s = switch_ab.parse_switch("engine.fused_qwen35.Projection.concurrent=True,False")
    assert (s.owner, s.attr, s.values, s.original) == (Projection, "concurrent", [True, False], Projection.concurrent)
    t = switch_ab.parse_switch("kernels.int4_wgmma_ws.X_IN_GEMM_MAX_BT=8, 0,16")
    assert t.values == [8, 0, 16] and t.module.__name__ == "onepass.kernels.int4_wgmma_ws"
    assert switch_ab.parse_switch("onepass.kernels.int4_wgmma_ws.X_IN_GEMM_MAX_BT=8,0").module is t.module


def test_values_from_files_are_literals_and_print_by_path(tmp_path):
    """@PATH: the attribute's top-level literal in a Python file (an earlier revision of the module), printed by
    its path; the module's own file gives its current value."""
    from onepass.kernels import int4_dispatch

    old = tmp_path / "old_dispatch.py"
    old.write_text("X = 1\nMEASURED: dict = {(8, 8, 'q4_0'): {'invariant': 'triton'}}\n"
                   "MEASURED = {(64, 64, 'q4_0'): {}}\n")
    s = switch_ab.parse_switch(f"kernels.int4_dispatch.MEASURED=@{old},@kernels/int4_measured.py")
    assert s.values[0] == {(64, 64, "q4_0"): {}}                 # the last top-level assignment
    assert s.values[1] == int4_dispatch.MEASURED and s.values[1] is not int4_dispatch.MEASURED
    assert switch_ab.variant_name([s], (s.values[0],)) == f"MEASURED=@{old}"
    (tmp_path / "bad.py").write_text("MEASURED = dict(a=1)\n")
    (tmp_path / "broken.py").write_text("MEASURED = {\n")
    for spec, msg in [(f"@{tmp_path}/nope.py", "cannot read"), (f"@{tmp_path}/bad.py", "not a literal"),
                      (f"@{tmp_path}/broken.py", "not a Python file")]:
        with pytest.raises(ConfigError, match=msg):
            switch_ab.parse_switch(f"kernels.int4_dispatch.MEASURED={spec},@{old}")
    with pytest.raises(ConfigError, match="no top-level assignment to 'CHAIN_US'"):
        switch_ab.parse_switch(f"kernels.int4_dispatch.CHAIN_US=@{old},@{old}")


@pytest.mark.parametrize("spec, msg", [
    ("kernels.int4_wgmma_ws.X_IN_GEMM_MAX_BT", "MODULE.ATTR=V1,V2"),
    ("kernels.int4_wgmma_ws.X_IN_GEMM_MAX_BT=8", "at least two values"),
    ("kernels.int4_wgmma_ws.X_IN_GEM_MAX_BT=8,0", "has no attribute 'X_IN_GEM_MAX_BT'"),
    ("no_such_package.knob=1,2", "no importable module"),
])
def test_bad_switches_are_refused_by_name(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        switch_ab.parse_switch(spec)


def test_cli_refuses_bad_arguments_with_exit_2(capsys):
    assert switch_ab.main(["model=tiny-qwen35"]) == 2
    assert "--switch" in capsys.readouterr().err
    assert switch_ab.main(["--switch", "engine.fused_qwen35.Projection.concurrent=True,False", "--batches", "a"]) == 2
    assert "--batches 'a'" in capsys.readouterr().err
    assert switch_ab.main(["experiment=hybrid_27b_q5", "--switch",
                           "engine.fused_qwen35.Projection.concurrent=True,False"]) == 2
    assert "experiment/hybrid_27b_q5" in capsys.readouterr().err


def test_ab_runs_every_variant_flags_changed_tokens_and_restores(tmp_path, monkeypatch):
    """Two switches, 2 x 2 variants at B = 1 and 2: a switch the CPU path never reads keeps the tokens; a knob that
    changes the sampled tokens is reported as not the baseline's; both are back at their values afterwards."""
    from onepass.engine import engine as engine_module

    knob = types.ModuleType("ab_test_knob")
    knob.shift = 0
    monkeypatch.setitem(sys.modules, "ab_test_knob", knob)
    real = engine_module.run_static

    def shifted(*args, **kw):          # the "kernel change": every token moved by the knob
        r = real(*args, **kw)
        r.outputs = [[t + knob.shift for t in o] for o in r.outputs]
        return r

    monkeypatch.setattr(engine_module, "run_static", shifted)
    switches = [switch_ab.parse_switch("engine.fused_qwen35.Projection.concurrent=True,False"),
                switch_ab.parse_switch("ab_test_knob.shift=0,1")]
    lines = []
    rows = switch_ab.run_ab(["model=tiny-qwen35", "engine=cpu", f"tracking.uri=sqlite:///{tmp_path}/m.db"], switches,
                            [1, 2], tokens=4, reps=2, out=lines.append)
    assert [(r["B"], r["variant"]) for r in rows] == [
        (b, f"concurrent={c!r}, shift={k!r}") for b in (1, 2) for c in (True, False) for k in (0, 1)]
    assert all(len(r["ms"]) == 2 and r["best_ms"] == min(r["ms"]) > 0 for r in rows)
    assert [r["same_tokens"] for r in rows] == [True, False, True, False] * 2
    assert rows[0]["vs_baseline"] == 1.0 and len(lines) == 8
    assert Projection.concurrent is True and knob.shift == 0


def test_ab_takes_unhashable_values(tmp_path, monkeypatch):
    """Values read from files are tables (dicts): the A/B keys its variants by position, not by value."""
    knob = types.ModuleType("ab_test_table")
    knob.TABLE = {"a": 1}
    monkeypatch.setitem(sys.modules, "ab_test_table", knob)
    src = tmp_path / "tables.py"
    src.write_text("TABLE = {'a': 2}\n")
    s = switch_ab.parse_switch(f"ab_test_table.TABLE={{'a': 1}},@{src}")
    rows = switch_ab.run_ab(["model=tiny-qwen35", "engine=cpu", f"tracking.uri=sqlite:///{tmp_path}/m.db"], [s], [1],
                            tokens=3, reps=1, out=lambda _: None)
    assert [r["variant"] for r in rows] == ["TABLE={'a': 1}", f"TABLE=@{src}"] and knob.TABLE == {"a": 1}
