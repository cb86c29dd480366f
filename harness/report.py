"""Regenerate every documented results table from recorded runs.

Runs come from the MLflow store (`mlflow.search_runs` -> pandas) or from the copy kept in the repo,
`experiments/<name>/runs.csv` (the same frame: params.*, metrics.*, tags.* columns), so the reports
regenerate on any machine. Tables land in reports/<name>.md (and a plot where one reads better); regenerating
every table (`onepass-report` without names, or `--all`) also writes the results book, reports/README.md.
`--all` rewrites the committed reports/ from the recorded runs.csv files, `--all --check` fails where a committed
report differs from what they regenerate (CI runs it), and `onepass-report compare A B` sets two runs, commits or
runs.csv files side by side (harness/compare.py).

Each report reads top down: its title, one line naming the card(s) and commit(s) of its rows, a headline table of
at most HEADLINE_MAX_COLUMNS columns (one row per configuration that matters), the plot where there is one, where
the targets stand (tables with targets), then "Every recorded row", the full table.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
REPORTS = ROOT / "reports"
# where reports of a user's own runs go (under the working folder; ignored by git): the committed reports/ change only
# when a recorded runs.csv does (--record), or when asked (--out reports)
LOCAL_REPORTS = Path("outputs") / "reports"
TABLES: dict[str, Callable[[pd.DataFrame], tuple[str, object | None]]] = {}
# one sentence per table on what it measures (the results book's first line of each section)
ABOUT: dict[str, str] = {}
HEADLINE_MAX_COLUMNS = 8
HEADLINE, TARGETS, ROWS = "### Headline", "### Where the targets stand", "### Every recorded row"


def table(name: str, about: str = ""):
    def deco(fn):
        TABLES[name] = fn
        ABOUT[name] = about
        return fn
    return deco


def runs_from_store(name: str, uri: str, newest: bool = True, sweep_id: str | None = None) -> pd.DataFrame:
    """The newest sweep (or, without sweeps, every finished run) tagged with this table; where several
    experiment files record into one table, the newest sweep of each. newest=False: every finished run; sweep_id:
    that sweep's finished runs."""
    import mlflow

    from onepass.harness.tracking import check_reachable, sqlite_file, store_lock

    if (db := sqlite_file(uri)) is not None and not db.is_file():
        return pd.DataFrame()   # no file, no runs: reading must not leave an empty store behind
    with store_lock(uri):       # a store being created by a sweep is read once it is whole
        check_reachable(uri)    # an empty file is refused, never given a schema
        mlflow.set_tracking_uri(uri)
        df = mlflow.search_runs(search_all_experiments=True,
                                filter_string=f"tags.table = '{name}' and attributes.status = 'FINISHED'"
                                + (f" and tags.sweep_id = '{sweep_id}'" if sweep_id else ""))
    if df.empty:
        return df
    if "tags.onepass.kind" in df:
        df = df[df["tags.onepass.kind"].fillna("") != "sweep"]
    if newest and "tags.sweep_id" in df and df["tags.sweep_id"].notna().any():
        source = (df["tags.experiment_file"].fillna("") if "tags.experiment_file" in df
                  else pd.Series("", index=df.index))
        newest = df.sort_values("start_time").dropna(subset=["tags.sweep_id"]).groupby(source)["tags.sweep_id"].last()
        df = df[df["tags.sweep_id"].isin(set(newest))]
    return df.reset_index(drop=True)


class RunsFileError(ValueError):
    """A recorded runs.csv that cannot be read as a table of runs: said with the file and how to mend it."""


def _schema_hint(e: Exception) -> str:
    """What to do about a SQLite store whose schema is not this MLflow's (MLflow's own message says to upgrade, which
    is wrong where a newer MLflow, say a GPU machine's, wrote the store)."""
    if "database schema" not in str(e):
        return ""
    import mlflow

    return (f". This is mlflow {mlflow.__version__}: a store written by a newer MLflow is read with that version "
            "(pip install mlflow==<its version>); an older store is brought up to date with `mlflow db upgrade "
            "<uri>` after a backup")


def refused(e: ValueError) -> int:
    """Say why a report was not made; its exit status: 2 for a damaged runs.csv (bad input), else 1."""
    if isinstance(e, RunsFileError):
        print(f"[error] {e}", file=sys.stderr)
        return 2
    print(f"[report] {e}", file=sys.stderr)
    return 1


def runs_from_csv(name: str) -> pd.DataFrame:
    """experiments/<name>/runs.csv as a frame of text cells (empty where there is no file); RunsFileError where the
    file is empty, binary, not a CSV table, or has a row that is not a run."""
    path = EXPERIMENTS / name / "runs.csv"
    if not path.is_file():
        return pd.DataFrame()
    where = _shown(path)
    return read_runs(path, f"restore it (git checkout -- {where}) or record it again "
                           f"(onepass-report {name} --record --replace)")


def read_runs(path: Path, fix: str) -> pd.DataFrame:
    """A runs.csv as a frame of text cells; RunsFileError (ending with `fix`) where the file is empty, binary, not a
    CSV table, or has a row that is not a run."""
    where = _shown(path)
    data = path.read_bytes()
    if not data.strip():
        raise RunsFileError(f"{where} is empty; {fix}")
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RunsFileError(f"{where} is binary, not a CSV table of runs; {fix}") from None
    try:
        df = pd.read_csv(io.StringIO(text), dtype=str)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise RunsFileError(f"{where} is not a CSV table of runs ({str(e).strip().splitlines()[0]}); {fix}") from None
    if "run_id" not in df:
        raise RunsFileError(f"{where} has no run_id column (its header: {', '.join(map(str, df.columns[:4]))}, ...), "
                            f"so it is not a table of recorded runs; {fix}")
    # a cell each row must hold: a run id, a time, numbers for metrics (empty where a run did not log one)
    bad = {"run_id": df["run_id"].fillna("").str.strip() == ""}
    if "start_time" in df:
        bad["start_time"] = pd.to_datetime(df["start_time"], errors="coerce", format="mixed").isna()
    for c in (c for c in df.columns if c.startswith("metrics.")):
        bad[c] = df[c].notna() & pd.to_numeric(df[c], errors="coerce").isna()
    for c, rows in bad.items():
        if rows.any():
            i = int(rows.to_numpy().nonzero()[0][0])   # file line = row + 2 (the header is line 1)
            raise RunsFileError(f"{where} line {i + 2} is not a recorded run ({c}={df[c].iloc[i]!r} is not "
                                f"{'a number' if c.startswith('metrics.') else 'given' if c == 'run_id' else 'a time'})"
                                f": delete or correct that line, or {fix}")
    return df


def _shown(path: Path) -> str:
    """path relative to the checkout where it lies inside it (as a user would type it there)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# The columns that name one row of a table, for `--record --merge`: a rerun's row replaces the recorded row with the
# same key, every other recorded row is kept (a table assembled from several jobs, one part rerun at a time).
ROW_KEYS: dict[str, tuple[str, ...]] = {
    "int4_gemm": ("params.micro.n", "params.micro.k", "params.micro.fmt", "params.batch.size"),
    "hybrid_27b": ("params.engine.weights", "params.model.synthetic.weight_type", "params.engine.int4",
                   "params.kv_cache.state_dtype", "metrics.state_writeback", "params.scheduler.mode",
                   "params.scheduler.prefill", "params.engine.pdl", "params.engine.ready_scales", "params.batch.size"),
    "int4_e2e": ("params.model.name", "params.engine.weights", "params.engine.pdl", "params.engine.ready_scales",
                 "params.batch.size"),
    "static_scaling": ("params.model.name", "params.engine.gemm", "params.batch.size"),
    "serving_full": ("params.scheduler.mode", "params.scheduler.prefill", "params.batch.size"),
    "spec_decode": ("params.model.name", "params.speculative.method", "params.speculative.k",
                    "params.speculative.acceptance", "params.workload.name", "params.batch.size"),
    "latency": ("params.model.name", "params.engine.weights", "params.engine.step", "params.engine.persistent_form",
                "params.batch.size"),
}
# Every table's row key also holds the card (tags.device): a rerun on another device is recorded beside the rows it
# re-measures, never in their place.
DEVICE_KEY = "tags.device"
# Tables that show each row's device, so they may hold runs of several cards; any other table refuses a mix
# (check_one_device), since its rows would compare figures of different cards without saying so.
DEVICE_TABLES = {"hybrid_27b", "static_scaling", "int4_e2e", "serving_full", "spec_decode", "latency"}
# a key column that runs recorded before it existed lack, and the value they ran with
ROW_KEY_DEFAULTS = {DEVICE_KEY: "unknown device",
                    "params.engine.pdl": "False",    # PDL came in with engine.pdl (kernels/pdl.py)
                    "metrics.state_writeback": "1",   # the state written every token until kv_cache.state_writeback
                    "params.engine.ready_scales": "False",   # Q4_K's ready scale words came with engine.ready_scales
                    "params.engine.persistent_form": ""}   # the persistent step's defaults, before it took settings


def merge_runs(name: str, recorded: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """recorded (runs.csv) with every row whose ROW_KEYS key a run in `new` also has replaced by that run (the
    newest of them where several share a key)."""
    if name not in ROW_KEYS:
        raise ValueError(f"--merge: table {name!r} declares no row key; add one to harness/report.py ROW_KEYS "
                         f"(tables with one: {sorted(ROW_KEYS)}) or record without --merge")
    cols = (*ROW_KEYS[name], DEVICE_KEY)

    def keys(df: pd.DataFrame) -> pd.Series:
        missing = [c for c in cols if c not in df and c not in ROW_KEY_DEFAULTS]
        if missing:
            raise ValueError(f"--merge: runs of {name!r} lack the row-key columns {missing}")
        return row_keys(df, cols)

    new = new.assign(start_time=new["start_time"].astype(str)).sort_values("start_time")
    new = new[~keys(new).duplicated(keep="last")]
    if recorded.empty:
        return new.reset_index(drop=True)
    kept = recorded[~keys(recorded).isin(set(keys(new)))]
    return pd.concat([kept, new], ignore_index=True)


def row_keys(df: pd.DataFrame, cols: Sequence[str]) -> pd.Series:
    """Each run's key: its values of cols as a tuple of text, a column's ROW_KEY_DEFAULTS value where a run recorded
    before the column existed lacks it ("—" where a column has no default)."""
    df = df.assign(**{c: df[c].fillna(ROW_KEY_DEFAULTS[c]) if c in df else ROW_KEY_DEFAULTS[c]
                      for c in cols if c in ROW_KEY_DEFAULTS})
    # the store gives numbers where the CSV gives their text ("64.0" and "64" are one key)
    parts = [df[c].astype(str).str.replace(r"\.0$", "", regex=True) if c in df else pd.Series("—", index=df.index)
             for c in cols]
    return pd.Series(list(zip(*parts)), index=df.index)


def check_one_device(name: str, df: pd.DataFrame) -> None:
    """Refuse a table without a device column whose runs came from several cards."""
    devices = sorted(df[DEVICE_KEY].dropna().astype(str).unique()) if DEVICE_KEY in df else []
    if len(devices) > 1 and name not in DEVICE_TABLES:
        raise ValueError(f"table {name!r} has runs from {len(devices)} devices ({', '.join(devices)}) and no device "
                         f"column; record one device's runs (a store of that card, or without --merge), or give the "
                         f"table a device column and add it to harness/report.py DEVICE_TABLES")


def _card_order(label: str):
    """Cards in a table: the H200 (whose figures the issues' targets name) first, then the others by name."""
    return (0 if label == "H200" else 1, label)


def device_label(df: pd.DataFrame) -> pd.Series:
    """Each run's card as a short label ("H200", "H100 80GB HBM3"); "?" where a run did not log one."""
    dev = df[DEVICE_KEY] if DEVICE_KEY in df else pd.Series(None, index=df.index, dtype=object)
    return dev.fillna("?").astype(str).str.removeprefix("NVIDIA ")


def atomic_write(path: Path, write) -> Path:
    """write(temporary path), then rename it over `path`: a reader or an interruption never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def dropped_runs(name: str, df: pd.DataFrame) -> list[str]:
    """The run ids experiments/<name>/runs.csv holds that writing df in its place would drop."""
    recorded = runs_from_csv(name)
    if recorded.empty or "run_id" not in recorded:
        return []
    keep = set(df["run_id"].astype(str)) if "run_id" in df else set()
    return [r for r in recorded["run_id"].astype(str) if r not in keep]


def record_csv(name: str, df: pd.DataFrame, replace: bool = False) -> Path:
    """Write df as experiments/<name>/runs.csv; refused (ValueError) when that would drop recorded runs, unless
    replace."""
    gone = dropped_runs(name, df)
    if gone and not replace:
        raise ValueError(f"recording {name} would drop {len(gone)} of the {len(runs_from_csv(name))} runs in "
                         f"experiments/{name}/runs.csv (first: {', '.join(gone[:3])}); add --merge to replace only "
                         "the rows the new runs re-measure, or --replace to drop them")
    keep = [c for c in df.columns
            if c.startswith(("params.", "metrics.", "tags.")) or c in ("run_id", "start_time", "status")]
    return atomic_write(EXPERIMENTS / name / "runs.csv",
                        lambda tmp: df[keep].sort_values("start_time").to_csv(tmp, index=False))


def num(df: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(df[col], errors="coerce")


def provenance(df: pd.DataFrame) -> str:
    def uniq(col: str) -> str:
        return ", ".join(sorted(df[col].dropna().astype(str).unique())) if col in df else "?"

    commits = (", ".join(c[:10] for c in sorted(df["tags.git_commit"].dropna().unique()))
               if "tags.git_commit" in df else "?")
    dirty = " (uncommitted changes)" if "tags.git_dirty" in df and (df["tags.git_dirty"] == "true").any() else ""
    # kernel micro-benchmarks run no workload: say nothing rather than "workload ?"
    workload = f"workload {uniq('tags.workload_hash')}; " if "tags.workload_hash" in df else ""
    return (f"Device: {uniq('tags.device')}; torch {uniq('tags.torch_version')}, "
            f"triton {uniq('tags.triton_version')}; commit {commits}{dirty}; {workload}{len(df)} runs.")


def _start(df: pd.DataFrame) -> pd.Series:
    """Each run's start time as text (sorts in time order); "" where the frame has none."""
    return df["start_time"].astype(str) if "start_time" in df else pd.Series("", index=df.index)


def recorded_on(df: pd.DataFrame) -> str:
    """The one line under a report's title: the card(s) and commit(s) of its rows, saying so plainly when there is
    more than one of either (cards by row count, commits oldest first)."""
    n = len(df)
    dev = df[DEVICE_KEY].fillna("an unrecorded card").astype(str) if DEVICE_KEY in df else pd.Series(
        "an unrecorded card", index=df.index)
    counts = dev.value_counts()
    commit = (df["tags.git_commit"].astype(str).str[:7].where(df["tags.git_commit"].notna(), "unrecorded")
              if "tags.git_commit" in df else pd.Series("unrecorded", index=df.index))
    commits = list(pd.DataFrame({"c": commit, "t": _start(df)}).sort_values("t", kind="stable")
                   .drop_duplicates("c")["c"])
    dirty = " with uncommitted changes" if "tags.git_dirty" in df and (df["tags.git_dirty"] == "true").any() else ""
    if len(counts) == 1:
        cards = f"**{counts.index[0]}**"
    else:
        cards = f"**{len(counts)} cards**: " + ", ".join(f"{d} ({c} rows)" for d, c in counts.items())
    at = f"commit **{commits[0]}**" if len(commits) == 1 else f"**{len(commits)} commits**: " + ", ".join(commits)
    several = [w for w, k in (("card", len(counts)), ("commit", len(commits))) if k > 1]
    plain = (f"one card, one commit, {n} rows" if not several else
             f"{n} rows from more than one {' and more than one '.join(several)}"
             + ("; compare figures of one card" if len(counts) > 1 else ""))
    return f"Recorded on {cards} at {at}{dirty} ({plain})."


def check(ok: pd.Series) -> pd.Series:
    return ok.map(lambda v: "✓" if v == 1 else "✗")


def _md(d: pd.DataFrame, floatfmt: Sequence[str] | dict[str, str]) -> str:
    """A frame as a markdown table, each numeric column in its format (a tuple in column order, or a dict by column
    name, "" for the rest); missing values read "—"."""
    if isinstance(floatfmt, dict):
        floatfmt = tuple(floatfmt.get(c, "") for c in d.columns)
    return d.to_markdown(index=False, floatfmt=floatfmt).replace("nan%", "—").replace("nan", "—")


def _cell(v, fmt: str, ok: bool = True) -> str:
    """One formatted figure ("—" where missing), marked ✗ where its run did not verify."""
    text = "—" if v is None or pd.isna(v) else f"{v:{fmt}}"
    return text if ok else f"{text} ✗"


def _grid(d: pd.DataFrame, left: int = 1) -> str:
    """A frame of formatted text cells as markdown: the first `left` columns (labels) left-aligned, the figures
    right-aligned, no cell re-parsed as a number."""
    align = ["left"] * left + ["right"] * (len(d.columns) - left)
    return d.fillna("—").to_markdown(index=False, disable_numparse=True, colalign=align)


def _md_cells(d: pd.DataFrame, fmts: dict[str, str]) -> str:
    """A frame as markdown where some figures are text already (a time with its spread): each column of `fmts` a
    figure in its format ("" for text made already; "—" where missing), right-aligned; the others labels, left."""
    cells = {c: d[c].map(lambda v, f=fmts[c]: v if isinstance(v, str) else _cell(v, f)) if c in fmts
             else d[c].fillna("—").astype(str) for c in d.columns}
    return pd.DataFrame(cells).to_markdown(index=False, disable_numparse=True,
                                           colalign=["right" if c in fmts else "left" for c in d.columns])


def _newest(d: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The newest row whole (column _start) of each key: groupby().last() would take each column's last non-null
    value, mixing rows."""
    return d.sort_values("_start", kind="stable").drop_duplicates(keys, keep="last")


def _by_b(d: pd.DataFrame, keys: list[str], value: str, fmt: str, bs: Sequence[int], name: str = "B = {}",
          ok: str | None = "verified") -> pd.DataFrame:
    """One row per key, a column per B in bs: the newest row's `value` at that B, ✗ where it did not verify (column
    `ok`; None: no marks), "—" where none was recorded. d needs the columns keys, "B", value, ok and _start."""
    n = _newest(d, [*keys, "B"])
    marks = n[ok] == "✓" if ok else pd.Series(True, index=n.index)
    n = n.assign(_cell=[_cell(v, fmt, o) for v, o in zip(n[value], marks)])
    t = n.set_index([*keys, "B"])["_cell"].unstack("B")
    t = t.reindex(columns=list(bs)).astype(object)
    t = t.where(t.notna(), "—")
    t.columns = [name.format(b) for b in bs]
    return t.reset_index()


def _columns(md: str) -> int:
    """How many columns the first markdown table in md has."""
    head = next((line for line in md.splitlines() if line.startswith("|")), "")
    return max(len(head.split("|")) - 2, 0)


def _report(headline: str, rows: str, note: str = "", standing: str = "") -> str:
    """A table's markdown: the headline (at most HEADLINE_MAX_COLUMNS columns, one row per configuration that
    matters), where the targets stand where a table has targets, then every recorded row."""
    if _columns(headline) > HEADLINE_MAX_COLUMNS:
        raise ValueError(f"a headline table has {_columns(headline)} columns; at most {HEADLINE_MAX_COLUMNS} read at "
                         f"a glance (the rest belong in '{ROWS[4:]}')")
    parts = [HEADLINE, ""] + ([note, ""] if note else []) + [headline, ""]
    if standing:
        parts += [TARGETS, "", standing, ""]
    return "\n".join(parts + [ROWS, "", rows])


NEWEST_NOTE = "Each cell: the newest recorded row of its configuration at that B (✗: that row did not verify)."


# a speed-up over the single stream above B by more than this reads as a measurement fault, not as batching
SPEEDUP_MARGIN = 0.05
FLAGS_NOTE = ("Spread: the 10th-90th percentile of the timed repeats (— for runs recorded before repeats). Flags: "
              "noisy (the noise guard saw contention or a spread above its threshold while the run measured; the "
              "reason is the run's tag noise_reason), and a speed-up above B x the single-stream rate, which batching "
              f"cannot give (more than {SPEEDUP_MARGIN:.0%} above B: a disturbed measurement).")


def spread_cell(df: pd.DataFrame, metric: str, fmt: str = ",.1f") -> pd.Series:
    """Each run's p10-p90 of a metric over its repeats as text ("—" where the run has no repeats)."""
    lo, hi = _opt(df, f"metrics.{metric}_p10"), _opt(df, f"metrics.{metric}_p90")
    return pd.Series([f"{a:{fmt}}-{b:{fmt}}" if pd.notna(a) and pd.notna(b) else "—" for a, b in zip(lo, hi)],
                     index=df.index)


def with_cv(df: pd.DataFrame, metric: str, fmt: str) -> pd.Series:
    """Each run's figure as text with its spread over its repeats beside it, as the coefficient of variation ("17.6
    ±0.4%"); the figure alone for a run recorded before repeats; "—" for a run without it."""
    return _pm(_opt(df, f"metrics.{metric}"), _opt(df, f"metrics.{metric}_cv"), fmt)


def _pm(v: pd.Series, cv: pd.Series, fmt: str) -> pd.Series:
    return pd.Series([_cell(a, fmt) + (f" ±{c:.1%}" if pd.notna(a) and pd.notna(c) else "") for a, c in zip(v, cv)],
                     index=v.index)


CV_NOTE = ("Times: the median of the timed repeats, ± their spread (std / mean; none for runs recorded before "
           "repeats). The appendix flags the runs the noise guard marked noisy.")


def flags(df: pd.DataFrame) -> pd.Series:
    """What a reader must know before trusting a row: noisy (with the guard's first reason), or a speed-up above
    B x the single-stream rate."""
    noisy = _tag(df, "tags.noisy") == "true"
    reason = _tag(df, "tags.noise_reason").str.split("; ").str[0]
    B, speedup = num(df, "params.batch.size"), _opt(df, "metrics.speedup_vs_single")
    above = speedup > B * (1 + SPEEDUP_MARGIN)
    out = []
    for i in df.index:
        f = [f"noisy: {reason[i]}" if reason[i] != "—" else "noisy"] if noisy[i] else []
        if above[i]:
            f.append(f"speed-up {speedup[i]:.2f}x above B = {B[i]:.0f}")
        out.append("; ".join(f) or "—")
    return pd.Series(out, index=df.index)


@table("static_batching", "Aggregate decode throughput of B copies of one prompt decoded in lockstep by the CPU "
                          "reference engine (SmolLM2-135M), against the single stream, every stream checked "
                          "against it.")
def static_batching(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "p10-p90": spread_cell(df, "throughput_tok_s"),
        "vs single-stream": num(df, "metrics.speedup_vs_single"),
        "per-stream tok/s": num(df, "metrics.per_stream_tok_s"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "verified": check(num(df, "metrics.verify_ok")),
        "flags": flags(df),
    }).sort_values("B")
    md = _md(d, {"B": ".0f", "aggregate tok/s": ",.1f", "vs single-stream": ".2f", "per-stream tok/s": ",.1f",
                 "per-step latency (ms, p50)": ".2f"})
    # eight columns: the headline is the whole table
    order = d.index
    band = (d["B"], _opt(df, "metrics.throughput_tok_s_p10")[order], _opt(df, "metrics.throughput_tok_s_p90")[order])
    return _report(md, md, note=FLAGS_NOTE), _plot(d["B"], d["aggregate tok/s"], "B (slots)", "aggregate tok/s",
                                                   "Static batching", band=band)


@table("divergent_streams", "Whether B slots sampled at temperature 0.7, each with its own seeded generator, give B "
                            "distinct streams (independent per-slot KV), and at what throughput.")
def divergent_streams(df: pd.DataFrame):
    B = num(df, "params.batch.size").astype(int).astype(str)
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "temperature": num(df, "params.sampling.temperature"),
        "distinct streams": num(df, "metrics.distinct_streams").astype(int).astype(str) + " / " + B,
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values("B")
    md = d.to_markdown(index=False, floatfmt=(".0f", ".2f", "", ",.1f", ""))
    return _report(md, md), None


def _opt(df: pd.DataFrame, col: str) -> pd.Series:
    return num(df, col) if col in df else pd.Series([float("nan")] * len(df), index=df.index)


@table("static_scaling", "Aggregate decode throughput of B lockstep streams on the GPU (Llama-3.2-1B shapes, "
                         "Triton kernels, CUDA graphs) against the single stream, the step's byte floor and HF "
                         "transformers' static-cache generate.")
def static_scaling(df: pd.DataFrame):
    d = pd.DataFrame({
        "card": device_label(df),
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "vs single-stream": num(df, "metrics.speedup_vs_single"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "step floor (ms)": _opt(df, "metrics.step_floor_ms"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "HF static tok/s": _opt(df, "metrics.peer_tok_s"),
        "vs HF": _opt(df, "metrics.speedup_vs_peer"),
        "verified": check(num(df, "metrics.verify_ok")),
        "p10-p90": spread_cell(df, "throughput_tok_s", ",.0f"),
        "J/token": _opt(df, "metrics.joules_per_token"),   # NVML's energy counter over the timed batches
        "flags": flags(df),
    }).sort_values(["card", "B"], key=lambda c: c.map(_card_order) if c.name == "card" else c)
    md = _md(d, ("", ".0f", ",.0f", ".1f", ".3f", ".3f", ".0%", ",.0f", ".2f", "", "", ".4f", ""))
    head = _newest(d.assign(_start=_start(df)), ["card", "B"]).sort_values(
        ["card", "B"], key=lambda c: c.map(_card_order) if c.name == "card" else c)
    head = head[["card", "B", "aggregate tok/s", "vs single-stream", "per-step latency (ms, p50)", "floor reached",
                 "vs HF", "verified"]].rename(columns={"vs single-stream": "x single stream",
                                                       "per-step latency (ms, p50)": "per-step ms (p50)",
                                                       "vs HF": "x HF static"})
    headline = _md(head, ("", ".0f", ",.0f", ".1f", ".3f", ".0%", ".2f", ""))
    curves = {}
    for card, g in head.groupby("card", sort=False):
        x = g["B"]
        curves[f"onepass, {card}"] = (x, g["aggregate tok/s"])
    first = head[head["card"] == head["card"].iloc[0]]
    hf = d[d["card"] == head["card"].iloc[0]]
    curves[f"HF transformers, static cache, {head['card'].iloc[0]}"] = (hf["B"][hf["HF static tok/s"].notna()],
                                                                        hf["HF static tok/s"].dropna())
    curves["linear in B from B = 1"] = (first["B"], first["aggregate tok/s"].iloc[0] * first["B"] / first["B"].iloc[0])
    fig = _curves(curves, "B (slots)", "aggregate tok/s", "Static batching, Llama-3.2-1B shapes", logy=True,
                  styles={"linear in B from B = 1": ":"})
    return _report(headline, md), fig


@table("across_models", "Single-stream and largest-batch decode throughput of three model shapes (Llama-3.2-1B, "
                        "Qwen3-1.7B, Qwen3-4B) on one card.")
def across_models(df: pd.DataFrame):
    d = pd.DataFrame({
        "model": df["params.model.name"],
        "B": num(df, "params.batch.size").astype(int),
        "aggregate tok/s": num(df, "metrics.throughput_tok_s"),
        "vs single-stream": num(df, "metrics.speedup_vs_single"),
        "per-step latency (ms, p50)": num(df, "metrics.step_ms_p50"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "verified": check(num(df, "metrics.verify_ok")),
        "J/token": _opt(df, "metrics.joules_per_token"),
        "flags": flags(df),
    }).sort_values(["model", "B"])
    md = _md(d, ("", ".0f", ",.0f", ".1f", ".3f", ".0%", "", ".4f", ""))
    n = _newest(d.assign(_start=_start(df)), ["model", "B"])
    rows = []
    for model, g in n.groupby("model", sort=True):
        one, big = g.loc[g["B"].idxmin()], g.loc[g["B"].idxmax()]
        rows.append({"model": model, "single stream tok/s": _cell(one["aggregate tok/s"], ",.0f",
                                                                  one["verified"] == "✓"),
                     "batched B": f"{big['B']}", "batched tok/s": _cell(big["aggregate tok/s"], ",.0f"),
                     "x single stream": _cell(big["vs single-stream"], ".1f"),
                     "per-step ms (p50)": _cell(big["per-step latency (ms, p50)"], ".3f"),
                     "floor reached": _cell(big["floor reached"], ".0%"),
                     "verified": "✓" if (g["verified"] == "✓").all() else "✗"})
    return _report(_grid(pd.DataFrame(rows)), md, note="Batched: the largest B recorded for the model."), None


@table("graphs_backends", "What each engine piece buys at B = 1 and 128: CUDA graphs, the Triton kernels, the Triton "
                          "GEMM against cuBLAS, and the unfused torch model, with which keep every stream bit-exact.")
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
    md = _md(d, ("", ".0f", ",.0f", ".3f", ".0%", ""))
    h, bs = d.assign(_start=_start(df)), sorted({d["B"].min(), d["B"].max()})
    t = _by_b(h, ["engine"], "aggregate tok/s", ",.0f", bs, "tok/s, B = {}")
    for value, fmt, name in (("per-step latency (ms, p50)", ".3f", "per-step ms, B = {}"),
                             ("floor reached", ".0%", "floor reached, B = {}")):
        t = t.merge(_by_b(h, ["engine"], value, fmt, bs[-1:], name, ok=None), on="engine")
    order = h.sort_values("aggregate tok/s", ascending=False).drop_duplicates("engine")["engine"]
    t = t.set_index("engine").loc[list(order)].reset_index()
    return _report(_grid(t), md, note=NEWEST_NOTE), None


LATENCY_PHASES = ("qkv", "attn", "o", "ffn", "down")


@table("latency", "Small batches at the memory floor: the persistent decode step (every layer in one kernel) against "
                  "the kernel-per-op step of the same engine in the same job, with the step's byte floor and HF "
                  "transformers' static cache.")
def latency(df: pd.DataFrame):
    d = pd.DataFrame({
        "card": device_label(df),
        "model": df["params.model.name"],
        "weights": df["params.engine.weights"],
        "step": [f"{step} ({form})" if isinstance(form, str) and form and step != "kernels" else step
                 for step, form in zip(df["params.engine.step"], df.get("params.engine.persistent_form",
                                                                        pd.Series("", index=df.index)))],
        "B": num(df, "params.batch.size").astype(int),
        "step ms": num(df, "metrics.step_ms_p50"),
        "tok/s": num(df, "metrics.throughput_tok_s"),
        "floor ms": _opt(df, "metrics.step_floor_ms"),
        "floor reached": _opt(df, "metrics.floor_frac"),
        "kernel-per-op ms": _opt(df, "metrics.kernels_step_ms_p50"),
        "x kernel-per-op": _opt(df, "metrics.speedup_vs_kernels"),
        "tokens agree": _opt(df, "metrics.kernels_agree"),
        # a pick without the two forms' times was not measured (the persistent form could not be built, or, in rows
        # recorded before auto measured a static batch's lockstep rows, it never timed them) and is auto's fallback
        "auto picked": [("persistent" if v else "kernel-per-op") + ("" if pd.notna(us) else " (not measured)")
                        if pd.notna(v) else "—"
                        for v, us in zip(_opt(df, "metrics.step_picked_persistent"),
                                         _opt(df, "metrics.pick_kernels_us"))],
        "HF static tok/s": _opt(df, "metrics.peer_tok_s"),
        "verified": check(num(df, "metrics.verify_ok")),
        "flags": flags(df),
    }).sort_values(["card", "model", "weights", "step", "B"],
                   key=lambda c: c.map(_card_order) if c.name == "card" else c)
    md = _md(d, {"step ms": ".3f", "tok/s": ",.0f", "floor ms": ".3f", "floor reached": ".0%",
                 "kernel-per-op ms": ".3f", "x kernel-per-op": ".2f", "tokens agree": ".0%", "HF static tok/s": ",.0f"})
    n = _newest(d.assign(_start=_start(df)), ["card", "model", "weights", "step", "B"])
    # the headline: of each card, model, weights and B the newest row, whichever step form it ran (older forms stay
    # in the rows below)
    h = _newest(n, ["card", "model", "weights", "B"]).sort_values(
        ["card", "model", "weights", "B"], key=lambda c: c.map(_card_order) if c.name == "card" else c)
    took = [("persistent" if step.startswith("persistent") else "kernel-per-op" if step == "kernels" else picked)
            for step, picked in zip(h["step"], h["auto picked"])]
    head = h.assign(model=h["model"] + " (" + h["weights"] + ", " + h["step"] + ")", **{"step taken": took})[
        ["card", "model", "B", "step ms", "floor reached", "x kernel-per-op", "step taken", "verified"]]
    headline = _md(head, {"step ms": ".3f", "floor reached": ".0%", "x kernel-per-op": ".2f"})
    ones_h = h[h["B"] == 1].set_index(["model", "weights"])
    rates = "; ".join(f"{m} {w} {r['tok/s']:,.0f} on the {r['card']} (target {t:,} on the H200)"
                      for (m, w), t in LATENCY_TOKS_TARGETS.items() if (m, w) in ones_h.index
                      for _, r in ones_h.loc[[(m, w)]].iterrows())
    have = set(zip(d["model"], d["weights"], d["B"]))
    missing = {(m, w): [b for b in LATENCY_BATCHES if (m, w, b) not in have] for m, w in LATENCY_ROWS}
    # where the targets stand, and where a persistent step's time goes: each phase summed over the layers against its
    # bytes' floor
    # of each card, model, weights and B the newest row whose step ran the persistent kernel (set so, or auto's
    # pick): a newer run of some B only leaves the other B's rows standing
    ran = n["step"].str.startswith("persistent") | (n["auto picked"] == "persistent")
    newest = _newest(n[ran], ["card", "model", "weights", "B"])
    ones = newest[(newest["B"] == 1) & (newest["weights"] == "dequant")].sort_values(["card", "model"])
    standing = ("Targets (issue 61): at B = 1 a dense bf16 model's persistent step reaches >= "
                f"{LATENCY_FLOOR_TARGET:.0%} of its floor (the H200 figure; the same fraction on other cards), and no "
                "row that runs the persistent step is slower than the kernel-per-op step. Of the newest rows: "
                + "; ".join(f"{r['model']} on the {r['card']}: {_cell(r['floor reached'], '.0%')} of the floor at B = 1"
                            for _, r in ones.iterrows())
                + "; rows that ran the persistent step slower than the kernel-per-op step: "
                + f"{int((newest['x kernel-per-op'] < 1).sum())} of {len(newest)}. B = 1 tok/s against the issue's "
                f"rates: {rates or 'none recorded'}. Of the issue's rows, not recorded "
                "on any card yet: " + ("; ".join(f"{m} {w} at B = {', '.join(map(str, bs))}"
                                                 for (m, w), bs in missing.items() if bs) or "none") + ".")
    phases = [c for p in LATENCY_PHASES for c in (f"metrics.phase_{p}_us", f"metrics.phase_{p}_floor_us")]
    if all(c in df for c in phases):
        def cell(us, floor, sync):
            """A phase's time (its floor), and its barrier's part where the run recorded it."""
            if pd.isna(us):
                return "—"
            return f"{us:,.0f} ({floor:,.0f}" + (f"; barrier {round(sync):,})" if pd.notna(sync) else ")")

        nan = pd.Series(float("nan"), index=df.index)
        pt = pd.DataFrame({"card": d["card"], "model": d["model"], "weights": d["weights"], "B": d["B"],
                           "_start": _start(df),
                           **{f"{p} us (floor)": [cell(*t) for t in zip(
                               num(df, f"metrics.phase_{p}_us"), num(df, f"metrics.phase_{p}_floor_us"),
                               num(df, f"metrics.phase_{p}_sync_us") if f"metrics.phase_{p}_sync_us" in df else nan)]
                              for p in LATENCY_PHASES}})
        pt = _newest(pt, ["card", "model", "weights", "B"]).drop(columns="_start")
        cells = [f"{p} us (floor)" for p in LATENCY_PHASES]
        pt = pt[(pt[cells] != "—").any(axis=1)].sort_values(       # the rows whose newest run ran the persistent step
            ["card", "model", "weights", "B"], key=lambda c: c.map(_card_order) if c.name == "card" else c)
        standing += ("\n\nPer phase of the persistent step (one more launch after the timed runs, program 0's clock "
                     "at each grid barrier; a phase's time includes its barrier wait), summed over the layers, against "
                     "the bytes the phase must read at the card's copy rate, and where the run recorded it, the "
                     "barrier's own part (from the last program's arrival to the opening):\n\n" + _grid(pt, left=3))
    return _report(headline, md, note=LATENCY_NOTE, standing=standing), None


LATENCY_FLOOR_TARGET = 0.81
# the rows issue 61's benchmark asks for: (model, weights) at every B of LATENCY_BATCHES
LATENCY_ROWS = (("smollm2-135m", "packed"), ("smollm2-135m", "dequant"), ("llama-3.2-1b", "dequant"),
                ("llama-3.2-1b-q4_0", "packed"), ("llama-3.2-1b-q8_0", "packed"), ("qwen3-1.7b", "dequant"),
                ("qwen3.8-27b", "packed"))
LATENCY_BATCHES = (1, 2, 4, 8, 16)
# its B = 1 rates on the H200 (tok/s): on another card its rows are shown beside them, not judged
LATENCY_TOKS_TARGETS = {("llama-3.2-1b", "dequant"): 1400, ("llama-3.2-1b-q4_0", "packed"): 3000,
                        ("smollm2-135m", "packed"): 5000, ("qwen3.8-27b", "packed"): 230}
LATENCY_NOTE = ("Each row: the newest recorded row of its card, model, weights and B, whichever step form it ran "
                "(older forms are in the rows below; ✗: that row did not verify). Step taken: the step form the "
                "batch ran (auto's pick, or the one set).")


@table("projection_crossover", "One batched GEMM of B rows against B single-row GEMMs on one projection (Llama-3.2-1B "
                               "gate|up), where the speed-up stops growing with B (the weights stop being the "
                               "bottleneck).")
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
    head = d[["B", "batched GEMM (us)", "cuBLAS (us)", "aggregate speedup", "TFLOP/s", "weights TB/s",
              "rows bit-exact"]].rename(columns={"aggregate speedup": "x B single-row GEMMs"})
    headline = _md(head, (".0f", ".1f", ".1f", ".1f", ".0f", ".2f", ""))
    fig = _plot(d["B"], d["aggregate speedup"], "B (tokens)", "speedup vs B single-token GEMMs", "Projection crossover")
    return _report(headline, md), fig


@table("decode_attention", "Per-slot decode attention: B slots, each over its own KV cache, in one launch against "
                           "one slot alone, with each slot's output checked bit-exact.")
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
    md = d.to_markdown(index=False, floatfmt=(".0f", ".1f", ".1f", ".1f", ".2f", ".1e", ""))
    head = d.drop(columns="max |err|").rename(columns={"aggregate speedup": "x B one-slot calls"})
    return _report(_md(head, (".0f", ".1f", ".1f", ".1f", ".2f", "")), md), None


def _tag(df: pd.DataFrame, col: str) -> pd.Series:
    return df[col].fillna("—") if col in df else pd.Series(["—"] * len(df), index=df.index)


def _shape(df: pd.DataFrame, sep: str = "x") -> pd.Series:
    """N x K of each int4_gemm row."""
    return (num(df, "params.micro.n").astype("Int64").astype(str) + sep
            + num(df, "params.micro.k").astype("Int64").astype(str))


# the headline's B of int4_gemm (the targets' B = 1 and 16, and the largest recorded) and its formats' order
INT4_HEADLINE_B = (1, 16, 128)
INT4_FORMATS = ("q4_0", "q4_k", "q8_0", "q4_1")


@table("int4_gemm", "Time per call of the int4 / int8 (W4A16) projection kernels against bf16 cuBLAS and dequantize "
                    "+ cuBLAS, per weight shape, GGUF format and B, with the kernel the dispatch picks.")
def int4_gemm(df: pd.DataFrame):
    times = {"Triton (us)": "triton", "CUDA (us)": "cuda", "CUDA mma (us)": "cuda_mma",
             "mma folded (us)": "cuda_mma_fold", "folded lat (us)": "cuda_mma_fold_lat", "wgmma (us)": "cuda_wgmma",
             "wgmma x2 (us)": "cuda_wgmma_x2", "wgmma ws (us)": "cuda_wgmma_ws", "ws t128 (us)": "cuda_wgmma_ws_t128",
             "dequant + cuBLAS (us)": "dequant_cublas", "bf16 cuBLAS (us)": "bf16"}
    d = pd.DataFrame({
        "N x K": _shape(df, " x "),
        "format": df["params.micro.fmt"],
        "B": num(df, "params.batch.size").astype(int),
        **{col: with_cv(df, f"{v}_us", ".1f") for col, v in times.items()},   # each time with its spread
        "picked": _tag(df, "tags.int4_pick"),
        "effective TB/s": _opt(df, "metrics.effective_tbps"),
        "vs bf16": _opt(df, "metrics.speedup_vs_bf16"),
        "fastest": _tag(df, "tags.int4_best"),
        "PDL": _pdl(df),   # the int4 kernels' launches (harness/int4_bench.py); cuBLAS's never use it
        "verified": check(num(df, "metrics.verify_ok")),
        "flags": flags(df),
    })
    d["_n"] = num(df, "params.micro.n")
    d["_k"] = num(df, "params.micro.k")
    d = d.sort_values(["format", "_n", "_k", "B"], ascending=[True, False, True, True]).drop(columns=["_n", "_k"])
    md = _md_cells(d, {"B": ".0f", **dict.fromkeys(times, ""), "effective TB/s": ".2f", "vs bf16": ".2f"})
    # the headline: the picked kernel's time (with its spread) and bf16 cuBLAS's time over it, per shape and format
    # at a few B
    picked = _opt(df, "metrics.picked_us").fillna(_opt(df, "metrics.bf16_us") / _opt(df, "metrics.speedup_vs_bf16"))
    h = pd.DataFrame({"shape": _shape(df), "format": df["params.micro.fmt"], "B": num(df, "params.batch.size"),
                      "us": _pm(picked, _opt(df, "metrics.picked_us_cv"), ".1f"),
                      "vs": _opt(df, "metrics.speedup_vs_bf16"), "verified": d["verified"],
                      "_start": _start(df), "_size": num(df, "params.micro.n") * num(df, "params.micro.k")})
    t = _by_b(h, ["shape", "format", "_size"], "us", "", INT4_HEADLINE_B, "B = {}: us", ok=None).merge(
        _by_b(h, ["shape", "format", "_size"], "vs", ".2f", INT4_HEADLINE_B, "B = {}: x bf16"),
        on=["shape", "format", "_size"])
    rank = {s: i for i, s in enumerate(INT4_LARGE)}
    t = t.assign(_f=t["format"].map(lambda f: INT4_FORMATS.index(f) if f in INT4_FORMATS else len(INT4_FORMATS)),
                 _r=t["shape"].map(lambda s: rank.get(s, len(rank))))
    t = t.sort_values(["_f", "_r", "_size"], ascending=[True, True, False])
    cols = ["shape", "format"] + [f"B = {b}: {w}" for b in INT4_HEADLINE_B for w in ("us", "x bf16")]
    t = t[cols].rename(columns={"shape": "N x K"}).assign(format=lambda x: x["format"].str.upper())
    note = ("The kernel the dispatch picks (policy \"fastest\"; its name and every kernel's time: the appendix): its "
            "time per call, and bf16 cuBLAS's time over it. The targets' shapes first. "
            + NEWEST_NOTE.replace("configuration", "shape and format").replace("that row", "a kernel of that row")
            + " " + CV_NOTE)
    fig = None
    big = h[h["shape"].isin(INT4_LARGE)]
    if not big.empty:
        n = _newest(big, ["shape", "format", "B"]).sort_values("B")
        curves = {f"{s} {f.upper()}": (g["B"], g["vs"]) for (f, s), g in
                  sorted(n.groupby(["format", "shape"]), key=lambda kv: (INT4_FORMATS.index(kv[0][0])
                                                                         if kv[0][0] in INT4_FORMATS else 9, kv[0][1]))}
        fig = _curves(curves, "B (rows)", "bf16 cuBLAS time / picked kernel time",
                      "Picked int4 kernel vs bf16 cuBLAS, the targets' shapes", hline=(1.0, "bf16 cuBLAS"),
                      styles={k: "--" for k in curves if not k.endswith("Q4_0")})
    return _report(_grid(t, left=2), md, note=note, standing=int4_gemm_standing(df)), fig


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
    shape = _shape(df)
    newest = ~pd.DataFrame({"s": shape, "f": df["params.micro.fmt"], "b": df["params.batch.size"]}).duplicated(
        keep="last")
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
    # every int4 kernel (dequant + cuBLAS is the last variant)
    from onepass.kernels.int4_dispatch import INVARIANT_VARIANTS

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




@table("int4_e2e", "End-to-end static batching with the projections kept quantized (packed Q4_0 / Q4_1 / Q8_0) "
                   "against the same file dequantized to bf16 at load, per model and B.")
def int4_e2e(df: pd.DataFrame):
    d = pd.DataFrame({
        "card": device_label(df),
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
    }).sort_values(["card", "model", "B", "weights", "PDL"], ascending=[True, True, True, False, True])
    md = _md(d, ("", "", "", "", ".0f", ",.0f", ".3f", ",.0f", ",.0f", ",.0f", ".1f", ".0%", ""))
    h = d.assign(_start=_start(df))
    bs = [b for b in (1, 32, 128) if b in set(d["B"])] or sorted(set(d["B"]))[:3]
    t = _by_b(h, ["card", "model", "weights"], "aggregate tok/s", ",.0f", bs, "tok/s, B = {}")
    size = _newest(h, ["card", "model", "weights"]).set_index(["card", "model", "weights"])
    for col in ("weights on GPU (MiB)", "GGUF file (MiB)"):
        t[col] = [_cell(size.loc[(c, m, w), col], ",.0f") for c, m, w in zip(t["card"], t["model"], t["weights"])]
    t = t.assign(_w=t["weights"] != "packed", _c=t["card"].map(_card_order)).sort_values(
        ["_c", "model", "_w"]).drop(columns=["_w", "_c"])
    note = ("Aggregate tok/s. Packed: the projections kept quantized; dequant: the same file as bf16. "
            + NEWEST_NOTE + " Each row's PDL setting: the appendix.")
    return _report(_grid(t, left=3), md, note=note), None


@table("gdn_step", "The fused Gated DeltaNet decode step on one Qwen3.8-27B layer against flash-linear-attention, "
                   "and against the floor of reading and writing every slot's recurrent state once.")
def gdn_step(df: pd.DataFrame):
    d = pd.DataFrame({
        "B": num(df, "params.batch.size").astype(int),
        "ours (us/layer)": with_cv(df, "our_us", ".1f"),   # each time with its spread over the repeats
        "FLA (us/layer)": with_cv(df, "fla_us", ".1f"),
        "vs FLA": _opt(df, "metrics.speedup"),
        "state floor (us)": num(df, "metrics.floor_us"),
        "floor reached": num(df, "metrics.floor_frac"),
        "ours, bf16 state (us)": with_cv(df, "our_bf16_us", ".1f"),
        "max rel err": num(df, "metrics.max_err"),
        "FLA max rel err": _opt(df, "metrics.fla_max_err"),
        "verified": check(num(df, "metrics.verify_ok")),
        "flags": flags(df),
    }).sort_values("B")
    fmts = {"B": ".0f", "ours (us/layer)": "", "FLA (us/layer)": "", "vs FLA": ".2f", "state floor (us)": ".1f",
            "floor reached": ".0%", "ours, bf16 state (us)": "", "max rel err": ".1e", "FLA max rel err": ".1e"}
    head = d.drop(columns=["max rel err", "FLA max rel err", "flags"]).rename(columns={"vs FLA": "x FLA"})
    return _report(_md_cells(head, {**fmts, "x FLA": ".2f"}), _md_cells(d, fmts), note=CV_NOTE), None


@table("hybrid_27b", "Batched decode of the hybrid Qwen3.8-27B shapes (48 Gated DeltaNet + 16 attention layers) with "
                     "Q4 weights kept packed or dequantized to bf16, fp32 or bf16 recurrent state, static or "
                     "continuous, against the H200 targets.")
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
    d = d.sort_values(["_target_card", "device", "weights", "type", "state", "write-back", "mode", "PDL",
                       "Q4_K scales", "B"],
                      ascending=[True, True, False, False, False, True, False, True, False, True])
    d = d.drop(columns="_target_card")
    standing = hybrid_27b_standing(d.assign(_start=_start(df)))
    md = _md(d, ("", "", "", "", "", ".0f", "", "", "", ".0f", ",.0f", ".2f", ".2f", ".0%", ",.1f", ".0%", ".1e", "",
                 ".0f"))
    # the headline: per card and configuration (weights, block type, state, mode) the newest row at the targets' B;
    # packed rows of the invariant int4 kernels only (the first packed runs tried other kernels: the appendix)
    h = d.assign(_start=_start(df))
    h = h[(h["weights"] != "packed") | (h["int4 kernel"] == "invariant")]
    h = h.assign(type=h["type"].str.upper(), state=h["state"].map({"float32": "fp32", "bfloat16": "bf16"})
                 .fillna(h["state"]))
    keys = ["device", "weights", "type", "state", "mode"]
    bs = sorted(HYBRID_TARGETS)
    t = _by_b(h, keys, "aggregate tok/s", ",.0f", bs, "tok/s, B = {}")
    target = {"device": HYBRID_TARGET_DEVICE, "weights": "**target**", "type": "Q4", "state": "fp32",
              "mode": "static", **{f"tok/s, B = {b}": f"**{HYBRID_TARGETS[b]:,}**" for b in bs}}
    t = t.assign(_card=t["device"] != HYBRID_TARGET_DEVICE, _w=t["weights"] != "packed",
                 _m=t["mode"].map({"static": 0, "continuous": 1}).fillna(2), _s=t["state"] != "fp32",
                 _t=t["type"] != HYBRID_TARGET_TYPE.upper())
    t = t.sort_values(["_card", "device", "_w", "_m", "_s", "_t", "type"]).drop(columns=["_card", "_w", "_m", "_s",
                                                                                         "_t"])
    t = pd.concat([pd.DataFrame([target]), t], ignore_index=True).rename(columns={"device": "card",
                                                                                   "type": "blocks"})
    note = ("Aggregate tok/s. Packed: Q4 blocks kept packed (the invariant int4 kernels); dequant: the same blocks as "
            f"bf16. Target: the {HYBRID_TARGET_DEVICE}'s, static with fp32 state. " + NEWEST_NOTE
            + " Each row's write-back, PDL and scale settings: the appendix.")
    fig = None
    if not h.empty:
        # one colour per configuration, in the headline's order; solid on the targets' card, dashed on another
        n = _newest(h, [*keys, "B"]).sort_values("B")
        colour = {c: f"C{i % 10}" for i, c in enumerate(dict.fromkeys(
            tuple(r) for r in t.loc[1:, ["weights", "blocks", "state", "mode"]].itertuples(index=False)))}
        curves, styles = {}, {}
        for r in t.loc[1:].itertuples(index=False):
            g = n[(n["device"] == r.card) & (n["weights"] == r.weights) & (n["type"] == r.blocks)
                  & (n["state"] == r.state) & (n["mode"] == r.mode)]
            label = f"{r.card}: {r.weights} {r.blocks}, {r.state} state, {r.mode}"
            curves[label] = (g["B"], g["aggregate tok/s"])
            styles[label] = {"color": colour[(r.weights, r.blocks, r.state, r.mode)],
                             "linestyle": "-" if r.card == HYBRID_TARGET_DEVICE else "--"}
        fig = _curves(curves, "B (sequences)", "aggregate tok/s", "Hybrid Qwen3.8-27B shapes: batched decode",
                      styles=styles,
                      points={f"{HYBRID_TARGET_DEVICE} target": (bs, [HYBRID_TARGETS[b] for b in bs])})
    return _report(_grid(t, left=5), md, note=note, standing=standing), fig


def _q4k_scales(df: pd.DataFrame) -> pd.Series:
    """The packed Q4_K rows' engine.ready_scales: "ready" (the GEMMs in batch tiles above 8 sequences read scale words
    made once per weight, kernels/int4_wgmma_ws.py) or "file" (only the file's scales, as every run before the
    setting); "—" for other rows."""
    ready = (df["params.engine.ready_scales"].astype(str) if "params.engine.ready_scales" in df
             else pd.Series("False", index=df.index)).str.lower().eq("true")
    packed = (df["params.engine.weights"].eq("packed") if "params.engine.weights" in df
              else pd.Series(False, index=df.index))
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
    state = d["state"].map(lambda v: ", bf16 state" if v == "bfloat16" else ", fp32 state")
    d["column"] = other_card + d["mode"] + state.where(d["mode"] == "static", "") + d["type"].map(_type_suffix)
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
    kinds = d.loc[d["device"] == HYBRID_TARGET_DEVICE, "type"].unique()
    for kind in sorted(kinds, key=lambda k: k != HYBRID_TARGET_TYPE):
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
SERVING_HEAD_FMT = dict(zip(["steps", "gen tok/s", "requests/s", "slot utilization", "prefill tokens",
                             "peak KV blocks", "KV pool MB", "host ms/step", "GPU ms/step", "correct"], SERVING_FMT))


def _serving_headline(d: pd.DataFrame, base: pd.Series, vs: str, cols: list[str], change: bool = False) -> str:
    """A serving table's headline: its label column, `cols`, and gen tok/s over the baseline row's (`base`, the last
    where several; as a signed change with change=True) in a column `vs` after gen tok/s."""
    tok = d["gen tok/s"]
    ref = tok[base].iloc[-1] if base.any() else float("nan")
    ratio = tok / ref - 1 if change else tok / ref
    label = d.columns[0]
    h = d[[label, *cols]].copy()
    h.insert(h.columns.get_loc("gen tok/s") + 1, vs, ratio)
    return _md(h, {**SERVING_HEAD_FMT, vs: "+.2%" if change else ".2f"})


@table("serving_schedule", "Static waves against continuous batching (a freed slot takes the next request at once) "
                           "on the seed's 512-request workload, every output checked against its single stream.")
def serving_schedule(df: pd.DataFrame):
    d = _serving(df, {"scheduling": df["params.scheduler.mode"] + " / " + df["params.scheduler.prefill"] + " prefill"})
    headline = _serving_headline(d, df["params.scheduler.mode"].eq("wave"), "x wave",
                                 ["steps", "gen tok/s", "requests/s", "slot utilization", "GPU ms/step", "correct"])
    return _report(headline, _md(d, ("",) + SERVING_FMT)), None


@table("serving_paged", "Throughput and KV memory of the contiguous per-slot cache against paged pools of several "
                        "sizes on one continuous workload.")
def serving_paged(df: pd.DataFrame):
    pool = df["params.kv_cache.layout"] + num(df, "metrics.kv_blocks").map(
        lambda b: "" if pd.isna(b) else f", {int(b) - 1}-block pool")
    d = _serving(df, {"KV cache": pool}).sort_values("KV pool MB", ascending=False)
    headline = _serving_headline(d, d["KV cache"].eq("contiguous"), "vs contiguous", [
        "gen tok/s", "KV pool MB", "peak KV blocks", "steps", "slot utilization", "correct"], change=True)
    return _report(headline, _md(d, ("",) + SERVING_FMT)), None


@table("serving_prefix", "Prefix caching on a workload whose prompts share a 48-token prefix: none, the seed's "
                         "pinned prefix, and automatic (hash-chain) caching.")
def serving_prefix(df: pd.DataFrame):
    d = _serving(df, {"prefix cache": df["params.kv_cache.prefix"]})
    headline = _serving_headline(d, d["prefix cache"].eq("off"), "x off", [
        "steps", "gen tok/s", "requests/s", "prefill tokens", "peak KV blocks", "correct"])
    return _report(headline, _md(d, ("",) + SERVING_FMT)), None


# the same columns, for the hybrid model's off / pinned rows
table("serving_prefix_hybrid", "Prefix caching on the hybrid Qwen3.8-27B shapes, where a cached prefix is the "
                               "attention layers' KV blocks plus a snapshot of the GDN layers' recurrent state.")(
    serving_prefix)


@table("serving_sampling", "Host against on-device greedy sampling on the full serving stack: bytes copied to the "
                           "host per step and what they cost in throughput.")
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
    fmt = ("", ",.0f", ".2f", ",.1f", ".2f", ",.0f", ".1f", "")
    head = d.drop(columns="HF continuous tok/s")
    tok = d["gen tok/s"]
    host = tok[d["sampling"].eq("host")]
    head.insert(4, "x host", tok / host.iloc[-1] if len(host) else float("nan"))
    headline = _md(head, ("", ",.0f", ".2f", ",.1f", ".2f", ".2f", ".1f", ""))
    return _report(headline, _md(d, fmt)), None


@table("serving_full", "The full serving stack (continuous, paged, automatic prefix cache, on-device sampling) "
                       "against HF transformers' continuous batching on the same requests in the same job.")
def serving_full(df: pd.DataFrame):
    d = pd.DataFrame({
        "card": device_label(df),
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
    fmt = ("", "", ",.0f", ",.0f", ".1f", ".2f", ".2f", ".0%", ".0%", ",.0f", ".1f", "")
    head = d.drop(columns=["steps", "requests/s", "host ms/step (mean)", "host / GPU"])
    head = head.rename(columns={"vs HF": "x HF"})
    headline = _md(head, ("", "", ",.0f", ".2f", ".0%", ",.0f", ".1f", ""))
    return _report(headline, _md(d, fmt)), None


@table("verified_fresh", "The seed's closing table: Qwen3-1.7B and Qwen3-4B shapes in static batches and "
                         "continuous serving, every stream or request checked against its single-stream reference.")
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
    md = _md(d, ("", "", ",.0f", ",.1f", ".1f", ".1%", ""))
    # seven columns, one row per configuration: the headline is the whole table
    return _report(md, md), None


@table("serving_qwen3", "The serving stack on Qwen3-1.7B shapes: paged KV with the prefix cache off against "
                        "automatic.")
def serving_qwen3(df: pd.DataFrame):
    d = _serving(df, {"Qwen3-1.7B": "paged, prefix " + df["params.kv_cache.prefix"]})
    headline = _serving_headline(d, df["params.kv_cache.prefix"].eq("off"), "x prefix off", [
        "steps", "gen tok/s", "requests/s", "prefill tokens", "peak KV blocks", "correct"])
    return _report(headline, _md(d, ("",) + SERVING_FMT)), None


@table("spec_decode", "Speculative decoding: static batches that feed up to k draft tokens a slot a step and keep "
                      "those the target agrees with, against the same batch without drafts in the same job. "
                      "Scripted drafts set the acceptance (the target's own future tokens, each wrong at the rate "
                      "asked); prompt lookup (ngram) measures it.")
def spec_decode(df: pd.DataFrame):
    method = (df["params.speculative.method"] if "params.speculative.method" in df
              else pd.Series("?", index=df.index))
    scripted = method.isin(["scripted", "mtp_scripted"])
    acc = num(df, "params.speculative.acceptance").where(scripted)
    # measured acceptance depends on the prompt: those rows name their workload
    workload = df["params.workload.name"] if "params.workload.name" in df else pd.Series("?", index=df.index)
    d = pd.DataFrame({
        "card": device_label(df),
        "model": df["params.model.name"],
        "drafts": method.where(scripted, method + " (" + workload + ")"),
        "B": num(df, "params.batch.size").astype(int),
        "k": num(df, "params.speculative.k").astype(int),
        "acceptance set": acc,
        "drafts kept": num(df, "metrics.acceptance_rate"),
        "tokens a slot a step": num(df, "metrics.tokens_per_step"),
        "step ms (p50)": num(df, "metrics.step_ms_p50"),
        "no-draft step ms": _opt(df, "metrics.nonspec_step_ms_p50"),
        "gen tok/s": num(df, "metrics.throughput_tok_s"),
        "no-draft tok/s": num(df, "metrics.nonspec_tok_s"),
        "x no drafts": num(df, "metrics.speedup_vs_nonspec"),
        "verified": check(num(df, "metrics.verify_ok")),
    }).sort_values(["card", "model", "drafts", "B", "k", "acceptance set"],
                   key=lambda c: c.map(_card_order) if c.name == "card" else c)
    md = _md(d, ("", "", "", ".0f", ".0f", ".2f", ".0%", ".2f", ".3f", ".3f", ",.0f", ",.0f", ".2f", ""))
    h = _newest(d.assign(_start=_start(df)), ["card", "model", "drafts", "B", "k", "acceptance set"])
    h = h.sort_values(["card", "model", "drafts", "B", "k", "acceptance set"],
                      key=lambda c: c.map(_card_order) if c.name == "card" else c)
    # one row per (card, drafts, B, k): the speed-up over the batch without drafts at each acceptance set (a
    # measured one for prompt lookup)
    h = h.assign(_acc=h["acceptance set"].map(lambda a: "measured" if pd.isna(a) else f"{a:g}"),
                 _cell=[_cell(v, ".2f", ok == "✓") for v, ok in zip(h["x no drafts"], h["verified"])])
    accs = [a for a in ("measured", "0", "0.5", "0.7", "1") if a in set(h["_acc"])][:4]   # 0.9: the appendix
    h = h.assign(**{"model, drafts": h["model"] + ", " + h["drafts"]})
    head = h.set_index(["card", "model, drafts", "B", "k", "_acc"])["_cell"].unstack("_acc").reindex(columns=accs)
    head.columns = [f"x, acc. {a}" if a != "measured" else "x, measured acc." for a in accs]
    head = head.reset_index().sort_values(["card", "model, drafts", "B", "k"],
                                          key=lambda c: c.map(_card_order) if c.name == "card" else c)
    headline = _grid(head.astype({"B": str, "k": str}), left=4)
    # the plot: the first card's rows, one line per (model and drafts, k, acceptance)
    first = h[h["card"] == h["card"].iloc[0]] if len(h) else h
    several = first[["model", "drafts"]].drop_duplicates().shape[0] > 1
    curves = {}
    for (model, drafts, k, a), g in first.groupby(["model", "drafts", "k", "acceptance set"], dropna=False, sort=True):
        if pd.isna(a) or a in (0.5, 0.7, 1.0):
            label = (f"{model} {drafts}, " if several else "") + f"k = {k}" + ("" if pd.isna(a) else f", acc. {a:g}")
            curves[label] = (g["B"], g["x no drafts"])
    title = "Speculative decoding" + ("" if several or not len(first) else f", {first['model'].iloc[0]}")
    fig = _curves(curves, "B (slots)", "x the batch without drafts", title,
                  hline=(1.0, "no drafts")) if curves else None
    note = ("Each cell: gen tok/s with up to k drafts a slot a step over the same batch without drafts, at the "
            "acceptance set for scripted drafts (the newest row; ✗: it did not verify). Verified: token for token "
            "the batch without drafts, and greedy streams equal to the single stream. Model, drafts kept, tokens a "
            "step and step times: the appendix.")
    return _report(headline, md, note=note), fig


def _plot(x, y, xlabel: str, ylabel: str, title: str, band: tuple | None = None):
    return _curves({"": (x, y)}, xlabel, ylabel, title, bands={"": band} if band is not None else None)


def _curves(curves: dict, xlabel: str, ylabel: str, title: str, logy: bool = False, styles: dict | None = None,
            points: dict | None = None, hline: tuple[float, str] | None = None, bands: dict | None = None):
    """y against B on a log-2 x axis: one line per entry of curves (label -> (x, y); label "" for a single unlabelled
    curve), line styles by label (a matplotlib linestyle, or a dict of plot keywords), markers without a line
    (points: label -> (x, y)), a dashed reference level, a shaded spread under a curve (bands: label -> (x, low,
    high), the repeats' p10-p90). None where no curve has a point to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def finite(x, y):
        pairs = [(a, b) for a, b in zip(x, y) if pd.notna(a) and pd.notna(b) and a > 0]
        return [a for a, _ in pairs], [b for _, b in pairs]

    curves = {k: finite(*xy) for k, xy in curves.items()}
    curves = {k: xy for k, xy in curves.items() if xy[0]}
    if not curves:
        return None        # nothing recorded to draw (a figure of no points cannot take a log axis)
    digest = plot_digest(curves=curves, xlabel=xlabel, ylabel=ylabel, title=title, logy=logy, styles=styles,
                         points=points, hline=hline, bands=bands)
    legend = any(curves) or points or hline
    fig, ax = plt.subplots(figsize=(8.5, 4.2) if len(curves) > 4 else (5.6, 3.6))
    for label, (x, y) in curves.items():
        style = (styles or {}).get(label, {})
        ax.plot(list(x), list(y), marker="o", markersize=3.5, label=label or None,
                **({"linestyle": style} if isinstance(style, str) else style))
    banded = False
    for label, (x, lo, hi) in (bands or {}).items():
        ok = [(a, b, c) for a, b, c in zip(x, lo, hi) if pd.notna(b) and pd.notna(c)]
        if ok:
            ax.fill_between([a for a, _, _ in ok], [b for _, b, _ in ok], [c for _, _, c in ok], alpha=0.25,
                            label="p10-p90 of the repeats")
            banded = True
    for label, (x, y) in (points or {}).items():
        ax.plot(list(x), list(y), "k*", markersize=11, label=label)
    if hline:
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.6g}"))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if legend or banded:
        if len(curves) > 4:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, handlelength=3.5)
        else:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.plot_digest = digest   # write_report puts it in the report and in the PNG's own text
    return fig


def _plain(v):
    """v as JSON-ready values in a fixed order: mappings as [key, value] pairs in their own order (a legend's order
    is part of the plot), sequences as lists, every number as a float."""
    if isinstance(v, dict):
        return [[str(k), _plain(x)] for k, x in v.items()]
    if isinstance(v, (list, tuple, pd.Series, pd.Index, np.ndarray)):
        return [_plain(x) for x in v]
    if isinstance(v, str) or v is None:
        return v
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    return None if pd.isna(v) else float(v)


def plot_digest(**drawn) -> str:
    """The first 12 hex digits of the sha256 of what a plot draws (its points, labels, styles and axes). A PNG's bytes
    change with the matplotlib version and its fonts; this does not, so `--check` compares it instead."""
    return hashlib.sha256(json.dumps(_plain(drawn)).encode()).hexdigest()[:12]


# ---- the seeds' published figures, beside ours in the results book ----
# The seed documents (shared/seeds/): 000 publishes the batched-decode tables this project re-measures (TornadoVM's
# CUDA backend on an RTX 4090, FP16), 003 describes the batched Qwen3.8-27B decode and publishes no measurement.
SEEDS = {"000": "000_01a64dfb238962be.txt", "003": "003_c1df390518dfbfcf.txt"}
SEED_000_SETUP = "an RTX 4090: TornadoVM's CUDA backend, FP16, ctx 512, CUDA graphs on (seed 000 l.75-76)"
NAN = float("nan")


def _at(df: pd.DataFrame, metric: str, where: dict | None = None, largest_b: bool = False) -> float:
    """The newest recorded metrics.<metric> among the rows matching `where` (column -> value; a bare name is a
    params.* column; numbers compare as numbers), at the largest B among them with largest_b; NaN where none."""
    match = pd.Series(True, index=df.index)
    for key, want in (where or {}).items():
        col = key if key.startswith(("params.", "metrics.", "tags.")) else f"params.{key}"
        if col not in df:
            return NAN
        is_num = isinstance(want, (int, float)) and not isinstance(want, bool)
        match &= num(df, col).eq(want) if is_num else df[col].astype(str).eq(str(want))
    col = f"metrics.{metric}"
    rows = df[match].assign(_v=num(df, col) if col in df else NAN, _start=_start(df)).dropna(subset=["_v"])
    if largest_b and len(rows):
        B = num(rows, "params.batch.size")
        rows = rows[B == B.max()]
    return float(rows.sort_values("_start", kind="stable")["_v"].iloc[-1]) if len(rows) else NAN


def _largest(df: pd.DataFrame, metric: str) -> float:
    """The largest recorded metrics.<metric> (the seed's micro-benchmarks name no B)."""
    col = f"metrics.{metric}"
    return float(num(df, col).max()) if col in df else NAN


def _fig(what: str, seed: float, unit: str, line: int, ours: Callable[[pd.DataFrame], float],
         approx: bool = False, written: str | None = None) -> dict:
    """One published figure: what it is, the seed's number and unit, the seed line that publishes it (approx: the
    seed writes it as "~N"; written: how the seed writes a number it gives in another form, "+20%" for 1.20x), and
    how to read ours from the table's runs."""
    return {"what": what, "seed": seed, "unit": unit, "line": line, "ours": ours, "approx": approx,
            "written": written}


def _static(model: str | None = None, **where) -> dict:
    return {**({"model.name": model} if model else {}), **where}


# per table: which seed and section, and its figures (none: "no published figure")
SEED_FIGURES: dict[str, dict] = {
    "static_batching": {"seed": "000", "section": "the static-batching table (l.77-83), Llama-3.2-1B on an RTX 4090; "
                        "ours is SmolLM2-135M on a CPU, so only the speed-up compares", "figures": [
        _fig("x single stream, B = 32", 10.7, "x", 81, lambda df: _at(df, "speedup_vs_single", {"batch.size": 32}))]},
    "static_scaling": {"seed": "000", "section": "the static-batching table, Llama-3.2-1B (l.77-83)", "figures": [
        _fig("single stream", 101, "tok/s", 80, lambda df: _at(df, "throughput_tok_s", {"batch.size": 1})),
        _fig("aggregate, B = 32", 1085, "tok/s", 81, lambda df: _at(df, "throughput_tok_s", {"batch.size": 32})),
        _fig("aggregate, B = 64", 2167, "tok/s", 82, lambda df: _at(df, "throughput_tok_s", {"batch.size": 64})),
        _fig("aggregate, B = 128", 4175, "tok/s", 83, lambda df: _at(df, "throughput_tok_s", {"batch.size": 128})),
        _fig("x single stream, B = 128", 41.3, "x", 83,
             lambda df: _at(df, "speedup_vs_single", {"batch.size": 128})),
        _fig("per-step latency, B = 128", 30.7, "ms", 83, lambda df: _at(df, "step_ms_p50", {"batch.size": 128}))]},
    "divergent_streams": {"seed": "000", "section": "the temperature-sampling check (l.70-71): seed B = 128, ours the "
                          "largest B recorded", "figures": [
        _fig("streams distinct at temperature 0.7", 100, "%", 71, written="128/128", ours=lambda df: 100 * _at(
            df, "distinct_streams", largest_b=True) / num(df, "params.batch.size").max())]},
    "across_models": {"seed": "000", "section": "the across-models table (l.86-91): the seed's batched B is the "
                      "largest that fits 24 GB (128 / 64 / 32), ours the largest recorded", "figures": [
        f for model, label, line, one, big, x in (
            ("llama-3.2-1b", "Llama-3.2-1B", 89, 101, 4175, 41), ("qwen3-1.7b", "Qwen3-1.7B", 90, 48, 1433, 30),
            ("qwen3-4b", "Qwen3-4B", 91, 39, 405, 10))
        for f in (
            _fig(f"{label}, single stream", one, "tok/s", line,
                 lambda df, m=model: _at(df, "throughput_tok_s", _static(m, **{"batch.size": 1}))),
            _fig(f"{label}, batched", big, "tok/s", line,
                 lambda df, m=model: _at(df, "throughput_tok_s", _static(m), largest_b=True)),
            _fig(f"{label}, x single stream", x, "x", line,
                 lambda df, m=model: _at(df, "speedup_vs_single", _static(m), largest_b=True)))]},
    "graphs_backends": {"seed": "000", "section": "the CUDA-graphs note under the static-batching table (l.84-85)",
                        "figures": [
        _fig("per-step time cut by CUDA graphs, B = 128 (Triton GEMM)", 6, "%", 84, lambda df: 100 * (1 - _at(
            df, "step_ms_p50", {"tags.backend": "triton", "engine.gemm": "triton", "engine.cuda_graphs": "True",
                                "batch.size": 128}) / _at(
            df, "step_ms_p50", {"tags.backend": "triton", "engine.gemm": "triton", "engine.cuda_graphs": "False",
                                "batch.size": 128})), approx=True)]},
    "projection_crossover": {"seed": "000", "section": "the supporting micro-benchmarks (l.216-218); the seed names "
                             "no B, ours is the largest speed-up recorded", "figures": [
        _fig("batched projection against B single-token ones", 20, "x", 217,
             lambda df: _largest(df, "speedup_vs_separate"), approx=True)]},
    "decode_attention": {"seed": "000", "section": "the supporting micro-benchmarks (l.216-219); the seed names no "
                         "B, ours is the largest speed-up recorded", "figures": [
        _fig("per-slot attention, B slots against one", 2, "x", 218, lambda df: _largest(df, "speedup_vs_one_slot"),
             approx=True)]},
    "serving_schedule": {"seed": "000", "section": "the scheduling table, 512 requests, B = 128 (l.108-115)",
                         "figures": [
        _fig("static wave", 1645, "gen tok/s", 112, lambda df: _at(df, "throughput_tok_s", {"scheduler.mode": "wave"})),
        _fig("continuous (prompts token by token)", 1972, "gen tok/s", 114, lambda df: _at(
            df, "throughput_tok_s", {"scheduler.mode": "continuous", "scheduler.prefill": "token"})),
        _fig("continuous over the static wave", 1.20, "x", 115, written="+20%", ours=lambda df: _at(
            df, "throughput_tok_s", {"scheduler.mode": "continuous", "scheduler.prefill": "token"})
            / _at(df, "throughput_tok_s", {"scheduler.mode": "wave"})),
        _fig("slot utilization, static wave", 66.4, "%", 112,
             lambda df: 100 * _at(df, "slot_util", {"scheduler.mode": "wave"})),
        _fig("slot utilization, continuous", 82.2, "%", 114, lambda df: 100 * _at(
            df, "slot_util", {"scheduler.mode": "continuous", "scheduler.prefill": "token"}))]},
    "serving_paged": {"seed": "000", "section": "the paged-KV table, 512 requests, B = 128 (l.122-128)", "figures": [
        _fig("contiguous KV", 1972, "gen tok/s", 125,
             lambda df: _at(df, "throughput_tok_s", {"kv_cache.layout": "contiguous"})),
        _fig("paged, 384-block pool", 1939, "gen tok/s", 127,
             lambda df: _at(df, "throughput_tok_s", {"metrics.kv_blocks": 385})),
        _fig("KV memory, contiguous over the 384-block pool", 10.7, "x", 128, lambda df: _at(
            df, "kv_pool_mb", {"kv_cache.layout": "contiguous"}) / _at(df, "kv_pool_mb", {"metrics.kv_blocks": 385}),
             approx=True),
        _fig("throughput cost of the 384-block pool", 1, "%", 128, lambda df: 100 * (1 - _at(
            df, "throughput_tok_s", {"metrics.kv_blocks": 385}) / _at(
            df, "throughput_tok_s", {"kv_cache.layout": "contiguous"})), approx=True)]},
    "serving_prefix": {"seed": "000", "section": "the prefix-cache table, 48-token shared prompt (l.141-148); the "
                       "seed's prefix cache is the pinned mode", "figures": [
        _fig("no prefix cache", 1307, "gen tok/s", 144,
             lambda df: _at(df, "throughput_tok_s", {"kv_cache.prefix": "off"})),
        _fig("prefix cache (pinned)", 2422, "gen tok/s", 145,
             lambda df: _at(df, "throughput_tok_s", {"kv_cache.prefix": "pinned"})),
        _fig("prefix cache over none", 1.85, "x", 146, written="+85%", ours=lambda df: _at(
            df, "throughput_tok_s", {"kv_cache.prefix": "pinned"}) / _at(
            df, "throughput_tok_s", {"kv_cache.prefix": "off"})),
        _fig("prefill tokens with the prefix cache", 4096, "tokens", 145,
             lambda df: _at(df, "prefill_tokens", {"kv_cache.prefix": "pinned"}))]},
    "serving_qwen3": {"seed": "000", "section": "the Qwen3-1.7B serving table, 256 requests (l.151-159)", "figures": [
        _fig("paged, no prefix cache", 465, "gen tok/s", 157,
             lambda df: _at(df, "throughput_tok_s", {"kv_cache.prefix": "off"})),
        _fig("paged + prefix cache", 949, "gen tok/s", 158,
             lambda df: _at(df, "throughput_tok_s", {"kv_cache.prefix": "auto"})),
        _fig("prefix cache over none", 2.04, "x", 159, written="+104%", ours=lambda df: _at(
            df, "throughput_tok_s", {"kv_cache.prefix": "auto"}) / _at(
            df, "throughput_tok_s", {"kv_cache.prefix": "off"})),
        _fig("peak KV blocks, no prefix cache", 296, "blocks", 157,
             lambda df: _at(df, "peak_blocks", {"kv_cache.prefix": "off"})),
        _fig("peak KV blocks, prefix cache", 151, "blocks", 158,
             lambda df: _at(df, "peak_blocks", {"kv_cache.prefix": "auto"}))]},
    "serving_sampling": {"seed": "000", "section": "the sampling table, 512 requests, B = 128 (l.165-170)",
                         "figures": [
        _fig("host sampling", 2344, "gen tok/s", 168,
             lambda df: _at(df, "throughput_tok_s", {"sampling.on_device": "False"})),
        _fig("on-device sampling", 3057, "gen tok/s", 169,
             lambda df: _at(df, "throughput_tok_s", {"sampling.on_device": "True"})),
        _fig("on-device over host", 1.30, "x", 170, written="+30%", ours=lambda df: _at(
            df, "throughput_tok_s", {"sampling.on_device": "True"}) / _at(
            df, "throughput_tok_s", {"sampling.on_device": "False"})),
        _fig("host sampling: copied to the host per step", 65, "MB", 168,
             lambda df: _at(df, "d2h_bytes_per_step", {"sampling.on_device": "False"}) / 1e6, approx=True)]},
    "serving_full": {"seed": "000", "section": "the sampling table's on-device row (l.165-169): continuous + paged + "
                     "prefix cache + on-device sampling, 512 requests, B = 128, the seed's fullest stack", "figures": [
        _fig("full stack, prompts token by token", 3057, "gen tok/s", 169,
             lambda df: _at(df, "throughput_tok_s", {"scheduler.prefill": "token"}))]},
    "verified_fresh": {"seed": "000", "section": "the verified-fresh table (l.184-192)", "figures": [
        *(_fig(f"{label}, static B = {b}", seed, "tok/s", line, lambda df, m=model, b=b: _at(
            df, "throughput_tok_s", _static(m, **{"scheduler.mode": "static", "batch.size": b})))
          for model, label, b, seed, line in (
              ("qwen3-1.7b", "Qwen3-1.7B", 8, 198, 187), ("qwen3-1.7b", "Qwen3-1.7B", 16, 402, 188),
              ("qwen3-1.7b", "Qwen3-1.7B", 32, 801, 189), ("qwen3-4b", "Qwen3-4B", 16, 217, 191),
              ("qwen3-4b", "Qwen3-4B", 32, 424, 192))),
        _fig("Qwen3-1.7B, continuous B = 16, R = 128", 301, "tok/s", 190, lambda df: _at(
            df, "throughput_tok_s", _static("qwen3-1.7b", **{"scheduler.mode": "continuous"}))),
        _fig("Qwen3-1.7B, continuous: requests/s", 6.2, "req/s", 190, lambda df: _at(
            df, "requests_s", _static("qwen3-1.7b", **{"scheduler.mode": "continuous"}))),
        _fig("Qwen3-1.7B, continuous: slot utilization", 95.8, "%", 190, lambda df: 100 * _at(
            df, "slot_util", _static("qwen3-1.7b", **{"scheduler.mode": "continuous"})))]},
    **{name: {"seed": "003", "section": "seed 003 describes the batched Qwen3.8-27B decode (l.2-8: one pass over the "
              "int4 weights serving a batch tile) but publishes no measurement", "figures": []}
       for name in ("int4_gemm", "int4_e2e", "gdn_step", "hybrid_27b", "serving_prefix_hybrid")},
}


def _figure(v: float, unit: str, approx: bool = False, published: bool = False) -> str:
    """A figure with its unit; published: the seed's number as the seed writes it (41.3, 101, ~6)."""
    if v is None or pd.isna(v):
        return "—"
    if published:
        text = f"{v:,}"
    elif unit in ("x", "%", "ms", "req/s", "MB"):
        text = f"{v:.2f}" if abs(v) < 10 else f"{v:,.1f}"
    else:
        text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"
    text = text + unit if unit in ("x", "%") else f"{text} {unit}"
    return ("~" if approx else "") + text


def seed_figures(name: str, df: pd.DataFrame) -> str:
    """The seed's published figures for a table beside ours (markdown), or a line saying there is none."""
    spec = SEED_FIGURES.get(name)
    if not spec or not spec["figures"]:
        why = f" ({spec['section']})" if spec else ""
        return f"**Seed figure:** no published figure{why}."
    ours = ", ".join(sorted(device_label(df).unique())) or "?"
    seed = f"seed ({'RTX 4090' if spec['seed'] == '000' else spec['seed']})"
    rows = [{"figure": f["what"], seed: _figure(f["seed"], f["unit"], f["approx"], published=True)
             + (f" ({f['written']})" if f["written"] else ""),
             f"ours ({ours})": _figure(f["ours"](df), f["unit"]), "seed line": f"{spec['seed']} l.{f['line']}"}
            for f in spec["figures"]]
    return (f"**Seed figures** (seed {spec['seed']}, {spec['section']}):\n\n"
            + _grid(pd.DataFrame(rows), left=1))


def _headline_of(report: str) -> tuple[list[str], str]:
    """The headline table's lines of a written report, and its note (the paragraph above the table)."""
    section = report.split(HEADLINE, 1)[-1].split("\n### ", 1)[0]
    lines = section.strip().splitlines()
    table_lines = [line for line in lines if line.startswith("|")]
    note = " ".join(line for line in lines if line and not line.startswith(("|", "![", "<!--"))).strip()
    return table_lines, note


def excerpt(report: str, rows: int = 8) -> str:
    """The top of a report's headline table: its header and first `rows` rows, and how many more there are."""
    lines, _ = _headline_of(report)
    more = len(lines) - 2 - rows
    return "\n".join(lines[:2 + rows]) + (f"\n\n_… and {more} more row{'s' * (more > 1)} in the full report._"
                                         if more > 0 else "")


def write_book(done: dict[str, tuple[pd.DataFrame, str]], out: Path) -> Path:
    """out/README.md, the results book, made from the reports written in out."""
    book = render_book(done, {name: (out / f"{name}.md").read_text() for name in done}, out)
    return atomic_write(out / "README.md", lambda tmp: tmp.write_text(book))


def render_book(done: dict[str, tuple[pd.DataFrame, str]], reports: dict[str, str], out: Path) -> str:
    """The results book (reports/README.md) as text: per documented table (TABLES order) what it measures, where its
    rows were recorded, its headline numbers (the top of the headline table in `reports`, each table's report text),
    the seed's published figures beside ours, and links to the full report and the experiment's README, relative to
    out, the folder the book lies in."""
    names = [n for n in TABLES if (EXPERIMENTS / n).is_dir()]
    sources = sorted({s.split(" merged")[0] for _, s in done.values()})
    kinds = ("the tracking store" if any(s.startswith("the tracking store") for s in sources) else "",
             "experiments/<name>/runs.csv" if any(s.startswith("experiments/") for s in sources) else "")
    source = " and ".join(k for k in kinds if k) or "the recorded runs"
    seeds = ", ".join(f"{k} = `{v}`" for k, v in SEEDS.items())
    index, sections = [], []
    for name in names:
        readme = EXPERIMENTS / name / "README.md"
        title = _title(name)
        link = os.path.relpath(readme, out)
        spec = SEED_FIGURES.get(name)
        n_seed = len(spec["figures"]) if spec else 0
        if name not in done:
            index.append({"table": f"[{title}](#{name})", "recorded on": "no recorded runs", "rows": "0",
                          "seed figures": str(n_seed) if n_seed else "none published"})
            sections += [f"## <a id=\"{name}\"></a>{title}", "", f"`{name}`: {ABOUT.get(name, '')}", "",
                         "No recorded runs: run the experiment (see its README) and regenerate.", "",
                         f"[Experiment README]({link})", ""]
            continue
        df, _ = done[name]
        report = reports[name]
        cards = ", ".join(f"{d}" for d in device_label(df).value_counts().index)
        index.append({"table": f"[{title}](#{name})", "recorded on": cards, "rows": str(len(df)),
                      "seed figures": str(n_seed) if n_seed else "none published"})
        _, note = _headline_of(report)
        sections += [f"## <a id=\"{name}\"></a>{title}", "", f"`{name}`: {ABOUT.get(name, '')}", "",
                     recorded_on(df), "", *([f"Headline: {note}", ""] if note else []), excerpt(report), "",
                     seed_figures(name, df), "",
                     f"[Full report]({name}.md) (every recorded row) · [Experiment README]({link}) (how it is "
                     f"recorded, what each column means)", ""]
    head = [f"<!-- Generated by `onepass-report --all` from {source}; do not edit by hand. -->",
            "# Results book", "",
            "Every documented results table: what it measures, where its rows were recorded, its headline numbers "
            "(the top of the report's headline table) and, where a seed document publishes a figure for it, the "
            "seed's figure beside ours. Each section links the full report (every recorded row) and the "
            f"experiment's README. Seeds (shared/seeds/): {seeds}. Seed 000's figures are from {SEED_000_SETUP}; "
            "ours name their card.", "",
            _grid(pd.DataFrame(index), left=2), ""]
    return "\n".join(head + sections)


def _title(name: str) -> str:
    readme = EXPERIMENTS / name / "README.md"
    return readme.read_text().splitlines()[0].lstrip("# ").strip() if readme.is_file() else name


def write_report(name: str, df: pd.DataFrame, source: str, out: Path) -> Path:
    """out/<name>.md (render_report), and its plot as out/<name>.png with the plot's data digest in the PNG's text."""
    import matplotlib.pyplot as plt

    text, fig = render_report(name, df, source)
    out.mkdir(parents=True, exist_ok=True)
    if fig is not None:
        meta = {"Description": PNG_DIGEST.format(fig.plot_digest)}
        atomic_write(out / f"{name}.png", lambda tmp: fig.savefig(tmp, dpi=120, format="png", metadata=meta))
        plt.close(fig)
    return atomic_write(out / f"{name}.md", lambda tmp: tmp.write_text(text))


# what a report's PNG carries in its text (a tEXt chunk, "Description"): the digest of the data it draws
PNG_DIGEST = "onepass plot data {}"


def render_report(name: str, df: pd.DataFrame, source: str):
    """A table's report as text, and its plot (None where it has none): the title, the card / commit line, the
    headline (with the plot beside it, linked as <name>.png, and the digest of what it draws), where the targets
    stand, every recorded row, the provenance."""
    try:
        md, fig = TABLES[name](df)
    except (KeyError, ValueError, TypeError) as e:   # a column the table reads is missing or holds no number
        what = f"column {e.args[0]!r} is missing" if isinstance(e, KeyError) else str(e).strip().splitlines()[0]
        fix = (f"restore it (git checkout -- experiments/{name}/runs.csv) or record it again" if "runs.csv" in source
               else f"rerun the experiment with this checkout (onepass -m experiment={name})")
        raise RunsFileError(f"table {name} cannot be made from {source}: {what}; {fix}") from None
    headline, sep, rest = md.partition("\n### ")
    if fig is not None:
        # the image's bytes differ across matplotlib versions; the digest of what it draws does not (--check)
        headline = (headline.rstrip("\n") + f"\n\n![{name}]({name}.png)\n"
                    + f"<!-- plot data {fig.plot_digest}: --check compares this, not the PNG's bytes -->\n")
    body = [f"<!-- Generated by `onepass-report` from {source}; do not edit by hand. -->", f"# {_title(name)}", "",
            recorded_on(df), "", headline + sep + rest, "", provenance(df), ""]
    return "\n".join(body), fig


def png_text(path: Path) -> dict[str, str]:
    """A PNG's text chunks (tEXt, and uncompressed iTXt) by keyword; {} for a file that is not a PNG."""
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return {}
    out, i = {}, 8
    while i + 8 <= len(data) and data[i + 4:i + 8] != b"IEND":
        size, kind = int.from_bytes(data[i:i + 4], "big"), data[i + 4:i + 8]
        body = data[i + 8:i + 8 + size]
        key, _, value = body.partition(b"\0")
        if kind == b"tEXt":
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt" and value[:1] == b"\0":   # flag 0: not compressed; then method, language, keyword
            out[key.decode("latin-1")] = value[2:].split(b"\0", 2)[-1].decode("utf-8", "replace")
        i += 12 + size   # length, type, data, CRC
    return out


# how much of each differing report --check prints: the first lines of a unified diff, each cut to a screen's width
CHECK_DIFF_LINES, CHECK_LINE_CHARS = 12, 160


def check_reports(folder: Path = REPORTS) -> int:
    """Regenerate every report and the results book from experiments/*/runs.csv in memory and compare them with the
    files in folder. 0 where all match; 1 naming each file that differs (with the first lines of a unified diff), is
    missing, or that no table makes; 2 where a runs.csv cannot be read. Reports compare as text; a plot by the digest
    of what it draws (in its report's text and in the PNG's own), never by its bytes, which change with matplotlib."""
    import matplotlib.pyplot as plt

    texts: dict[str, str] = {}
    digests: dict[str, str] = {}
    done: dict[str, tuple[pd.DataFrame, str]] = {}
    status = 0
    for name in sorted(n for n in TABLES if (EXPERIMENTS / n).is_dir()):
        source = f"experiments/{name}/runs.csv"
        try:
            df = runs_from_csv(name)
            if df.empty:
                continue
            check_one_device(name, df)
            texts[f"{name}.md"], fig = render_report(name, df, source)
        except ValueError as e:
            status = max(status, refused(e))
            continue
        if fig is not None:
            digests[f"{name}.png"] = fig.plot_digest
            plt.close(fig)
        done[name] = (df, source)
    texts["README.md"] = render_book(done, {n: texts[f"{n}.md"] for n in done}, folder)
    wrong = []
    for file, text in texts.items():
        path, shown = folder / file, _shown(folder / file)
        if not path.is_file():
            wrong.append(f"{shown} is missing")
            continue
        diff = list(difflib.unified_diff(path.read_text().splitlines(), text.splitlines(), f"{shown} (committed)",
                                         f"{shown} (regenerated)", lineterm="", n=0))
        if diff:
            more = len(diff) - CHECK_DIFF_LINES
            wrong.append(f"{shown} differs from what its runs regenerate:\n" + "\n".join(
                "    " + (line if len(line) <= CHECK_LINE_CHARS else line[:CHECK_LINE_CHARS] + " …")
                for line in diff[:CHECK_DIFF_LINES]) + (f"\n    … {more} more diff lines" if more > 0 else ""))
    for file, digest in digests.items():
        path, shown = folder / file, _shown(folder / file)
        if not path.is_file():
            wrong.append(f"{shown} is missing")
        elif (held := png_text(path).get("Description", "")) != PNG_DIGEST.format(digest):
            wrong.append(f"{shown} was drawn from other data: it holds {held!r}, the runs now draw "
                         f"{PNG_DIGEST.format(digest)!r}" if held else
                         f"{shown} carries no plot-data digest (not drawn by this onepass-report)")
    made = set(texts) | set(digests)
    wrong += [f"{_shown(p)}: no table makes it (a table removed or renamed?); delete it"
              for p in sorted(folder.glob("*")) if p.suffix in (".md", ".png") and p.name not in made]
    for line in wrong:
        print(f"[check] {line}", file=sys.stderr)
    if wrong:
        print(f"[check] {len(wrong)} file(s) under {_shown(folder)}/ do not match what experiments/*/runs.csv "
              "regenerate: regenerate them with `onepass-report --all` (never by hand) and commit them with the "
              "runs.csv they come from", file=sys.stderr)
        return max(status, 1)
    print(f"[check] {len(texts) - 1} reports, {len(digests)} plots and the results book under {_shown(folder)}/ match "
          "what experiments/*/runs.csv regenerate")
    return status


def out_folder(args, recorded: bool) -> Path:
    """Where a report goes: --out when given; reports/ for a table just recorded and under --all; else the local
    folder."""
    return Path(args.out) if args.out else REPORTS if recorded or args.all else LOCAL_REPORTS


def noisy_refusal(name: str, df: pd.DataFrame) -> str:
    """Why the runs of a table may not be recorded as they are ("" where none is noisy)."""
    noisy = df[df["tags.noisy"].fillna("") == "true"] if "tags.noisy" in df else df.iloc[:0]
    if noisy.empty:
        return ""
    first = noisy.iloc[0]
    label = f"B={first['params.batch.size']}: " if "params.batch.size" in noisy else ""
    why = first.get("tags.noise_reason") or "no reason recorded"
    return (f"{name}: {len(noisy)} of the {len(df)} runs are noisy (first, {label}{why}); rerun the sweep on a quiet "
            "machine, or add --allow-noisy to record them anyway (the report flags them)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        from onepass.harness import compare

        return compare.main(argv[1:])
    ap = argparse.ArgumentParser(
        description="Regenerate the results tables under reports/ from recorded runs.",
        epilog="onepass-report compare A B [--threshold 0.05] [--fail-on-regression]: each experiment's headline "
               "figures of A and B side by side (a run id, a commit of the recorded runs, or a runs.csv; "
               "onepass-report compare -h says more).")
    ap.add_argument("names", nargs="*", help="experiments to report (default: every one with a table)")
    ap.add_argument("--all", action="store_true",
                    help="every committed report and the results book, rewritten in reports/ (or --out) from "
                         "experiments/*/runs.csv, the recorded runs and nothing else")
    ap.add_argument("--check", action="store_true",
                    help="with --all: write nothing; regenerate every report and the results book in memory and exit 1 "
                         "naming each file under reports/ (or --out) that differs (with the first lines of a diff), is "
                         "missing or that no table makes. Plots are not compared byte for byte (a PNG changes with the "
                         "matplotlib version): each report holds the digest of the data its plot draws, and so does "
                         "the PNG's own text; --check compares those digests, and that the PNG exists")
    ap.add_argument("--source", choices=("auto", "store", "csv"), default=None,
                    help="auto (the default without --all): the tracking store when it has runs for the table, else "
                         "experiments/<name>/runs.csv; --all reads csv only")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--record", action="store_true", help="also write the store's runs to experiments/<name>/runs.csv")
    ap.add_argument("--merge", action="store_true",
                    help="with --record: replace only the recorded rows the store's runs re-measure (ROW_KEYS), "
                         "keep the rest")
    ap.add_argument("--replace", action="store_true",
                    help="with --record: let the store's runs replace every recorded row, dropping those they do not "
                         "re-measure (without it, a record that would drop rows is refused)")
    ap.add_argument("--allow-noisy", action="store_true",
                    help="with --record: record runs the noise guard marked noisy (refused without it)")
    ap.add_argument("--all-sweeps", action="store_true",
                    help="take every finished run in the store, not only the newest sweep of each experiment file")
    ap.add_argument("--out", default=None,
                    help=f"folder for the reports (default: {LOCAL_REPORTS}/ for your own runs; with --record, "
                         "reports/, regenerated from the runs.csv just recorded)")
    args = ap.parse_args(argv)
    if args.all and args.names:
        ap.error("--all means every table: give it no table names")
    if args.check:
        if not args.all or args.record or args.source not in (None, "csv"):
            ap.error("--check compares every committed report with what experiments/*/runs.csv regenerate: "
                     "onepass-report --all --check [--out FOLDER]")
        return check_reports(Path(args.out) if args.out else REPORTS)
    if args.all and args.source not in (None, "csv") and not args.out:
        ap.error("--all rewrites the committed reports/ from experiments/*/runs.csv only; to make every table from "
                 "the tracking store, run onepass-report without --all (it writes to outputs/reports/)")
    if args.all and args.record:
        ap.error("--all rewrites reports from what is recorded; --record records one table: "
                 "onepass-report NAME --record")
    args.source = args.source or ("csv" if args.all else "auto")
    every = args.all or not args.names
    names = sorted(n for n in TABLES if (EXPERIMENTS / n).is_dir()) if every else args.names
    status, book_stale = 0, False
    done: dict[str, tuple[pd.DataFrame, str]] = {}
    for name in names:
        if name not in TABLES:
            print(f"[report] no table named {name!r}; known: {sorted(TABLES)}", file=sys.stderr)
            status = 1
            continue
        df, source, recorded = pd.DataFrame(), "", False
        if args.source in ("auto", "store"):
            try:
                df = runs_from_store(name, args.uri, newest=not args.all_sweeps)
                source = f"the tracking store {args.uri}"
            except Exception as e:
                if args.source == "store" or args.record:   # --record takes runs from the store and nowhere else
                    print(f"[error] {name}: the tracking store cannot be read ({args.uri})"
                          f"{', nothing recorded' if args.record else ''}: {e}{_schema_hint(e)}", file=sys.stderr)
                    status = 2
                    continue
                print(f"[report] {name}: tracking store unavailable ({e}); reading experiments/{name}/runs.csv",
                      file=sys.stderr)
        if df.empty and args.source in ("auto", "csv"):
            try:
                df, source = runs_from_csv(name), f"experiments/{name}/runs.csv"
            except RunsFileError as e:
                status = max(status, refused(e))
                continue
        if df.empty:
            print(f"[report] {name}: no recorded runs (run `onepass -m experiment={name}` first)", file=sys.stderr)
            if not every:   # asked for by name; among every table, one not yet run is no failure (the book says so)
                status = max(status, 1)
            continue
        if args.record and source.startswith("the tracking store"):
            if args.merge:
                try:
                    df = merge_runs(name, runs_from_csv(name), df)
                except ValueError as e:
                    status = max(status, refused(e))
                    continue
                source += f" merged into experiments/{name}/runs.csv"
        try:
            check_one_device(name, df)
        except ValueError as e:
            status = max(status, refused(e))
            continue
        if args.record and source.startswith("the tracking store"):
            if (why := noisy_refusal(name, df)) and not args.allow_noisy:
                print(f"[report] {why}", file=sys.stderr)
                status = max(status, 1)
                continue
            try:
                # a merge drops exactly the recorded rows its runs re-measure (merge_runs keeps every other one)
                path = record_csv(name, df, args.replace or args.merge)
                print(f"[report] {name}: recorded {len(df)} runs to {path}")
                # the committed report is made from what is recorded, and from nothing else
                df, source, recorded = runs_from_csv(name), f"experiments/{name}/runs.csv", True
            except ValueError as e:
                status = max(status, refused(e))
                continue
        try:
            path = write_report(name, df, source, out_folder(args, recorded))
        except RunsFileError as e:
            status = max(status, refused(e))
            continue
        done[name] = (df, source)
        book_stale |= recorded and path.parent.resolve() == REPORTS.resolve()
        print(f"[report] {name}: {path} ({len(df)} runs from {source})")
        print(path.read_text())
    if every:
        print(f"[report] results book: {write_book(done, out_folder(args, False))}")
    elif book_stale:
        # the results book quotes every table's headline: a table recorded anew changes its section
        try:
            book = {}
            for n in (n for n in sorted(TABLES) if (EXPERIMENTS / n).is_dir() and (REPORTS / f"{n}.md").is_file()):
                if not (runs := runs_from_csv(n)).empty:
                    book[n] = (runs, f"experiments/{n}/runs.csv")
            print(f"[report] results book: {write_book(book, REPORTS)}")
        except RunsFileError as e:
            status = max(status, refused(e))
    return status


from onepass.harness import latency_report  # noqa: E402, F401  (registers its table here)


if __name__ == "__main__":
    # run as a script this file is `__main__`, a second copy of the module: the tables that register themselves on
    # onepass.harness.report (latency_report) are in that one, so its main runs
    from onepass.harness.report import main as registered_main

    sys.exit(registered_main())
