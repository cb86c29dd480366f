"""What the app does with a composed config: check it whole, make the job its `job` node names (`_target_`), and
record every run the job yields, each as soon as it is measured."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from onepass.harness.record import record_run
from onepass.kernels.errors import ConfigError


@dataclass
class RunRecord:
    """One measured run: what the store gets besides the config."""

    name: str
    device: torch.device
    metrics: dict
    tags: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)
    cfg: object = None      # the config logged as its params, where it is not the job's (int4_gemm: one per shape)


class Job(Protocol):
    def run(self, cfg) -> Iterator[RunRecord]: ...


def unknown_keys(node, prefix: str = "") -> list[str]:
    """Keys of a schema-backed config node that its dataclass does not declare (`+batch.sise=4` adds one: Hydra
    accepts a `+` key where the schema would refuse the same key without it)."""
    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return []
    declared = {f.name for f in dataclasses.fields(kind)}
    out = []
    for key in node.keys():
        if key not in declared:
            out.append(f"{prefix}{key}")
        elif isinstance(node._get_node(key), DictConfig):
            out += unknown_keys(node._get_node(key), f"{prefix}{key}.")
    return out


def run_job(cfg, out_dir: Path) -> float:
    """Run the job `cfg.job` names and record its runs; returns the last run's throughput (the sweep's value)."""
    if unknown := unknown_keys(cfg):
        raise ConfigError(f"unknown setting {', '.join(unknown)}: no such key in the config schema "
                          "(harness/schema.py); check its spelling (a `+` before a key adds it without that check)")
    try:
        OmegaConf.to_object(cfg)     # every value resolved and typed before anything loads
    except OmegaConfBaseException as e:
        raise ConfigError(f"the config does not resolve: {e}".splitlines()[0]) from None
    job: Job = instantiate(cfg.job)
    last = 0.0
    for r in job.run(cfg):
        record_run(r.cfg if r.cfg is not None else cfg, r.name, r.device, r.metrics, r.tags, r.artifacts, out_dir)
        last = float(r.metrics.get("throughput_tok_s", last))
    return last
