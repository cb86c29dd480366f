"""A job's run record: its config, metrics, tags and artifacts, with where and on what it ran, handed to tracking
(logged to MLflow, or spooled when the store cannot be reached)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
from omegaconf import OmegaConf

from onepass.harness import tracking


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()} x{torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def experiment_file() -> str | None:
    """The conf/experiment file this job was composed from (several files may feed one table)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("experiment")


def sweep_tags(cfg) -> dict[str, str]:
    """The tags that place a run: its table, its sweep and the experiment file it was composed from."""
    tags = {"table": cfg.table}
    if os.environ.get(tracking.SWEEP_ENV):
        tags["sweep_id"] = os.environ[tracking.SWEEP_ENV]
    if exp_file := experiment_file():
        tags["experiment_file"] = exp_file
    return tags


def run_name(cfg, name: str) -> str:
    """The job's run name with what varies across its sweep first (`B=32 smollm2-135m static`): the UI cuts long
    names at the end, and the part that tells the sweep's runs apart must stay in view."""
    varying = []
    for key in filter(None, os.environ.get(tracking.SWEPT_ENV, "").split(",")):
        label = "B" if key == "batch.size" else key.rsplit(".", 1)[-1]
        part = f"{label}={OmegaConf.select(cfg, key)}"
        if part not in name.split():
            varying.append(part)
    return " ".join([*varying, name])


def params_of(cfg, sections: tuple[str, ...] | None) -> dict[str, str]:
    """The config sections a job reads (all of them where the job does not say), flattened as the run's params."""
    tree = OmegaConf.to_container(cfg, resolve=True)
    if sections is not None:
        tree = {k: v for k, v in tree.items() if k in sections}
    return tracking.flatten(tree)


def record_run(cfg, name: str, dev: torch.device | str, metrics: dict, tags: dict, artifacts: dict, out_dir: Path,
               live: tracking.LiveRun | None = None, sections: tuple[str, ...] | None = None) -> None:
    """dev: the device, or its name as the job's own process gave it (harness/isolate.py)."""
    tags = {**sweep_tags(cfg), "device": dev if isinstance(dev, str) else device_name(dev),
            "torch_version": torch.__version__, "triton_version": triton_version(), **tags, **tracking.git_state()}
    record = tracking.new_record(run_name(cfg, name), cfg.tracking.experiment, params_of(cfg, sections),
                                 {**tracking.standard_tags(), **tags}, live)
    record["metrics"] = metrics
    record["artifacts"] = {"config.yaml": OmegaConf.to_yaml(cfg, resolve=True), **artifacts}
    record["status"] = "FINISHED"
    tracking.finish(record, cfg.tracking, out_dir, live)


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"
