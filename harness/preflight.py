"""Everything a job can be refused for from its composed config, checked before any model loads: in a sweep for every
job at once, so a mistake in the third job stops the sweep before the first one measures anything."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from onepass.harness import gpu_pool
from onepass.kernels.errors import ConfigError


def unwritable(folder: str | Path) -> str | None:
    """Why `folder` cannot be created or written to (the nearest existing folder above it decides), else None.
    Nothing is created: a path holding ${now:} resolves to another second when Hydra makes it."""
    p = Path(folder).absolute()
    while not p.exists():
        if p.parent == p:
            return f"no part of {folder} exists"
        p = p.parent
    if not p.is_dir():
        return f"{p} is a file, not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def check_folder(key: str, folder: str | Path) -> None:
    if why := unwritable(folder):
        raise ConfigError(f"{key}={folder} cannot be written: {why}; give {key}=<a folder you can write to>")


def refuse(message: str) -> None:
    """Stop the app with one `[error]` line and exit status 2 (bad input): from a Hydra callback, where an exception
    would only become a warning."""
    print(f"[error] {message}", file=sys.stderr)
    sys.exit(2)


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


def check_job(cfg):
    """A job's composed config checked whole, before anything loads: no key outside the schema, every value resolved
    and typed, the job's own checks (its `check`), the spool folder writable. Returns the job it names."""
    if unknown := unknown_keys(cfg):
        raise ConfigError(f"unknown setting {', '.join(unknown)}: no such key in the config schema "
                          "(harness/schema.py); check its spelling (a `+` before a key adds it without that check)")
    try:
        OmegaConf.to_object(cfg)     # every value resolved and typed before anything loads
    except OmegaConfBaseException as e:
        raise ConfigError(f"the config does not resolve: {e}".splitlines()[0]) from None
    job = instantiate(cfg.job)
    if hasattr(job, "check"):
        job.check(cfg)
    if cfg.tracking.enabled:   # a run's record is spooled before it is logged
        check_folder("tracking.spool_dir", cfg.tracking.spool_dir)
    return job


def sweep_overrides(config) -> list[str]:
    """The sweep's overrides as typed (its experiment's sweeper params first): unresolved, since a value may hold an
    interpolation that only its job's config resolves (or that is the mistake to report)."""
    params = config.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=False) if params else {}
    return [f"{k}={v}" for k, v in params.items()] + OmegaConf.to_container(config.hydra.overrides.task, resolve=False)


def sweep_jobs(config) -> tuple[list[list[str]], list[str]] | None:
    """(each job's overrides, the keys the sweep varies) of a `-m` sweep, expanded as Hydra's basic sweeper will run
    them; None under another sweeper (which picks its jobs as it goes)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    overrides = parser.parse_overrides(sweep_overrides(config))
    swept = [o.get_key_element() for o in overrides if o.is_sweep_override()]
    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch], swept


def check_launch(config, jobs: int) -> None:
    """launch.gpus well formed, the pool's lock folder writable, and a joblib sweep of `jobs` that runs no more of them
    at once than the GPU pool has devices, unless they may share: a worker keeps the device its first job took
    (harness/gpu_pool.py), so one that found every device held would wait while the others ran the whole sweep.
    (submitit_local's jobs are processes of one job each: one waits for a device and gets it when another job ends.)"""
    devices = gpu_pool.pool(config.launch.gpus)
    launcher = config.hydra.launcher
    target = str(launcher.get("_target_", ""))
    if config.engine.device == "cpu" or not devices or not target.endswith(("JoblibLauncher", "LocalLauncher")):
        return
    check_folder(gpu_pool.LOCK_ENV, gpu_pool.lock_dir())
    if config.launch.share_gpus or not target.endswith("JoblibLauncher"):
        return
    n = 1 if launcher.get("n_jobs") is None else int(launcher.n_jobs)
    at_once = min(jobs, n if n > 0 else max(1, (os.cpu_count() or 1) + 1 + n))   # joblib's -1: every CPU
    if at_once > len(devices):
        raise ConfigError(f"hydra.launcher.n_jobs={n} runs {at_once} jobs at once on {len(devices)} GPU(s) "
                          f"({','.join(devices)}), and jobs do not share one: give hydra.launcher.n_jobs="
                          f"{len(devices)}, or launch.share_gpus=true to let jobs share a GPU")


def check_sweep(config, jobs: list[list[str]]) -> None:
    """Compose every job of a sweep and check it (check_job) before the first one runs: ConfigError naming the job."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import open_dict

    loader, outer = GlobalHydra.instance().config_loader(), HydraConfig.instance().cfg
    try:
        for num, overrides in enumerate(jobs):
            where = f"job {num} of the sweep ({' '.join(overrides).replace(chr(92), '')})"
            try:
                cfg = loader.load_sweep_config(config, overrides)
                HydraConfig.instance().set_config(cfg)     # ${hydra:...} in the job resolves as when it runs
                with open_dict(cfg):
                    del cfg["hydra"]
                check_job(cfg)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}; no job of the sweep ran") from None
            except (HydraException, OmegaConfBaseException) as e:
                raise ConfigError(f"{where} does not compose: {str(e).strip().splitlines()[0]}; no job of the sweep "
                                  "ran") from None
    finally:
        if outer is not None:
            HydraConfig.instance().set_config(outer)
