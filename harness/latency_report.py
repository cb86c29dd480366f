"""The serving_latency table (job=serving_latency, harness/latency_job.py): per target and offered rate, the latency
percentiles, throughput and goodput of one request trace replayed open loop, where each target saturates, and the plot
a reader of a latency benchmark expects: p99 TTFT and p99 TPOT against offered load, throughput against offered load,
the saturation point marked. Registered with report.py's `@table` like every other table."""
from __future__ import annotations

import math

import pandas as pd

from onepass.harness import report
from onepass.harness.report import _cell, _grid, _md, _newest, _opt, _report, _start, _tag, check, device_label, num

TABLE = "serving_latency"
# a rerun of one (model, B, trace, target, rate) on one card replaces its row; the card column lets several cards stand
report.ROW_KEYS[TABLE] = ("params.model.name", "params.batch.size", "params.workload.name",
                          "params.workload.num_requests", "params.workload.target", "params.workload.rate")
report.DEVICE_TABLES.add(TABLE)
TARGET_ORDER = ("inprocess", "http", "hf")
LABELS = {"inprocess": "onepass in-process", "http": "onepass over HTTP", "hf": "HF continuous batching"}
ALL_AT_ONCE = "all at once"
SETTING = ["card", "model", "B", "requests"]   # one curve per target in each: the rows compared with one another


def _target_key(t: str):
    return (TARGET_ORDER.index(t) if t in TARGET_ORDER else len(TARGET_ORDER), t)


def rows(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: its card, target, offered rate and the figures, with whether it met its SLOs (p99 TTFT and
    p99 TPOT within the run's own slo.ttft_ms and slo.tpot_ms)."""
    ttft99, tpot99 = _opt(df, "metrics.ttft_ms_p99"), _opt(df, "metrics.tpot_ms_p99")
    slo_ttft, slo_tpot = _opt(df, "params.slo.ttft_ms"), _opt(df, "params.slo.tpot_ms")
    met = (ttft99 <= slo_ttft) & (tpot99.isna() | (tpot99 <= slo_tpot))
    noisy = _tag(df, "tags.noisy") == "true"
    return pd.DataFrame({
        "card": device_label(df),
        "model": _tag(df, "params.model.name"),
        "B": _opt(df, "params.batch.size"),
        "requests": _opt(df, "params.workload.num_requests"),
        "target": df["params.workload.target"].astype(str),
        "rate": num(df, "params.workload.rate"),
        "req/s": _opt(df, "metrics.request_throughput"),
        "output tok/s": _opt(df, "metrics.output_tok_s"),
        "goodput req/s": _opt(df, "metrics.goodput_req_s"),
        "TTFT p50": _opt(df, "metrics.ttft_ms_p50"), "TTFT p90": _opt(df, "metrics.ttft_ms_p90"), "TTFT p99": ttft99,
        "TPOT p50": _opt(df, "metrics.tpot_ms_p50"), "TPOT p90": _opt(df, "metrics.tpot_ms_p90"), "TPOT p99": tpot99,
        "ITL p50": _opt(df, "metrics.itl_ms_p50"), "ITL p99": _opt(df, "metrics.itl_ms_p99"),
        "E2E p50": _opt(df, "metrics.e2e_ms_p50"), "E2E p99": _opt(df, "metrics.e2e_ms_p99"),
        "SLO ms": [f"{a:g} / {b:g}" if pd.notna(a) and pd.notna(b) else "—" for a, b in zip(slo_ttft, slo_tpot)],
        "_slo_ttft": slo_ttft, "_slo_tpot": slo_tpot,
        "met": met,
        "verified": check(_opt(df, "metrics.verify_ok")),
        "noisy": noisy,
        "_start": _start(df),
    })


def _same(d: pd.DataFrame, cols: list[str], values) -> pd.Series:
    """The rows whose cols equal values, a missing value (a run without that param) matching a missing one."""
    hit = pd.Series(True, index=d.index)
    for c, v in zip(cols, values):
        hit &= d[c].isna() if pd.isna(v) else d[c] == v
    return hit


def _offered(rate: float) -> str:
    return ALL_AT_ONCE if math.isinf(rate) else f"{rate:g}"


def _sort(d: pd.DataFrame) -> pd.DataFrame:
    return d.sort_values([*SETTING, "target", "rate"], key=lambda c: (
        c.map(report._card_order) if c.name == "card" else c.map(_target_key) if c.name == "target" else c))


def saturation(d: pd.DataFrame) -> dict[tuple, str]:
    """Per (card, model, B, requests, target): the highest finite offered rate whose verified newest row met the SLOs,
    as text ("not reached" where all at once met them too; "below r" where no rate did)."""
    out = {}
    for key, g in d.groupby([*SETTING, "target"], sort=False, dropna=False):
        ok = g[g["met"] & (g["verified"] == "✓")]
        finite = ok[~ok["rate"].map(math.isinf)]
        if (ok["rate"].map(math.isinf)).any():
            out[key] = "not reached (all at once met the SLOs)"
        elif len(finite):
            out[key] = f"{finite['rate'].max():g} req/s"
        else:
            out[key] = f"below {g['rate'].min():g} req/s (no rate met the SLOs)"
    return out


def saturation_rate(d: pd.DataFrame, key: tuple) -> float | None:
    """The saturation point of saturation() as a rate; None where it was not reached or no rate met the SLOs."""
    g = d[_same(d, [*SETTING, "target"], key)]
    ok = g[g["met"] & (g["verified"] == "✓")]
    if ok["rate"].map(math.isinf).any() or ok.empty:
        return None
    return float(ok["rate"].max())


@report.table(TABLE, "Latency under load: one trace of requests arriving at a set rate, replayed open loop against "
                     "onepass (in process, over HTTP), HF transformers' continuous batching and any OpenAI-compatible "
                     "server: TTFT, TPOT and throughput against offered load, and the saturation point (the highest "
                     "rate meeting the SLOs).")
def serving_latency(df: pd.DataFrame):
    d = _sort(_newest(rows(df), [*SETTING, "target", "rate"]))
    several = d[SETTING].drop_duplicates().shape[0] > 1

    def setting(card, model, B, n) -> str:
        return f"{card}, {model} B={B:g}, {n:,.0f} requests"

    def who(r) -> str:
        where = setting(*r[SETTING]) + ": " if several else ""
        return where + LABELS.get(r["target"], r["target"])

    head = pd.DataFrame({
        "target": [who(r) for _, r in d.iterrows()],
        "offered req/s": d["rate"].map(_offered),
        "req/s": [_cell(v, ".2f", ok == "✓") for v, ok in zip(d["req/s"], d["verified"])],
        "output tok/s": d["output tok/s"].map(lambda v: _cell(v, ",.0f")),
        "TTFT p99 ms": d["TTFT p99"].map(lambda v: _cell(v, ",.1f")),
        "TPOT p99 ms": d["TPOT p99"].map(lambda v: _cell(v, ",.2f")),
        "goodput req/s": d["goodput req/s"].map(lambda v: _cell(v, ".2f")),
        "SLOs": d["met"].map({True: "met", False: "missed"}),
    })
    sat = saturation(d)
    slos = sorted(set(d["SLO ms"]))
    note = ("Each row: the newest run of a target at one offered rate (a Poisson trace at that mean rate; all at "
            "once: every request at time 0); ✗ after req/s: the run did not verify. SLOs: p99 TTFT and p99 TPOT within "
            f"the run's objectives (TTFT / TPOT ms: {', '.join(slos)}); goodput counts the requests that met both. "
            "Saturation, the highest offered rate meeting the SLOs: "
            + "; ".join(f"{(setting(*k[:4]) + ', ' if several else '')}{LABELS.get(k[4], k[4])} {v}"
                        for k, v in sat.items()) + ".")
    full = _sort(rows(df)).assign(**{"offered req/s": lambda x: x["rate"].map(_offered),
                                     "target": lambda x: x["target"].map(lambda t: LABELS.get(t, t)),
                                     "SLOs": lambda x: x["met"].map({True: "met", False: "missed"}),
                                     "flags": lambda x: x["noisy"].map({True: "noisy", False: "—"})})
    cols = [*SETTING, "target", "offered req/s", "req/s", "output tok/s", "goodput req/s", "TTFT p50",
            "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99",
            "SLO ms", "SLOs", "verified", "flags"]
    fmt = {"B": ".0f", "requests": ",.0f", "req/s": ".2f", "output tok/s": ",.0f", "goodput req/s": ".2f", **{
        c: ",.1f" for c in ("TTFT p50", "TTFT p90", "TTFT p99", "E2E p50", "E2E p99")}, **{
        c: ",.2f" for c in ("TPOT p50", "TPOT p90", "TPOT p99", "ITL p50", "ITL p99")}}
    appendix = ("Times in ms (vllm bench serve's definitions: harness/latency_job.py). An ITL of 0: tokens that "
                "reached the host in one read (a lockstep run, or one SSE chunk).\n\n" + _md(full[cols], fmt))
    return _report(_grid(head), appendix, note=note), plot(d, sat)


def plot(d: pd.DataFrame, sat: dict):
    """p99 TTFT, p99 TPOT and output tok/s against offered load, one line per target (the first card, model and B),
    the SLOs dashed, each target's saturation point starred; all at once drawn right of the highest rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if d.empty:
        return None
    first = d.iloc[0][SETTING].tolist()
    g = d[_same(d, SETTING, first)]
    finite = g["rate"][~g["rate"].map(math.isinf)]
    top = float(finite.max()) if len(finite) else 1.0
    x_all = top * 2                                                      # where "all at once" is drawn
    xs = g["rate"].map(lambda r: x_all if math.isinf(r) else r)
    panels = (("TTFT p99", "p99 TTFT (ms)", "ttft"), ("TPOT p99", "p99 TPOT (ms)", "tpot"),
              ("output tok/s", "output tokens/s", None))
    slo = {"ttft": g["_slo_ttft"].min(), "tpot": g["_slo_tpot"].min()}   # the strictest where rows differ
    drawn = {}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.9))
    for ax, (col, ylabel, kind) in zip(axes, panels):
        for target in sorted(g["target"].unique(), key=_target_key):
            m = g["target"] == target
            x, y = list(xs[m]), list(g[col][m])
            label = LABELS.get(target, target)
            line, = ax.plot(x, y, marker="o", markersize=3.5, label=label)
            drawn[f"{col}|{label}"] = [x, y]
            rate = saturation_rate(d, (*first, target))
            if rate is not None:
                y_sat = g[col][m & (g["rate"] == rate)].iloc[0]
                ax.plot([rate], [y_sat], "*", color=line.get_color(), markersize=13,
                        label=f"{label} saturation" if kind == "ttft" else None)
                drawn[f"{col}|{label}|saturation"] = [rate, y_sat]
        if kind and pd.notna(slo[kind]):
            ax.axhline(slo[kind], color="grey", linestyle="--", linewidth=1, label="SLO")
            drawn[f"{col}|slo"] = slo[kind]
        ax.set_xscale("log", base=2)
        if kind:   # latencies grow by orders of magnitude past saturation
            ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.6g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ticks = sorted(set(finite)) + ([x_all] if (g["rate"].map(math.isinf)).any() else [])
        ax.set_xticks(ticks)
        ax.set_xticklabels([ALL_AT_ONCE.replace(" ", "\n") if t == x_all else f"{t:g}" for t in ticks], fontsize=7)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Latency under load, {first[1]} B={first[2]:g}, {first[3]:,.0f} requests ({first[0]})", fontsize=10)
    fig.tight_layout()
    fig.plot_digest = report.plot_digest(drawn=drawn, sat={str(k): v for k, v in sat.items()})
    return fig
