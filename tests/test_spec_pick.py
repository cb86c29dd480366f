"""speculative.k_pick=measured (harness/spec_pick.py): the k a recorded spec_decode table picks at a batch size."""
import pandas as pd
import pytest

from onepass.harness.spec_pick import measured_k
from onepass.kernels.errors import ConfigError

# speed-up over no drafts by (B, k) at acceptance 0.5 and 0.7, as a recorded table would hold them
SPEED = {(1, 1): (1.20, 1.40), (1, 2): (1.30, 1.70), (1, 3): (1.25, 1.90),
         (8, 1): (1.05, 1.20), (8, 2): (0.97, 1.36), (8, 3): (0.90, 1.50),
         (32, 1): (0.90, 1.02), (32, 2): (0.82, 1.04)}


def table(tmp_path, rows=SPEED, model="qwen3.8-27b", method="mtp_scripted", device="NVIDIA H200", ok=1):
    recs = []
    for (b, k), (s05, s07) in rows.items():
        for acc, s in ((0.0, 0.8), (0.5, s05), (0.7, s07), (1.0, 2.0)):
            recs.append({"params.model.name": model, "params.speculative.method": method, "params.batch.size": b,
                         "params.speculative.k": k, "params.speculative.acceptance": acc,
                         "metrics.speedup_vs_nonspec": s, "metrics.verify_ok": ok, "tags.device": device})
    path = tmp_path / "runs.csv"
    pd.DataFrame(recs).to_csv(path, index=False)
    return path


def test_pick_is_the_best_at_0_7_among_those_safe_at_0_5(tmp_path):
    t = table(tmp_path)
    assert measured_k("qwen3.8-27b", "mtp", 1, "NVIDIA H200", t)[0] == 3
    k, why = measured_k("qwen3.8-27b", "mtp", 8, "NVIDIA H200", t)
    assert k == 2 and "1.36x at acceptance 0.7" in why and "on NVIDIA H200" in why   # k = 3 is 0.90x at 0.5
    k, why = measured_k("qwen3.8-27b", "mtp", 32, None, t)
    assert k == 0 and "speculation off" in why
    # a batch between recorded ones takes the next recorded one above it; beyond the largest, the largest
    assert measured_k("qwen3.8-27b", "mtp_scripted", 4, None, t)[0] == 2
    assert measured_k("qwen3.8-27b", "mtp", 128, None, t)[0] == 0
    # rows of another card are used when this card has none, and the pick says so
    assert "on any card" in measured_k("qwen3.8-27b", "mtp", 8, "NVIDIA H100 80GB HBM3", t)[1]


def test_pick_refusals(tmp_path):
    with pytest.raises(ConfigError, match="holds no spec_decode rows.*k_pick=fixed"):
        measured_k("m", "mtp", 8, None, tmp_path / "absent.csv")
    t = table(tmp_path)
    with pytest.raises(ConfigError, match="no verified scripted rows of model qwen3.8-27b"):
        measured_k("qwen3.8-27b", "ngram", 8, None, t)    # prompt lookup reads the scripted rows
    with pytest.raises(ConfigError, match="no verified mtp_scripted rows"):
        measured_k("qwen3.8-27b", "mtp", 8, None, table(tmp_path, ok=0))


def test_the_setting_is_checked_before_anything_loads():
    from hydra import compose, initialize_config_dir

    from onepass.harness.app import CONF_DIR
    from onepass.harness.checks import check_speculative

    def cfg_of(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    with pytest.raises(ConfigError, match="k_pick='best'; choose fixed"):
        check_speculative(cfg_of("speculative=ngram", "speculative.k_pick=best"))
    with pytest.raises(ConfigError, match="job=spec_decode measures every k"):
        check_speculative(cfg_of("experiment=spec_decode", "speculative.k_pick=measured"))
    check_speculative(cfg_of("speculative=ngram", "speculative.k_pick=measured"))
