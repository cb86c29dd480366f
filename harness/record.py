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


def record_run(cfg, name: str, dev: torch.device, metrics: dict, tags: dict, artifacts: dict, out_dir: Path) -> None:
    tags = {"table": cfg.table, "device": device_name(dev), "torch_version": torch.__version__,
            "triton_version": triton_version(), **tags, **tracking.git_state()}
    if os.environ.get(tracking.SWEEP_ENV):
        tags["sweep_id"] = os.environ[tracking.SWEEP_ENV]
    if exp_file := experiment_file():
        tags["experiment_file"] = exp_file
    record = tracking.new_record(name, cfg.tracking.experiment,
                                 tracking.flatten(OmegaConf.to_container(cfg, resolve=True)), tags)
    record["metrics"] = metrics
    record["artifacts"] = {"config.yaml": OmegaConf.to_yaml(cfg, resolve=True), **artifacts}
    record["status"] = "FINISHED"
    tracking.finish(record, cfg.tracking, out_dir)


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"
