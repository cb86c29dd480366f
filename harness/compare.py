"""`onepass-report compare A B`: each experiment's headline figures of two sets of recorded runs side by side.

A and B are each a run id in the tracking store (a sweep's parent run stands for its finished jobs), a commit (the
rows of every experiments/<name>/runs.csv recorded at it: a sha, short or full, or a name git resolves) or the path of
a runs.csv. Rows pair up by the key `--record --merge` uses (harness/report.py ROW_KEYS, with the card); a table
without one pairs its rows by the params its runs vary. A ratio B/A past --threshold in the wrong direction is a
regression; --fail-on-regression turns one into exit status 1.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pandas as pd
from tabulate import tabulate

from onepass.harness import report
from onepass.harness.report import DEVICE_KEY, ROOT, ROW_KEYS, RunsFileError


class Headline(NamedTuple):
    metric: str              # the metric's name, without "metrics."
    label: str               # its column name
    higher_is_better: bool


# the figure(s) each experiment is judged by; every other table: aggregate throughput
HEADLINES: dict[str, tuple[Headline, ...]] = {
    "projection_crossover": (Headline("gemm_us", "GEMM us", False),),
    "decode_attention": (Headline("attn_us", "us", False),),
    "int4_gemm": (Headline("picked_us", "picked us", False),),
    "gdn_step": (Headline("our_us", "us/layer", False),),
    "spec_decode": (Headline("throughput_tok_s", "tok/s", True), Headline("speedup_vs_nonspec", "x no drafts", True)),
}
THROUGHPUT = (Headline("throughput_tok_s", "tok/s", True),)
DEFAULT_THRESHOLD = 0.05
RUN_ID = re.compile(r"[0-9a-f]{32}")
SHA = re.compile(r"[0-9a-f]{4,40}")


class CompareError(ValueError):
    """A side of the comparison that names no runs: said with what was looked for and where."""


class Side(NamedTuple):
    label: str               # what the side is, for the output ("commit abc1234", "run 1f2e...", a path)
    runs: pd.DataFrame       # its runs, with a column "table"


def _tables(df: pd.DataFrame, fallback: str = "") -> pd.Series:
    """Each run's table: tags.table, else params.table, else fallback."""
    out = pd.Series(fallback, index=df.index, dtype=object)
    for col in ("params.table", "tags.table"):      # the tag wins where both are there
        if col in df:
            out = df[col].where(df[col].notna() & (df[col].astype(str) != ""), out)
    return out


def _recorded() -> dict[str, pd.DataFrame]:
    """Every experiments/<name>/runs.csv by name."""
    return {path.parent.name: report.read_runs(path, f"restore it (git checkout -- {report._shown(path)})")
            for path in sorted(report.EXPERIMENTS.glob("*/runs.csv"))}


def from_csv(path: Path) -> Side:
    df = report.read_runs(path, "give the runs.csv of a table (experiments/<name>/runs.csv, or an older copy of one)")
    name = path.resolve().parent.name if path.name == "runs.csv" else ""
    df = df.assign(table=_tables(df, name))
    if (df["table"] == "").any():
        raise CompareError(f"{path}: no tags.table column says which table its runs belong to; give an "
                           "experiments/<name>/runs.csv (its folder names the table)")
    return Side(f"{path} ({len(df)} runs)", df)


def _git_sha(spec: str) -> str:
    """The full sha git resolves spec to in this checkout ("" where it does not: no git, or no such commit)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def from_commit(spec: str) -> Side | None:
    """The recorded rows of the commit spec names (a sha, or a name git resolves); None where none is; CompareError
    where spec is the start of several recorded commits. Some runs recorded a short sha: one that starts the given
    sha is that commit too."""
    sha = spec.lower() if SHA.fullmatch(spec.lower()) else _git_sha(spec)
    if not sha:
        return None
    frames = []
    for name, df in _recorded().items():
        if "tags.git_commit" in df:
            commit = df["tags.git_commit"].fillna("").str.lower()
            hit = df[commit.str.startswith(sha) | ((commit.str.len() >= 7) & commit.map(sha.startswith))]
            frames.append(hit.assign(table=_tables(hit, name)))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if rows.empty:
        return None
    # a short sha recorded beside the full one is the same commit
    found = set(rows["tags.git_commit"].str.lower())
    commits = sorted(c for c in found if not any(o != c and o.startswith(c) for o in found))
    if len(commits) > 1:
        raise CompareError(f"{spec!r} is the start of {len(commits)} recorded commits ({', '.join(commits)}); give "
                           "more of the sha")
    return Side(f"commit {commits[0][:10]} ({len(rows)} runs of experiments/*/runs.csv)", rows)


def from_store(run_id: str, uri: str) -> Side | None:
    """The run run_id in the store (a sweep's parent: its finished jobs); None where the store has no such run."""
    import mlflow

    from onepass.harness.tracking import check_reachable, sqlite_file, store_lock

    if (db := sqlite_file(uri)) is not None and not db.is_file():
        return None            # no store file, no run: reading must not leave an empty store behind
    with store_lock(uri):
        check_reachable(uri)
        mlflow.set_tracking_uri(uri)
        df = mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.run_id = '{run_id}'")
        if df.empty:
            return None
        sweep = "tags.onepass.kind" in df and df["tags.onepass.kind"].iloc[0] == "sweep"
        if sweep:
            df = mlflow.search_runs(search_all_experiments=True,
                                    filter_string=f"tags.mlflow.parentRunId = '{run_id}' and "
                                                  "attributes.status = 'FINISHED'")
    if df.empty:
        raise CompareError(f"run {run_id} in {uri} is a sweep with no finished job")
    what = f"sweep {run_id[:10]} ({len(df)} runs)" if sweep else f"run {run_id[:10]}"
    df = df.assign(table=_tables(df))
    if (df["table"] == "").any():
        raise CompareError(f"{what} in {uri} has no table tag: not the run of a onepass job")
    return Side(what, df)


def resolve(spec: str, uri: str) -> Side:
    """A side of the comparison: a runs.csv path, a run id in the store at uri, or a commit of the recorded runs."""
    path = Path(spec)
    if path.is_file():
        return from_csv(path)
    if spec.endswith(".csv"):
        raise CompareError(f"{spec}: no such file")
    found: list[Side] = []
    store_error = ""
    if RUN_ID.fullmatch(spec.lower()):
        try:
            if (side := from_store(spec.lower(), uri)) is not None:
                found.append(side)
        except CompareError:
            raise
        except Exception as e:   # an unreachable store is no reason to refuse a commit of the same digits
            store_error = f" (the store could not be read: {str(e).strip().splitlines()[0]})"
    if (side := from_commit(spec)) is not None:
        found.append(side)
    if len(found) > 1:
        raise CompareError(f"{spec!r} is both a run in {uri} and a recorded commit; give the runs.csv path, or "
                           "another store with --uri")
    if found:
        return found[0]
    runs = pd.concat([df for df in _recorded().values() if {"tags.git_commit", "start_time"} <= set(df.columns)])
    newest = list(dict.fromkeys(runs.sort_values("start_time", ascending=False)["tags.git_commit"].dropna().str[:7]))
    sha = "" if SHA.fullmatch(spec.lower()) else _git_sha(spec)
    run = (f"no run of that id in {uri}{store_error}" if RUN_ID.fullmatch(spec.lower())
           else "not a run id (32 hex digits)")
    raise CompareError(f"{spec!r} names no runs: no file of that name, {run}, and no commit of the runs recorded in "
                       "experiments/*/runs.csv"
                       + (f" ({spec} is commit {sha[:10]}, at which no recorded run was made)" if sha else "")
                       + f"; the newest recorded commits: {', '.join(newest[:6])}")


# params that say where a run was made or logged, not what it ran (a model file's path differs between machines)
NOT_CONFIG = ("params.tracking.", "params.progress", "params.model.path")


def key_columns(name: str, a: pd.DataFrame, b: pd.DataFrame) -> list[str]:
    """The columns that pair a table's rows: its ROW_KEYS and the card; else every param that both sides recorded and
    that takes more than one value over their runs (a sweep's axes, and whatever differs between A and B: a row is
    never paired with another configuration), and the card."""
    if name in ROW_KEYS:
        return [*ROW_KEYS[name], DEVICE_KEY]
    params = [c for c in a.columns.intersection(b.columns) if c.startswith("params.") and not c.startswith(NOT_CONFIG)
              and a[c].notna().any() and b[c].notna().any() and pd.concat([a[c], b[c]]).astype(str).nunique() > 1]
    return sorted(params) + [DEVICE_KEY]


def _newest(df: pd.DataFrame, cols: list[str], keep: list[str]) -> pd.DataFrame:
    """The newest run of each key: its key (_key, as a tuple of text) and the columns keep (empty where it has none)."""
    start = df["start_time"].astype(str) if "start_time" in df else pd.Series("", index=df.index)
    df = df.assign(_key=report.row_keys(df, cols), _start=start).sort_values("_start", kind="stable")
    return df.drop_duplicates("_key", keep="last").reindex(columns=["_key", *keep]).reset_index(drop=True)


def _figure(v: float) -> str:
    return "—" if pd.isna(v) else f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"


def _short(col: str) -> str:
    return "card" if col == DEVICE_KEY else col.split(".", 1)[1]


class Paired(NamedTuple):
    keys: list[str]           # the columns that paired the rows
    table: str                # the markdown table of the paired rows
    regressions: list[str]    # one line per regression past the threshold
    rows: int                 # rows paired
    unpaired: tuple[int, int]  # rows of A, of B with no counterpart


def pair(name: str, a: pd.DataFrame, b: pd.DataFrame, threshold: float) -> Paired:
    """One table's rows of A and B paired by key: each headline figure of both, B/A, and a flag past threshold."""
    cols = key_columns(name, a, b)
    heads = HEADLINES.get(name, THROUGHPUT)
    keep = [*(f"metrics.{h.metric}" for h in heads), "tags.noisy"]
    na, nb = _newest(a, cols, keep), _newest(b, cols, keep)
    m = na.merge(nb, on="_key", suffixes=(" A", " B"))    # the keys both sides hold, in A's order
    both = list(m["_key"])
    keys = pd.DataFrame(both, columns=cols)
    # only the key columns that tell the rows apart (all of them for a single row)
    shown = [c for c in cols if keys[c].nunique() > 1] or cols
    out = keys[shown].rename(columns=_short)
    if DEVICE_KEY in shown:
        out["card"] = out["card"].str.removeprefix("NVIDIA ")
    flags: list[list[str]] = [[] for _ in both]
    regressions = []
    for h in heads:
        va, vb = (pd.to_numeric(m[f"metrics.{h.metric} {s}"], errors="coerce").to_numpy() for s in "AB")
        out[f"{h.label} A"] = [_figure(v) for v in va]
        out[f"{h.label} B"] = [_figure(v) for v in vb]
        ratio = [y / x if x and not pd.isna(x) and not pd.isna(y) else float("nan") for x, y in zip(va, vb)]
        out[f"{h.label} B/A"] = ["—" if pd.isna(r) else f"{r:.3f}" for r in ratio]
        for i, r in enumerate(ratio):
            if pd.isna(r):
                continue
            worse = r < 1 - threshold if h.higher_is_better else r > 1 + threshold
            better = r > 1 + threshold if h.higher_is_better else r < 1 - threshold
            if worse:
                flags[i].append(f"REGRESSION {h.label} {r - 1:+.1%}")
                where = ", ".join(f"{_short(c)}={v}" for c, v in zip(cols, both[i]) if c in shown)
                regressions.append(f"{name} {where}: {h.label} {_figure(va[i])} -> {_figure(vb[i])} ({r - 1:+.1%})")
            elif better:
                flags[i].append(f"better {h.label} {r - 1:+.1%}")
    for side in "AB":
        for i, noisy in enumerate(m[f"tags.noisy {side}"]):
            if str(noisy) == "true":
                flags[i].append(f"{side} noisy")
    out["flag"] = ["; ".join(f) for f in flags]
    align = ["left"] * len(shown) + ["right"] * (len(out.columns) - len(shown) - 1) + ["left"]
    table = tabulate(out, headers="keys", tablefmt="github", showindex=False, disable_numparse=True, colalign=align)
    return Paired(cols, table, regressions, len(both), (len(na) - len(both), len(nb) - len(both)))


def compare(a: Side, b: Side, threshold: float = DEFAULT_THRESHOLD) -> tuple[str, list[str], int]:
    """The comparison as text, the regressions past threshold, and how many rows paired."""
    lines = [f"A = {a.label}", f"B = {b.label}", ""]
    regressions, paired = [], 0
    ta, tb = set(a.runs["table"]), set(b.runs["table"])
    for name in sorted(ta & tb):
        ra, rb = (s.runs[s.runs["table"] == name] for s in (a, b))
        p = pair(name, ra, rb, threshold)
        judged = ", ".join(f"{h.label} ({'higher' if h.higher_is_better else 'lower'} is better)"
                           for h in HEADLINES.get(name, THROUGHPUT))
        lines += [f"## {name}: {judged}", "", f"Rows paired by: {', '.join(map(_short, p.keys))}.", ""]
        lines += [p.table, ""] if p.rows else ["no row of A has a counterpart in B (the same configuration on the "
                                               "same card)", ""]
        if any(p.unpaired):
            lines += [f"{p.unpaired[0]} configuration(s) of A and {p.unpaired[1]} of B have no counterpart on the "
                      "other side.", ""]
        regressions += p.regressions
        paired += p.rows
    for side, only in (("A", ta - tb), ("B", tb - ta)):
        if only:
            lines.append(f"Tables only in {side}: {', '.join(sorted(only))}.")
    return "\n".join(lines).rstrip() + "\n", regressions, paired


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="onepass-report compare",
        description="Each experiment's headline figures (tok/s; a kernel's time) of A and B side by side, per row of "
                    "its table, with B/A, flagging a regression past --threshold.")
    for side in ("A", "B"):
        ap.add_argument(side.lower(), metavar=side,
                        help="a run id in the tracking store (a sweep's parent run: its jobs), a commit whose runs "
                             "experiments/*/runs.csv hold (a sha, short or full, or a name git resolves: HEAD~3), or "
                             "the path of a runs.csv")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"),
                    help="the tracking store that run ids are looked up in")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                    help=f"a change of B/A past this fraction is flagged (default {DEFAULT_THRESHOLD}: 5%%)")
    ap.add_argument("--fail-on-regression", action="store_true",
                    help="exit 1 when a headline figure of B is worse than A's past the threshold")
    args = ap.parse_args(argv)
    if not 0 <= args.threshold < 1:
        ap.error(f"--threshold {args.threshold}: give a fraction in [0, 1), e.g. 0.05 for 5%")
    try:
        a, b = resolve(args.a, args.uri), resolve(args.b, args.uri)
    except (CompareError, RunsFileError) as e:
        print(f"[error] {e}", file=sys.stderr)
        return 2
    text, regressions, paired = compare(a, b, args.threshold)
    print(text)
    if not paired:
        print("[compare] no row of A has a counterpart in B: nothing compared", file=sys.stderr)
        return 1
    print(f"[compare] {paired} rows compared; {len(regressions)} regression(s) past {args.threshold:.0%}"
          + "".join(f"\n  {r}" for r in regressions))
    return 1 if regressions and args.fail_on_regression else 0
