"""Sweeps whose jobs run side by side in processes of their own (issue 63): hydra/launcher=joblib |
submitit_local | submitit_slurm, a GPU of the pool for each job's process, and the sweep's parent run reaching jobs
in other processes."""
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus

from onepass.harness import gpu_pool
from onepass.harness.app import CONF_DIR
from onepass.harness.callbacks import MlflowSweepCallback
from onepass.harness.preflight import check_launch
from onepass.harness.tracking import PARENT_ENV, SWEEP_ENV, SWEPT_ENV
from onepass.kernels.errors import ConfigError


def hydra_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local", "submitit_slurm"])
def test_every_launcher_composes(launcher):
    cfg = hydra_cfg(f"hydra/launcher={launcher}")
    assert cfg.hydra.launcher._target_.startswith("hydra_plugins.")
    assert list(cfg.launch.gpus) == [] and cfg.launch.share_gpus is False


def test_the_pool_is_the_setting_else_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert gpu_pool.pool(["GPU-aa", 5]) == ["GPU-aa", "5"]
    assert gpu_pool.pool([]) == ["1", "3"]
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert gpu_pool.pool([]) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,2")   # CUDA stops at the first entry it cannot use
    assert gpu_pool.pool([]) == ["0"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                                               nvmlDeviceGetCount=lambda: 3))
    assert gpu_pool.pool([]) == ["0", "1", "2"]
    monkeypatch.setitem(sys.modules, "pynvml", None)   # a CPU machine: no NVML, an empty pool
    assert gpu_pool.pool([]) == []


@pytest.mark.parametrize("gpus, msg", [(["0", "0"], "names a device twice"), (["0,1"], "one device per entry")])
def test_a_malformed_gpu_list_is_refused(gpus, msg):
    with pytest.raises(ConfigError, match=msg):
        gpu_pool.pool(gpus)


def test_a_joblib_sweep_wider_than_the_pool_is_refused_unless_jobs_share(monkeypatch):
    """A loky worker keeps the GPU its first job took, so a worker more than the pool has devices would wait while
    the others ran the whole sweep: refused before any job, with the n_jobs that fits and the share flag."""
    two = ("hydra/launcher=joblib", "launch.gpus=[0,1]")
    with pytest.raises(ConfigError, match=r"n_jobs=3 runs 3 jobs at once on 2 GPU\(s\) \(0,1\).*n_jobs=2.*share_gpus"):
        check_launch(hydra_cfg(*two, "hydra.launcher.n_jobs=3"), jobs=4)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    with pytest.raises(ConfigError, match="n_jobs=-1 runs 3 jobs at once"):   # -1: every CPU, bounded by the jobs
        check_launch(hydra_cfg(*two), jobs=3)
    check_launch(hydra_cfg(*two, "hydra.launcher.n_jobs=3"), jobs=2)   # only two jobs to run
    check_launch(hydra_cfg(*two, "hydra.launcher.n_jobs=3", "launch.share_gpus=true"), jobs=4)
    check_launch(hydra_cfg(*two, "hydra.launcher.n_jobs=3", "engine.device=cpu"), jobs=4)
    check_launch(hydra_cfg("hydra/launcher=submitit_local", "launch.gpus=[0,1]"), jobs=4)   # its jobs wait
    check_launch(hydra_cfg("launch.gpus=[0,1]"), jobs=4)   # the basic launcher: one at a time


def test_a_lock_folder_that_cannot_be_written_is_refused_before_the_sweep(tmp_path, monkeypatch):
    (tmp_path / "a_file").touch()
    monkeypatch.setenv(gpu_pool.LOCK_ENV, str(tmp_path / "a_file" / "locks"))
    with pytest.raises(ConfigError, match=rf"ONEPASS_GPU_LOCK_DIR={tmp_path}/a_file/locks cannot be written"):
        check_launch(hydra_cfg("hydra/launcher=submitit_local", "launch.gpus=[0,1]"), jobs=2)
    check_launch(hydra_cfg("launch.gpus=[0,1]"), jobs=2)   # one job at a time takes no device


CLAIM = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from onepass.harness import gpu_pool
    gpu_pool.WAIT_S = 0.1
    print(gpu_pool.claim(["a", "b"], int(sys.argv[1]), sys.argv[2] == "share"), flush=True)
    while not Path(sys.argv[3]).exists():   # hold the device until told to end
        time.sleep(0.05)
""")


def test_processes_never_share_a_device_unless_allowed(tmp_path):
    """Each job process holds its device until it ends: a third finds both held and waits for the first to end; one
    allowed to share takes its own turn at once."""
    env = {**os.environ, gpu_pool.LOCK_ENV: str(tmp_path / "locks")}

    def start(num, share="own"):
        return subprocess.Popen([sys.executable, "-c", CLAIM, str(num), share, str(tmp_path / f"end{num}")],
                                env=env, stdout=subprocess.PIPE, text=True)

    first, second = start(0), start(1)
    assert (first.stdout.readline().strip(), second.stdout.readline().strip()) == ("a", "b")
    third, sharing = start(2), start(3, "share")
    assert sharing.stdout.readline().strip() == "b"        # job 3's turn: 3 % 2
    time.sleep(1.5)
    assert third.poll() is None
    (tmp_path / "end0").touch()
    assert first.wait(30) == 0
    assert third.stdout.readline().strip() == "a"
    for n in (1, 2, 3):
        (tmp_path / f"end{n}").touch()
    assert [p.wait(30) for p in (second, third, sharing)] == [0, 0, 0]


def _fail_job(cb: MlflowSweepCallback) -> None:
    ret = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom"), overrides=["batch.size=3"])
    cb.on_job_end(config=SimpleNamespace(hydra=SimpleNamespace(job=SimpleNamespace(num=2))), job_return=ret)


def test_a_job_failed_in_another_process_is_counted_by_the_sweep(tmp_path):
    """on_job_end runs in the job's process, on the launcher's pickled copy of the callback: the sweep's own copy
    counted none of a joblib or submitit sweep's failed jobs."""
    cb = MlflowSweepCallback()
    cb.pid, cb.sweep_dir, cb.sweep_id = os.getpid(), tmp_path, "s1"
    child = multiprocessing.get_context("fork").Process(target=_fail_job, args=(cb,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    cb.on_multirun_end(config=None)
    assert cb.failed == 1


def test_a_job_elsewhere_gets_the_sweeps_ids_and_its_server(monkeypatch, caplog):
    """A SLURM job may start without the sweep's environment: the callback that comes with the job sets the sweep's ids,
    and MLFLOW_TRACKING_URI for tracking=server, before the job reads its config; a job that would log elsewhere says
    its run will not nest."""
    for var in (PARENT_ENV, SWEEP_ENV, SWEPT_ENV, "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_JOB_ID", "1")   # the scheduler gave the job its GPUs: none is taken
    cb = MlflowSweepCallback()
    cb.pid, cb.parent, cb.uri, cb.sweep_id, cb.swept = -1, "p1", "http://tracking.example:5000", "s1", "batch.size"
    cfg, visible = hydra_cfg("tracking=server", "launch.gpus=[0]"), os.environ.get("CUDA_VISIBLE_DEVICES")
    cb.on_job_start(config=cfg)
    assert (os.environ[PARENT_ENV], os.environ[SWEEP_ENV], os.environ[SWEPT_ENV]) == ("p1", "s1", "batch.size")
    assert cfg.tracking.uri == "http://tracking.example:5000" and os.environ.get("CUDA_VISIBLE_DEVICES") == visible
    assert "will not nest" not in caplog.text
    cb.uri = "http://elsewhere:5000"
    cb.on_job_start(config=cfg)
    assert "logs to http://tracking.example:5000, but its sweep's parent run is in http://elsewhere:5000" in caplog.text


TWO_SWEEPS = textwrap.dedent("""
    import sys
    from onepass.harness import app
    d = sys.argv[1]
    for i in range(2):
        sys.argv = ["onepass", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "launch.gpus=[7,9]",
                    "model=tiny-llama", "batch.size=1,2", "workload.max_new_tokens=4", "measure.repeats=1",
                    "progress=false", f"tracking.uri=sqlite:///{d}/mlflow.db", f"tracking.spool_dir={d}/spool",
                    f"hydra.sweep.dir={d}/multirun{i}"]
        try:
            app.main()
        except SystemExit as e:
            assert not e.code, e.code
""")


def test_sweeps_in_one_process_nest_under_their_own_parent_on_their_own_gpus(tmp_path):
    """joblib keeps its loky workers for the next sweep of the process, with the environment they started with: the
    second sweep's jobs were logged as children of the first sweep's parent run, under its sweep id. The ids now
    come with the job. Each worker holds its own device of the pool (launch.gpus; CPU here, so only the setting
    is seen), and jobs that ran at the same time never had the same one."""
    env = {**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache"), gpu_pool.LOCK_ENV: str(tmp_path / "locks")}
    r = subprocess.run([sys.executable, "-c", TWO_SWEEPS, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    df = mlflow.search_runs(search_all_experiments=True)
    parents = df[df["tags.onepass.kind"] == "sweep"]
    children = df[df["tags.onepass.kind"] != "sweep"]
    assert len(parents) == 2 and len(children) == 4
    for _, parent in parents.iterrows():
        mine = children[children["tags.mlflow.parentRunId"] == parent["run_id"]]
        assert sorted(mine["params.batch.size"]) == ["1", "2"]
        assert set(mine["tags.sweep_id"]) == {parent["tags.sweep_id"]}
    assert set(children["tags.cuda_visible_devices"]) <= {"7", "9"}
    spans = [(r["start_time"], r["end_time"], r["tags.cuda_visible_devices"]) for _, r in children.iterrows()]
    for i, (s1, e1, d1) in enumerate(spans):
        for s2, e2, d2 in spans[i + 1:]:
            assert d1 != d2 or e1 <= s2 or e2 <= s1, spans
    assert (Path(tmp_path) / "multirun1" / "multirun.yaml").is_file()


def test_a_wider_joblib_sweep_is_one_error_line(tmp_path):
    args = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "launch.gpus=[0]", "model=tiny-llama",
            "batch.size=1,2", "tracking=off", f"hydra.sweep.dir={tmp_path}/multirun"]
    r = subprocess.run([sys.executable, "-m", "onepass.harness", *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "[error] hydra.launcher.n_jobs=2 runs 2 jobs at once on 1 GPU(s) (0)" in r.stderr
    assert "Traceback" not in r.stderr and "[verify]" not in r.stdout
