"""A real MLflow tracking server for tests, as a team runs one (README, Tracking): PostgreSQL on a temporary data folder
and a free loopback port, and `mlflow server` on it serving artifacts from a temporary folder. The server can be
stopped and started again on the same port and database, as a store that goes away during a sweep and comes back."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# Debian keeps PostgreSQL's programs out of PATH, one folder per major version
PG_FOLDERS = ("/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin", "/opt/homebrew/bin")
START_S = 120   # a fresh PostgreSQL database gets MLflow's schema on the server's first start


class Unavailable(RuntimeError):
    """PostgreSQL cannot be found or started here: the tests that need it skip, saying why."""


def pg_bin() -> Path:
    """The folder holding initdb and pg_ctl."""
    found = [shutil.which("initdb")] + sorted(glob.glob(f"{PG_FOLDERS[0]}/initdb"), reverse=True) + \
        [f"{d}/initdb" for d in PG_FOLDERS[1:]]
    for initdb in filter(None, found):
        folder = Path(initdb).resolve().parent
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    raise Unavailable("PostgreSQL is not installed (no initdb and pg_ctl on PATH or in /usr/lib/postgresql/*/bin); "
                      "apt-get install postgresql")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrackingServer:
    def __init__(self, artifacts: Path):
        self.bin = pg_bin()
        self.artifacts, self.proc, self.log = artifacts, None, artifacts.parent / "mlflow-server.log"
        # initdb refuses to run as root: then the database runs as the postgres account, in a folder it owns
        self.user = None
        if os.geteuid() == 0:
            try:
                self.user = pwd.getpwnam("postgres")
            except KeyError:
                raise Unavailable("running as root, and initdb refuses root; there is no postgres account to run "
                                  "PostgreSQL as") from None
        self.data_root = Path(tempfile.mkdtemp(prefix="onepass-pg-"))
        if self.user is not None:
            os.chown(self.data_root, self.user.pw_uid, self.user.pw_gid)
        self.db_port, self.port = free_port(), free_port()
        self.uri = f"http://127.0.0.1:{self.port}"

    def _pg(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        who = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []} if self.user else {}
        return subprocess.run([str(self.bin / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout,
                              cwd=self.data_root, **who)

    def start_database(self) -> None:
        data = self.data_root / "data"
        made = self._pg("initdb", "-D", str(data), "-U", "onepass", "--auth=trust", "-E", "UTF8", "--no-sync")
        if made.returncode != 0:
            raise Unavailable(f"initdb failed: {(made.stderr or made.stdout).strip()[-500:]}")
        opts = (f"-p {self.db_port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.data_root} "
                "-c fsync=off -c full_page_writes=off")
        up = self._pg("pg_ctl", "-D", str(data), "-o", opts, "-l", str(self.data_root / "postgres.log"), "-w",
                      "-t", "60", "start")
        if up.returncode != 0:
            log = (self.data_root / "postgres.log").read_text()[-500:] if (self.data_root / "postgres.log").is_file() \
                else ""
            raise Unavailable(f"PostgreSQL did not start: {(up.stderr or up.stdout).strip()[-300:]} {log}")

    def start(self) -> None:
        """`mlflow server` on the database, answering /health."""
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}   # no job runner processes beside it
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                 f"postgresql+psycopg2://onepass@127.0.0.1:{self.db_port}/postgres", "--serve-artifacts",
                 "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1", "--port", str(self.port),
                 "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health in {START_S} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """Stop the server and the workers it started (its own process group)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        try:   # uvicorn's worker may outlive the server process by a moment
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def close(self) -> None:
        self.stop()
        if (self.data_root / "data" / "postmaster.pid").is_file():
            self._pg("pg_ctl", "-D", str(self.data_root / "data"), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self.data_root, ignore_errors=True)
