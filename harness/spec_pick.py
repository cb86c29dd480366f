"""speculative.k_pick=measured: the k of draft tokens a step that the recorded spec_decode table picks for a model at
a batch size, so speculation never costs more than it gives where its acceptance is fair.

Rule: among the recorded k whose speed-up over the batch without drafts is at least MIN_SPEEDUP at acceptance 0.5,
the one with the best speed-up at acceptance 0.7 (0.5 and 0.7 bracket the acceptance published for this family's MTP
heads); none: 0, speculation off at that batch. Rows of the batch size recorded nearest above B are used (the largest
recorded one beyond it), on this card where it has rows, on any card otherwise (the pick says which).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from onepass.kernels.errors import ConfigError

TABLE = Path(__file__).resolve().parents[1] / "experiments" / "spec_decode" / "runs.csv"
MIN_SPEEDUP = 0.95
FAIR, LIKELY = 0.5, 0.7
# the recorded rows that stand for each method: scripted drafts set the acceptance at the cost of a draft source that
# costs nothing (prompt lookup); mtp_scripted at the MTP head's cost
FAMILY = {"ngram": "scripted", "scripted": "scripted", "mtp": "mtp_scripted", "mtp_scripted": "mtp_scripted"}


def measured_k(model: str, method: str, batch: int, card: str | None = None, table: Path = TABLE) -> tuple[int, str]:
    """(k, why) for `model` with drafts of `method` at `batch` slots."""
    fix = f"record its rows first (onepass -m experiment=spec_decode model={model} ...; onepass-report spec_decode " \
          "--record --merge), or set speculative.k and speculative.k_pick=fixed"
    df = pd.read_csv(table) if Path(table).is_file() else pd.DataFrame()
    need = {"params.model.name", "params.speculative.method", "params.speculative.acceptance", "params.batch.size",
            "params.speculative.k", "metrics.speedup_vs_nonspec", "metrics.verify_ok"}
    if df.empty or not need <= set(df.columns):
        raise ConfigError(f"speculative.k_pick=measured reads {table}, which holds no spec_decode rows; {fix}")
    df = df[(df["params.model.name"] == model) & (df["params.speculative.method"] == FAMILY[method])
            & (df["metrics.verify_ok"] == 1)]
    if df.empty:
        raise ConfigError(f"speculative.k_pick=measured: no verified {FAMILY[method]} rows of model {model} in "
                          f"{table}; {fix}")
    where = "any card"
    if card is not None and "tags.device" in df and (df["tags.device"] == card).any():
        df, where = df[df["tags.device"] == card], card
    bs = sorted(df["params.batch.size"].astype(int).unique())
    b = next((x for x in bs if x >= batch), bs[-1])
    rows = df[df["params.batch.size"].astype(int) == b]
    speed = rows.groupby(["params.speculative.k", "params.speculative.acceptance"])["metrics.speedup_vs_nonspec"] \
        .median().unstack()
    if FAIR not in speed.columns or LIKELY not in speed.columns:
        raise ConfigError(f"speculative.k_pick=measured: the {FAMILY[method]} rows of {model} at B={b} lack "
                          f"acceptance {FAIR} or {LIKELY}; {fix}")
    safe = speed[speed[FAIR] >= MIN_SPEEDUP]
    about = f"{FAMILY[method]} rows of {model} at B={b} on {where}"
    if safe.empty:
        return 0, (f"no k keeps {MIN_SPEEDUP}x at acceptance {FAIR} ({about}: best {speed[FAIR].max():.2f}x): "
                   "speculation off")
    k = int(safe[LIKELY].idxmax())
    return k, (f"k={k}: {safe.loc[k, LIKELY]:.2f}x at acceptance {LIKELY}, {safe.loc[k, FAIR]:.2f}x at {FAIR} "
               f"({about})")
