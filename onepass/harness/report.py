"""Regenerate every documented results table from recorded runs.

Runs come from the MLflow store (`mlflow.search_runs` -> pandas) or from the copy kept in the repo,
`experiments/<name>/runs.csv` (the same frame: params.*, metrics.*, tags.* columns), so the reports
regenerate on any machine. Tables land in reports/<name>.md (and a plot where one reads better).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
REPORTS = ROOT / "reports"
TABLES: dict[str, Callable[[pd.DataFrame], tuple[str, object | None]]] = {}


def table(name: str):
    def deco(fn):
        TABLES[name] = fn
        return fn
    return deco


def runs_from_store(name: str, uri: str, newest: bool = True) -> pd.DataFrame:
    """The newest sweep (or, without sweeps, every finished run) tagged with this table; where several
    experiment files record into one table, the newest sweep of each. newest=False: every finished run."""
    import mlflow

    from onepass.harness.tracking import check_reachable

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return pd.DataFrame()   # no file, no runs: reading must not leave an empty store behind
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    df = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.table = '{name}' and attributes.status = 'FINISHED'")
    if df.empty:
        return df
    if "tags.onepass.kind" in df:
        df = df[df["tags.onepass.kind"].fillna("") != "sweep"]
    if newest and "tags.sweep_id" in df and df["tags.sweep_id"].notna().any():
        source = df["tags.experiment_file"].fillna("") if "tags.experiment_file" in df else pd.Series("", index=df.index)
        newest = df.sort_values("start_time").dropna(subset=["tags.sweep_id"]).groupby(source)["tags.sweep_id"].last()
        df = df[df["tags.sweep_id"].isin(set(newest))]
    return df.reset_index(drop=True)


def runs_from_csv(name: str) -> pd.DataFrame:
    path = EXPERIMENTS / name / "runs.csv"
    return pd.read_csv(path, dtype=str) if path.is_file() else pd.DataFrame()


# The columns that name one row of a table, for `--record --merge`: a rerun's row replaces the recorded row with the
# same key, every other recorded row is kept (a table assembled from several jobs, one part rerun at a time).
ROW_KEYS: dict[str, tuple[str, ...]] = {
    "int4_gemm": ("params.micro.n", "params.micro.k", "params.micro.fmt", "params.batch.size"),
    "hybrid_27b": ("params.engine.weights", "params.model.synthetic.weight_type", "params.engine.int4",
                   "params.kv_cache.state_dtype", "metrics.state_writeback", "params.scheduler.mode",
                   "params.scheduler.prefill", "params.engine.pdl", "params.engine.ready_scales", "params.batch.size"),
    "int4_e2e": ("params.model.name", "params.engine.weights", "params.engine.pdl", "params.engine.ready_scales",
                 "params.batch.size"),
}
# Every table's row key also holds the card (tags.device): a rerun on another device is recorded beside the rows it
# re-measures, never in their place.
DEVICE_KEY = "tags.device"
# Tables that show each row's device, so they may hold runs of several cards; any other table refuses a mix
# (check_one_device), since its rows would compare figures of different cards without saying so.
DEVICE_TABLES = {"hybrid_27b"}
# a key column that runs recorded before it existed lack, and the value they ran with
ROW_KEY_DEFAULTS = {DEVICE_KEY: "unknown device",
                    "params.engine.pdl": "False",    # PDL came in with engine.pdl (kernels/pdl.py)
                    "metrics.state_writeback": "1",   # the state written every token until kv_cache.state_writeback
                    "params.engine.ready_scales": "False"}   # Q4_K's ready scale words came with engine.ready_scales


def merge_runs(name: str, recorded: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """recorded (runs.csv) with every row whose ROW_KEYS key a run in `new` also has replaced by that run (the
    newest of them where several share a key)."""
    if name not in ROW_KEYS:
        raise ValueError(f"--merge: table {name!r} declares no row key; add one to harness/report.py ROW_KEYS "
                         f"(tables with one: {sorted(ROW_KEYS)}) or record without --merge")
    cols = (*ROW_KEYS[name], DEVICE_KEY)

    def keys(df: pd.DataFrame) -> pd.Series:
        df = df.assign(**{c: df[c].fillna(v) if c in df else v for c, v in ROW_KEY_DEFAULTS.items() if c in cols})
        missing = [c for c in cols if c not in df]
        if missing:
            raise ValueError(f"--merge: runs of {name!r} lack the row-key columns {missing}")
        # the store gives numbers where the CSV gives their text ("64.0" and "64" are one key)
        parts = [df[c].astype(str).str.replace(r"\.0$", "", regex=True) for c in cols]
        return pd.Series(list(zip(*parts)), index=df.index)

    new = new.assign(start_time=new["start_time"].astype(str)).sort_values("start_time")
    new = new[~keys(new).duplicated(keep="last")]
    if recorded.empty:
        return new.reset_index(drop=True)
    kept = recorded[~keys(recorded).isin(set(keys(new)))]
    return pd.concat([kept, new], ignore_index=True)


def check_one_device(name: str, df: pd.DataFrame) -> None:
    """Refuse a table without a device column whose runs came from several cards."""
    devices = sorted(df[DEVICE_KEY].dropna().astype(str).unique()) if DEVICE_KEY in df else []
    if len(devices) > 1 and name not in DEVICE_TABLES:
        raise ValueError(f"table {name!r} has runs from {len(devices)} devices ({', '.join(devices)}) and no device "
                         f"column; record one device's runs (a store of that card, or without --merge), or give the "
                         f"table a device column and add it to harness/report.py DEVICE_TABLES")


def device_label(df: pd.DataFrame) -> pd.Series:
    """Each run's card as a short label ("H200", "H100 80GB HBM3"); "?" where a run did not log one."""
    dev = df[DEVICE_KEY] if DEVICE_KEY in df else pd.Series(None, index=df.index, dtype=object)
    return dev.fillna("?").astype(str).str.removeprefix("NVIDIA ")


def record_csv(name: str, df: pd.DataFrame) -> Path:
    keep = [c for c in df.columns if c.startswith(("params.", "metrics.", "tags.")) or c in ("run_id", "start_time", "status")]
    path = EXPERIMENTS / name / "runs.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    df[keep].sort_values("start_time").to_csv(path, index=False)
    return path


def num(df: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(df[col], errors="coerce")


def provenance(df: pd.DataFrame) -> str:
    def uniq(col: str) -> str:
        return ", ".join(sorted(df[col].dropna().astype(str).unique())) if col in df else "?"

    commits = ", ".join(c[:10] for c in sorted(df["tags.git_commit"].dropna().unique())) if "tags.git_commit" in df else "?"
    dirty = " (uncommitted changes)" if "tags.git_dirty" in df and (df["tags.git_dirty"] == "true").any() else ""
    # kernel micro-benchmarks run no workload: say nothing rather than "workload ?"
    workload = f"workload {uniq('tags.workload_hash')}; " if "tags.workload_hash" in df else ""
    return (f"Device: {uniq('tags.device')}; torch {uniq('tags.torch_version')}, triton {uniq('tags.triton_version')}; "
            f"commit {commits}{dirty}; {workload}{len(df)} runs.")


def check(ok: pd.Series) -> pd.Series:
    return ok.map(lambda v: "✓" if v == 1 else "✗")


@table("static_batching")
def static_batching(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "vs single-stream": num(df, "metrics.speedup_vs_single"),
        "per-stream tok/s": num(df, "metrics.per_stream_tok_s"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values("B")
    md = d.to_markdown(index=False, floatfmt=(".0f", ",.1f", ".2f", ",.1f", ".2f", ""))
    return md, _plot(d["B"], d["aggregate tok/s"], "B (slots)", "aggregate tok/s", "Static batching")


@table("divergent_streams")
def divergent_streams(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "temperature": num(df, "params.sampling.temperature"),
        "distinct streams": num(df, "metrics.distinct_streams").astype(int).astype(str) + " / " + num(df, "params.batch.size").astype(int).astype(str),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values("B")
    return d.to_markdown(index=False, floatfmt=(".0f", ".2f", "", ",.1f", "")), None


def _opt(df: pd.DataFrame, col: str) -> pd.Series:
    return num(df, col) if col in df else pd.Series([float("nan")] * len(df), index=df.index)


@table("static_scaling")
def static_scaling(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "vs single-stream": num(df, "metrics.speedup_vs_single"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "step floor (ms)": _opt(df, "metrics.step_floor_ms"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "HF static tok/s": _opt(df, "metrics.peer_tok_s"),
        "vs HF": _opt(df, "metrics.speedup_vs_peer"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values("B")
    md = d.to_markdown(index=False, floatfmt=(".0f", ",.0f", ".1f", ".3f", ".3f", ".0%", ",.0f", ".2f", ""))
    return md.replace("nan", "—"), _plot(d["B"], d["aggregate tok/s"], "B (slots)", "aggregate tok/s", "Static batching, Llama-3.2-1B shapes")


@table("across_models")
def across_models(df: pd.DataFrame):
    d = pd.DataFrame({
        "model": df["params.model.name"],
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "vs single-stream": num(df, "metrics.speedup_vs_single"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values(["model", "B"])
    return d.to_markdown(index=False, floatfmt=("", ".0f", ",.0f", ".1f", ".3f", ".0%", "")), None


@table("graphs_backends")
def graphs_backends(df: pd.DataFrame):
    backend = df["tags.backend"]  # the resolved backend ("auto" in params)
    variant = (backend + df["params.engine.gemm"].where(backend == "triton", "")
               .map(lambda g: f" ({g} GEMM)" if g else "") + df["params.engine.cuda_graphs"].map(
                   lambda g: ", CUDA graphs" if g == "True" else ", eager"))
    d = pd.DataFrame({
        "engine": variant.str.replace("torch, CUDA graphs", "torch, eager"),
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values(["B", "aggregate tok/s"], ascending=[True, False])
    return d.to_markdown(index=False, floatfmt=("", ".0f", ",.0f", ".3f", ".0%", "")), None


@table("projection_crossover")
def projection_crossover(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "batched GEMM (us)": num(df, "metrics.gemm_us"),
        "one token (us)": num(df, "metrics.gemv_us"),
        "aggregate speedup": num(df, "metrics.speedup_vs_separate"),
        "TFLOP/s": num(df, "metrics.tflops"),
        "weights TB/s": num(df, "metrics.weight_tbps"),
        "cuBLAS (us)": num(df, "metrics.cublas_us"),
        "rows bit-exact": check(num(df, "metrics.verify_ok")),
    }).sort_values("B")
    md = d.to_markdown(index=False, floatfmt=(".0f", ".1f", ".1f", ".1f", ".0f", ".2f", ".1f", ""))
    return md, _plot(d["B"], d["aggregate speedup"], "B (tokens)", "speedup vs B single-token GEMMs", "Projection crossover")


@table("decode_attention")
def decode_attention(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "time (us)": num(df, "metrics.attn_us"),
        "one slot (us)": num(df, "metrics.attn_one_slot_us"),
        "aggregate speedup": num(df, "metrics.speedup_vs_one_slot"),
        "KV TB/s": num(df, "metrics.kv_tbps"),
        "max |err|": num(df, "metrics.max_abs_err"),
        "bit-exact per slot": check(num(df, "metrics.verify_ok")),
    }).sort_values("B")
    return d.to_markdown(index=False, floatfmt=(".0f", ".1f", ".1f", ".1f", ".2f", ".1e", "")), None


def _tag(df: pd.DataFrame, col: str) -> pd.Series:
    return df[col].fillna("—") if col in df else pd.Series(["—"] * len(df), index=df.index)


@table("int4_gemm")
def int4_gemm(df: pd.DataFrame):
    d = pd.DataFrame({
        "N x K": num(df, "params.micro.n").astype(int).astype(str) + " x " + num(df, "params.micro.k").astype(int).astype(str),
        "format": df["params.micro.fmt"],
        "B": num(df, "params.batch.size").astype(int),
        "Triton (us)": _opt(df, "metrics.triton_us"),
        "CUDA (us)": _opt(df, "metrics.cuda_us"),
        "CUDA mma (us)": _opt(df, "metrics.cuda_mma_us"),
        "mma folded (us)": _opt(df, "metrics.cuda_mma_fold_us"),
        "folded lat (us)": _opt(df, "metrics.cuda_mma_fold_lat_us"),
        "wgmma (us)": _opt(df, "metrics.cuda_wgmma_us"),
        "wgmma x2 (us)": _opt(df, "metrics.cuda_wgmma_x2_us"),
        "wgmma ws (us)": _opt(df, "metrics.cuda_wgmma_ws_us"),
        "ws t128 (us)": _opt(df, "metrics.cuda_wgmma_ws_t128_us"),
        "dequant + cuBLAS (us)": _opt(df, "metrics.dequant_cublas_us"),
        "bf16 cuBLAS (us)": _opt(df, "metrics.bf16_us"),
        "picked": _tag(df, "tags.int4_pick"),
        "effective TB/s": _opt(df, "metrics.effective_tbps"),
        "vs bf16": _opt(df, "metrics.speedup_vs_bf16"),
        "fastest": _tag(df, "tags.int4_best"),
        "PDL": _pdl(df),   # the int4 kernels' launches (harness/int4_bench.py); cuBLAS's never use it
        "verified": check(num(df, "metrics.verify_ok")),
    })
    d["_n"] = num(df, "params.micro.n")
    d["_k"] = num(df, "params.micro.k")
    d = d.sort_values(["format", "_n", "_k", "B"], ascending=[True, False, True, True]).drop(columns=["_n", "_k"])
    times = (".1f",) * 11                          # Triton .. bf16 cuBLAS
    md = d.to_markdown(index=False, floatfmt=("", "", ".0f") + times + ("", ".2f", ".2f", "", "", ""))
    return _standing(int4_gemm_standing(df), md.replace("nan", "—")), None


def _standing(standing: str, table: str) -> str:
    """A report that opens with where its targets stand, then every recorded row."""
    return f"### Where the targets stand\n\n{standing}\n\n### Every recorded row\n\n{table}"


# the int4_gemm targets (W4A16 kernels): B = 1 effective TB/s on 5120x17408 Q4_0, the fastest verified variant against
# bf16 cuBLAS at B = 1 and 16 on the three large shapes, and no B <= 128 where every int4 kernel is slower than
# dequantize + cuBLAS
INT4_TBPS_TARGET = 3.0
INT4_VS_BF16_TARGETS = {1: 3.0, 16: 2.5}
INT4_LARGE = ("5120x17408", "17408x5120", "5120x12288")


def int4_gemm_standing(df: pd.DataFrame) -> str:
    """The targets' table from the recorded rows (the fastest variant that verified, as the table's "fastest"); where
    a shape and B were recorded more than once, the newest row (start_time) stands."""
    if "start_time" in df:
        df = df.sort_values("start_time", kind="stable")
    shape = num(df, "params.micro.n").astype("Int64").astype(str) + "x" + num(df, "params.micro.k").astype("Int64").astype(str)
    newest = ~pd.DataFrame({"s": shape, "f": df["params.micro.fmt"], "b": df["params.batch.size"]}).duplicated(keep="last")
    df, shape = df[newest], shape[newest]
    fmt, B = df["params.micro.fmt"], num(df, "params.batch.size")
    best = _tag(df, "tags.int4_best")
    rows = []

    def at(sh: str, b: int, col: str) -> pd.Series:
        hit = df[(shape == sh) & (fmt == "q4_0") & (B == b) & (_opt(df, col).notna())]
        return hit.iloc[-1] if len(hit) else None

    r = at(INT4_LARGE[0], 1, "metrics.best_tbps")
    if r is not None:
        tbps = float(r["metrics.best_tbps"])
        rows.append((f"B = 1, {INT4_LARGE[0]} Q4_0: >= {INT4_TBPS_TARGET:.1f} TB/s effective",
                     f"{tbps:.2f} TB/s ({best[r.name]}, {float(r['metrics.best_us']):.1f} us)",
                     "met" if tbps >= INT4_TBPS_TARGET else "short"))
    for b, want in INT4_VS_BF16_TARGETS.items():
        got = [(sh, at(sh, b, "metrics.best_speedup_vs_bf16")) for sh in INT4_LARGE]
        got = [(sh, float(r["metrics.best_speedup_vs_bf16"]), best[r.name]) for sh, r in got if r is not None]
        if got:
            rows.append((f"B = {b}: >= {want:.1f}x bf16 cuBLAS on {' / '.join(sh for sh, _, _ in got)} Q4_0",
                         " / ".join(f"{v:.2f}x ({k})" for _, v, k in got),
                         "met" if all(v >= want for _, v, _ in got) else "short"))
    from onepass.kernels.int4_dispatch import INVARIANT_VARIANTS   # every int4 kernel (dequant + cuBLAS is the last variant)

    ours = pd.concat([_opt(df, f"metrics.{v}_us").where(_opt(df, f"metrics.{v}_ok") == 1) for v in INVARIANT_VARIANTS],
                     axis=1).min(axis=1)
    deq = _opt(df, "metrics.dequant_cublas_us")
    slower = df[(ours > deq) & (B <= 128)]
    where = ", ".join(f"{shape[i]} {fmt[i]} B = {int(B[i])} ({ours[i]:.1f} against {deq[i]:.1f} us)"
                      for i in slower.sort_values(["params.micro.fmt"]).index)
    rows.append(("every B <= 128: an int4 kernel no slower than dequantize + cuBLAS",
                 f"slower at {len(slower)} of {int(deq.notna().sum())} rows: {where}" if len(slower) else
                 f"all {int(deq.notna().sum())} rows", "short" if len(slower) else "met"))
    return pd.DataFrame(rows, columns=["target", "now (newest recorded rows)", ""]).to_markdown(index=False)


def _pdl(df: pd.DataFrame) -> pd.Series:
    """How the run's kernels launched (metrics.pdl, kernels/pdl.py: off; on; on, early = the Triton kernels triggering
    their dependents at entry; release = the CUDA GEMMs releasing theirs once their weight loads are issued; runs
    recorded before it existed: off)."""
    return _opt(df, "metrics.pdl").fillna(0).map({0: "off", 1: "on", 2: "on, early", 3: "on, release",
                                                  4: "on, early, release"}.get)


@table("int4_e2e")
def int4_e2e(df: pd.DataFrame):
    d = pd.DataFrame({
        "model": df["params.model.name"],
        "weights": df["params.engine.weights"] if "params.engine.weights" in df else "dequant",
        "PDL": _pdl(df),
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "weights on GPU (MiB)": _opt(df, "metrics.weights_mb"),
        "GGUF file (MiB)": _opt(df, "metrics.gguf_mb"),
        # beside the weights: Q4_K's scale words made once per weight (engine.ready_scales; rows before it: none)
        "+ ready Q4_K scales (MiB)": _opt(df, "metrics.ready_scales_mb").fillna(0.0),
        "load (s)": num(df, "metrics.load_s"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values(["model", "B", "weights", "PDL"], ascending=[True, True, False, True])
    md = d.to_markdown(index=False, floatfmt=("", "", "", ".0f", ",.0f", ".3f", ",.0f", ",.0f", ",.0f", ".1f", ".0%", ""))
    return md.replace("nan%", "—").replace("nan", "—"), None


@table("gdn_step")
def gdn_step(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "ours (us/layer)": num(df, "metrics.our_us"),
        "FLA (us/layer)": _opt(df, "metrics.fla_us"),
        "vs FLA": _opt(df, "metrics.speedup"),
        "state floor (us)": num(df, "metrics.floor_us"),
        "floor reached": num(df, "metrics.floor_frac"),
        "ours, bf16 state (us)": _opt(df, "metrics.our_bf16_us"),
        "max rel err": num(df, "metrics.max_err"),
        "FLA max rel err": _opt(df, "metrics.fla_max_err"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values("B")
    md = d.to_markdown(index=False, floatfmt=(".0f", ".1f", ".1f", ".2f", ".1f", ".0%", ".1f", ".1e", ".1e", ""))
    return md.replace("nan%", "—").replace("nan", "—"), None


@table("hybrid_27b")
def hybrid_27b(df: pd.DataFrame):
    d = pd.DataFrame({
        "device": device_label(df),
        "weights": df["params.engine.weights"] if "params.engine.weights" in df else "dequant",
        # the synthetic model's block type (Q4_K unless told); the "dequant" rows load those blocks as bf16
        "type": (df["params.model.synthetic.weight_type"].fillna("q4_k") if "params.model.synthetic.weight_type" in df
                 else "q4_k"),
        "int4 kernel": (df["params.engine.int4"].where(df["params.engine.weights"] == "packed", "—")
                        if "params.engine.int4" in df else "—"),
        "state": df["params.kv_cache.state_dtype"] if "params.kv_cache.state_dtype" in df else "float32",
        # tokens per write of the whole state (kv_cache.state_writeback; rows from before it wrote every token)
        "write-back": _opt(df, "metrics.state_writeback").fillna(1).astype(int),
        # continuous serving's prompts go through the decode step token by token, or in chunks ("chunked")
        "mode": df["params.scheduler.mode"] + (df["params.scheduler.prefill"] if "params.scheduler.prefill" in df
                                               else pd.Series("", index=df.index)).eq("chunked").map(
            {True: ", chunked", False: ""}),
        "PDL": _pdl(df),
        "Q4_K scales": _q4k_scales(df),
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        # static: p50 of the step's wall time; continuous: the mean device time of a serving step
        "per-step latency (ms)": _opt(df, "metrics.step_ms_p50").fillna(_opt(df, "metrics.gpu_step_ms")),
        "step floor (ms)": _opt(df, "metrics.step_floor_ms"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "state MB / slot": _opt(df, "metrics.state_mb_per_slot"),
        "bf16 state: greedy agree": _opt(df, "metrics.bf16_state_greedy_agree"),
        "bf16 state: logit err": _opt(df, "metrics.bf16_state_logit_err"),
        "verified": check(num(df, "metrics.verify_ok")),
        # how many distinct tokens the single-stream reference made (runs since 6d9bba4): 1 means the verify compared
        # constant streams and could not fail
        "reference distinct tokens": _opt(df, "metrics.reference_distinct_tokens"),
    }).assign(_target_card=lambda x: x["device"] != HYBRID_TARGET_DEVICE)
    d = d.sort_values(["_target_card", "device", "weights", "type", "state", "write-back", "mode", "PDL", "Q4_K scales",
                       "B"], ascending=[True, True, False, False, False, True, False, True, False, True])
    d = d.drop(columns="_target_card")
    standing = hybrid_27b_standing(d.assign(_start=df["start_time"] if "start_time" in df else ""))
    md = d.to_markdown(index=False, floatfmt=("", "", "", "", "", ".0f", "", "", "", ".0f", ",.0f", ".2f", ".2f", ".0%",
                                              ",.1f", ".0%", ".1e", "", ".0f"))
    return _standing(standing, md.replace("nan%", "—").replace("nan", "—")), None


def _q4k_scales(df: pd.DataFrame) -> pd.Series:
    """The packed Q4_K rows' engine.ready_scales: "ready" (the GEMMs in batch tiles above 8 sequences read scale words
    made once per weight, kernels/int4_wgmma_ws.py) or "file" (only the file's scales, as every run before the
    setting); "—" for other rows."""
    ready = (df["params.engine.ready_scales"].astype(str) if "params.engine.ready_scales" in df
             else pd.Series("False", index=df.index)).str.lower().eq("true")
    packed = df["params.engine.weights"].eq("packed") if "params.engine.weights" in df else pd.Series(False, index=df.index)
    q4k = (df["params.model.synthetic.weight_type"].fillna("q4_k") if "params.model.synthetic.weight_type" in df
           else pd.Series("q4_k", index=df.index)).eq("q4_k")
    return ready.map({True: "ready", False: "file"}).where(packed & q4k, "—")


# the hybrid_27b targets: aggregate tok/s with Q4 weights (packed, the invariant kernels) and fp32 state, verified;
# "reached" for Q4_K blocks (what Qwen3.5 / 3.8 Q4 files mostly hold), and for each other Q4 type recorded; the
# targets are the H200's, so "reached" counts that card's rows only
HYBRID_TARGETS = {1: 200, 32: 3_000, 128: 6_000}
HYBRID_TARGET_TYPE = "q4_k"
HYBRID_TARGET_DEVICE = "H200"


def _type_suffix(kind: str) -> str:
    """What a standing column's name gains for a block type other than the targets' own."""
    return "" if kind == HYBRID_TARGET_TYPE else f", {kind.upper()}"


def _share(x: float) -> str:
    """A fraction of a target as a percentage rounded down to 0.1, so a row short of its target never reads 100%."""
    return f"{math.floor(x * 1000 + 1e-9) / 10:.1f}%"


def hybrid_27b_standing(d: pd.DataFrame) -> str:
    """Per B, the newest packed Q4 row of each mode, state and block type (tok/s; ✗ where it did not verify), against
    the target for static batching with fp32 state; rows of another card than the targets' get columns of their own,
    named by the card, and no "reached"."""
    d = d[(d["weights"] == "packed") & (d["int4 kernel"] == "invariant")].copy()
    if d.empty:
        return "No packed Q4 rows (engine.weights=packed, the invariant int4 kernels) recorded yet."
    other_card = (d["device"] + ": ").where(d["device"] != HYBRID_TARGET_DEVICE, "")
    d["column"] = other_card + d["mode"] + d["state"].map(lambda v: ", bf16 state" if v == "bfloat16" else ", fp32 state"
                                                          ).where(d["mode"] == "static", "") + d["type"].map(_type_suffix)
    # the newest row whole (groupby().last() would take each column's last non-null value, mixing rows)
    d = d.sort_values("_start", kind="stable").drop_duplicates(["column", "B"], keep="last")
    cell = [("—" if pd.isna(v) else f"{v:,.0f}") + ("" if ok == "✓" else " ✗")
            for v, ok in zip(d["aggregate tok/s"], d["verified"])]
    t = d.assign(cell=cell).pivot(index="B", columns="column", values="cell").fillna("—")
    other_types = sorted(c for c in t if c.startswith("static, fp32 state, "))
    order = [c for c in ("static, fp32 state", *other_types, "static, bf16 state", "continuous", "continuous, chunked")
             if c in t]
    # the targets' card first, then each other card's columns
    t = t[order + sorted((c for c in t if c not in order), key=lambda c: (": " in c, c))]
    t["target (static, fp32 state)"] = [f"{HYBRID_TARGETS[b]:,}" if b in HYBRID_TARGETS else "—" for b in t.index]
    for kind in sorted(d.loc[d["device"] == HYBRID_TARGET_DEVICE, "type"].unique(), key=lambda k: k != HYBRID_TARGET_TYPE):
        fp32 = d[d["column"] == "static, fp32 state" + _type_suffix(kind)].set_index("B")["aggregate tok/s"]
        t["reached" + ("" if kind == HYBRID_TARGET_TYPE else f" ({kind.upper()})")] = [
            _share(fp32[b] / HYBRID_TARGETS[b]) if b in HYBRID_TARGETS and b in fp32 else "—" for b in t.index]
    return t.reset_index().to_markdown(index=False)


def _serving(df: pd.DataFrame, first: dict) -> pd.DataFrame:
    return pd.DataFrame({**first,
        "steps": num(df, "metrics.steps").astype(int),
        "gen tok/s": num(df, "metrics.throughput_tok_s"),
        "requests/s": num(df, "metrics.requests_s"),
        "slot utilization": num(df, "metrics.slot_util"),
        "prefill tokens": num(df, "metrics.prefill_tokens").astype(int),
        "peak KV blocks": _opt(df, "metrics.peak_blocks"),
        "KV pool MB": num(df, "metrics.kv_pool_mb"),
        "host ms/step": num(df, "metrics.host_ms_p50"),
        "GPU ms/step": _opt(df, "metrics.gpu_step_ms"),
        "correct": check(num(df, "metrics.verify_ok")),
    })


SERVING_FMT = (",.0f", ",.1f", ".1f", ".1%", ",.0f", ",.0f", ",.0f", ".2f", ".2f", "")


@table("serving_schedule")
def serving_schedule(df: pd.DataFrame):
    d = _serving(df, {"scheduling": df["params.scheduler.mode"] + " / " + df["params.scheduler.prefill"] + " prefill"})
    return d.to_markdown(index=False, floatfmt=("",) + SERVING_FMT).replace("nan", "—"), None


@table("serving_paged")
def serving_paged(df: pd.DataFrame):
    pool = df["params.kv_cache.layout"] + num(df, "metrics.kv_blocks").map(lambda b: "" if pd.isna(b) else f", {int(b) - 1}-block pool")
    d = _serving(df, {"KV cache": pool})
    return d.sort_values("KV pool MB", ascending=False).to_markdown(index=False, floatfmt=("",) + SERVING_FMT).replace("nan", "—"), None


@table("serving_prefix")
def serving_prefix(df: pd.DataFrame):
    d = _serving(df, {"prefix cache": df["params.kv_cache.prefix"]})
    return d.to_markdown(index=False, floatfmt=("",) + SERVING_FMT).replace("nan", "—"), None


table("serving_prefix_hybrid")(serving_prefix)   # the same columns, for the hybrid model's off / pinned rows


@table("serving_sampling")
def serving_sampling(df: pd.DataFrame):
    d = pd.DataFrame({
        "sampling": df["params.sampling.on_device"].map({"True": "on-device", "False": "host"}),
        "D2H per step (B)": num(df, "metrics.d2h_bytes_per_step"),
        "wall (s)": num(df, "metrics.wall_s"),
        "gen tok/s": num(df, "metrics.throughput_tok_s"),
        "host ms/step": num(df, "metrics.host_ms_p50"),
        "HF continuous tok/s": _opt(df, "metrics.peer_tok_s"),
        "vs HF": _opt(df, "metrics.speedup_vs_peer"),
        "correct": check(num(df, "metrics.verify_ok")),
    })
    return d.to_markdown(index=False, floatfmt=("", ",.0f", ".2f", ",.1f", ".2f", ",.0f", ".1f", "")).replace("nan", "—"), None


@table("serving_full")
def serving_full(df: pd.DataFrame):
    d = pd.DataFrame({
        "prefill": df["params.scheduler.prefill"],
        "steps": num(df, "metrics.steps").astype(int),
        "gen tok/s": num(df, "metrics.throughput_tok_s"),
        "requests/s": num(df, "metrics.requests_s"),
        "GPU ms/step": _opt(df, "metrics.gpu_step_ms"),
        "host ms/step (mean)": _opt(df, "metrics.host_ms_mean"),
        "host / GPU": _opt(df, "metrics.host_over_gpu"),
        "GPU busy": _opt(df, "metrics.gpu_busy_frac"),
        "HF continuous tok/s": _opt(df, "metrics.peer_tok_s"),
        "vs HF": _opt(df, "metrics.speedup_vs_peer"),
        "correct": check(num(df, "metrics.verify_ok")),
    })
    fmt = ("", ",.0f", ",.0f", ".1f", ".2f", ".2f", ".0%", ".0%", ",.0f", ".1f", "")
    return d.to_markdown(index=False, floatfmt=fmt).replace("nan", "—"), None


@table("verified_fresh")
def verified_fresh(df: pd.DataFrame):
    serving = df["params.scheduler.mode"] != "static"
    mode = ("static B=" + df["params.batch.size"]).where(
        ~serving, "continuous B=" + df["params.batch.size"] + ", R=" + df.get("params.workload.num_requests", "")
        + ", " + df["params.kv_cache.layout"] + "+prefix " + df["params.kv_cache.prefix"])
    d = pd.DataFrame({
        "model": df["params.model.name"],
        "mode": mode,
        "B": num(df, "params.batch.size").astype(int),
        "tok/s": num(df, "metrics.throughput_tok_s"),
        "per-stream tok/s": _opt(df, "metrics.per_stream_tok_s"),
        "requests/s": _opt(df, "metrics.requests_s"),
        "slot utilization": _opt(df, "metrics.slot_util"),
        "correct": check(num(df, "metrics.verify_ok")),
    })
    d = d.assign(serving=serving).sort_values(["model", "serving", "B"]).drop(columns=["B", "serving"])
    fmt = ("", "", ",.0f", ",.1f", ".1f", ".1%", "")
    return d.to_markdown(index=False, floatfmt=fmt).replace("nan%", "—").replace("nan", "—"), None


@table("serving_qwen3")
def serving_qwen3(df: pd.DataFrame):
    d = _serving(df, {"Qwen3-1.7B": "paged, prefix " + df["params.kv_cache.prefix"]})
    return d.to_markdown(index=False, floatfmt=("",) + SERVING_FMT).replace("nan", "—"), None


def _plot(x, y, xlabel: str, ylabel: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(x, y, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def write_report(name: str, df: pd.DataFrame, source: str, out: Path) -> Path:
    md, fig = TABLES[name](df)
    readme = EXPERIMENTS / name / "README.md"
    title = readme.read_text().splitlines()[0].lstrip("# ").strip() if readme.is_file() else name
    out.mkdir(parents=True, exist_ok=True)
    body = [f"# {title}", "", f"_Generated by `onepass-report` from {source}; do not edit by hand._", "", md, "",
            provenance(df), ""]
    if fig is not None:
        fig.savefig(out / f"{name}.png", dpi=120)
        body += [f"![{name}]({name}.png)", ""]
    path = out / f"{name}.md"
    path.write_text("\n".join(body))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate the results tables under reports/ from recorded runs.")
    ap.add_argument("names", nargs="*", help="experiments to report (default: every one with a table)")
    ap.add_argument("--source", choices=("auto", "store", "csv"), default="auto",
                    help="auto: the tracking store when it has runs for the table, else experiments/<name>/runs.csv")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--record", action="store_true", help="also write the store's runs to experiments/<name>/runs.csv")
    ap.add_argument("--merge", action="store_true",
                    help="with --record: replace only the recorded rows the store's runs re-measure (ROW_KEYS), keep the rest")
    ap.add_argument("--all-sweeps", action="store_true",
                    help="take every finished run in the store, not only the newest sweep of each experiment file")
    ap.add_argument("--out", default=str(REPORTS))
    args = ap.parse_args(argv)
    names = args.names or sorted(n for n in TABLES if (EXPERIMENTS / n).is_dir())
    status = 0
    for name in names:
        if name not in TABLES:
            print(f"[report] no table named {name!r}; known: {sorted(TABLES)}", file=sys.stderr)
            status = 1
            continue
        df, source = pd.DataFrame(), ""
        if args.source in ("auto", "store"):
            try:
                df, source = runs_from_store(name, args.uri, newest=not args.all_sweeps), f"the tracking store {args.uri}"
            except Exception as e:
                print(f"[report] {name}: tracking store unavailable ({e})", file=sys.stderr)
        if df.empty and args.source in ("auto", "csv"):
            df, source = runs_from_csv(name), f"experiments/{name}/runs.csv"
        if df.empty:
            print(f"[report] {name}: no recorded runs (run `onepass -m experiment={name}` first)", file=sys.stderr)
            status = 1
            continue
        if args.record and source.startswith("the tracking store"):
            if args.merge:
                try:
                    df = merge_runs(name, runs_from_csv(name), df)
                except ValueError as e:
                    print(f"[report] {e}", file=sys.stderr)
                    status = 1
                    continue
                source += f" merged into experiments/{name}/runs.csv"
        try:
            check_one_device(name, df)
        except ValueError as e:
            print(f"[report] {e}", file=sys.stderr)
            status = 1
            continue
        if args.record and source.startswith("the tracking store"):
            print(f"[report] {name}: recorded {len(df)} runs to {record_csv(name, df)}")
        path = write_report(name, df, source, Path(args.out))
        print(f"[report] {name}: {path} ({len(df)} runs from {source})")
        print(path.read_text())
    return status


if __name__ == "__main__":
    sys.exit(main())
