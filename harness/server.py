"""`onepass-serve [overrides]`: an OpenAI-compatible HTTP endpoint over the continuous-batching engine.

    onepass-serve model=smollm2-135m batch.size=32 kv_cache=paged kv_cache.prefix=auto serve.port=8000

The overrides are the `onepass` app's (conf/), composed with Hydra's compose API, plus a `serve` section; the engine is
built as a job builds it (harness/build.py) and serves through its kv_cache and scheduler groups (harness/serve_job.py
`setup_of`), continuous batching over a paged pool unless those groups are named. One engine thread runs the serving
loop for the server's life (harness/server_engine.py); the routes are harness/server_api.py. `start_server` starts the
same server in-process on an engine already built (a benchmark's). SIGINT or SIGTERM stops it gracefully: open
requests get serve.drain_s seconds to finish, then are cancelled; a second SIGINT stops at once.
"""
from __future__ import annotations

import gc
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from onepass.engine.sampler import SamplingParams
from onepass.engine.serving_setup import ServingSetup
from onepass.kernels.errors import ConfigError, OnepassError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"   # as harness/app.py finds it, without importing the app
SERVING_GROUPS = {"scheduler": "continuous", "kv_cache": "paged"}   # a server's defaults for the job's groups
USAGE = __doc__.split("\n\n")[1]


@dataclass
class ServeCfg:
    host: str = "127.0.0.1"         # 0.0.0.0: every interface
    port: int = 8000                # 0: any free port (printed)
    model_name: Optional[str] = None   # the model's id in /v1/models and in requests; None: model.name
    max_tokens: int = 256           # a request's max_tokens when it gives none (within what its context leaves)
    drain_s: float = 30.0           # at shutdown, seconds open requests get to finish before they are cancelled


def _serve_schema():
    from onepass.harness.schema import RunCfg

    @dataclass
    class ServeRunCfg(RunCfg):
        serve: ServeCfg = field(default_factory=ServeCfg)

    return RunCfg, ServeRunCfg


def compose(overrides: list[str]):
    """The config of `onepass-serve overrides`: conf/config.yaml's groups and a typed serve section (a wrong key or
    type fails here, naming it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from onepass.harness.schema import register

    register()
    run_cfg, serve_cfg = _serve_schema()
    named = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    defaults = [f"{g}={v}" for g, v in SERVING_GROUPS.items() if g not in named]
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=serve_cfg)   # for this composition only: the onepass app's schema has no serve
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="onepass-serve"):
            return hydra_compose(config_name="config", overrides=defaults + list(overrides))
    finally:
        cs.store(name="run_schema", node=run_cfg)


def check(cfg) -> None:
    """What a server refuses before the model loads."""
    from onepass.harness.build import resolve_engine
    from onepass.harness.checks import check_kv_cache, check_speculative

    s = cfg.serve
    if cfg.scheduler.mode not in ("continuous", "wave"):
        raise ConfigError(f"scheduler.mode={cfg.scheduler.mode}: a server takes requests as they come; use "
                          "scheduler=continuous (or wave)")
    if cfg.batch.size < 1:
        raise ConfigError(f"batch.size={cfg.batch.size}; need at least one slot")
    if s.max_tokens < 1:
        raise ConfigError(f"serve.max_tokens={s.max_tokens}: a request's default completion, at least 1 token")
    if not 0 <= s.port < 65536:
        raise ConfigError(f"serve.port={s.port}; a TCP port, or 0 for any free one")
    if cfg.speculative.method in ("scripted", "mtp_scripted"):
        raise ConfigError(f"speculative={cfg.speculative.method} replays a known future; a server has none: use "
                          "speculative=ngram, mtp or off")
    check_kv_cache(cfg.kv_cache, resolve_engine(cfg.engine)[2])
    check_speculative(cfg)


class OpenAIServer:
    """uvicorn on a thread of its own over an EngineLoop: `start()` gives the base URL, `stop()` shuts both down."""

    def __init__(self, engine, setup: ServingSetup, sampling: SamplingParams, model_name: str,
                 host: str = "127.0.0.1", port: int = 0, max_tokens: int = 256, sample_on_device: bool = True,
                 drain_s: float = 30.0):
        import uvicorn

        from onepass.harness.server_api import OpenAIAPI
        from onepass.harness.server_engine import EngineLoop

        self.sock = _bind(host, port)   # first: a port taken is refused before the pool is allocated
        self.loop = EngineLoop(engine, setup, sampling, sample_on_device)
        self.api = OpenAIAPI(self.loop, model_name, max_tokens)
        # log_config=None: uvicorn leaves the process's logging as it found it (a benchmark's, a test's)
        config = uvicorn.Config(self.api.app, log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=drain_s)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]},
                                       name="onepass-http", daemon=True)
        self.drain_s = drain_s
        bound, port = self.sock.getsockname()[:2]
        bound = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound, bound)
        self.url = f"http://[{bound}]:{port}" if ":" in bound else f"http://{bound}:{port}"

    @property
    def runner(self):
        return self.loop.runner

    def start(self, timeout: float = 60.0) -> str:
        # what the process holds by now (the engine, its model, the app) stays: out of the collector's sight, so a
        # full collection, which stops both threads, scans what serving made rather than the whole heap
        gc.collect()
        gc.freeze()
        self.loop.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        """Stop taking requests, give open ones drain_s to finish, cancel the rest and join both threads."""
        self.uvicorn.should_exit = True
        if self.thread.is_alive():
            self.thread.join(self.drain_s + 5)
        self.loop.stop()
        self.sock.close()
        gc.unfreeze()   # the process goes on (a benchmark's job): its heap is the collector's again


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); give serve.host / serve.port another "
                          "address, or serve.port=0 for any free port") from None


def start_server(engine, setup: ServingSetup, sampling: SamplingParams, model_name: str, host: str = "127.0.0.1",
                 port: int = 0, **settings) -> tuple[str, Callable[[], None]]:
    """Serve an engine already built, in this process: (base URL with the port bound, a function that stops the
    server and its engine thread). settings: OpenAIServer's max_tokens, sample_on_device, drain_s."""
    server = OpenAIServer(engine, setup, sampling, model_name, host, port, **settings)
    return server.start(), server.stop


def server_of(cfg) -> OpenAIServer:
    """The server a composed config describes, its engine built as a job's."""
    from onepass.harness.build import build, draft_source, sampling_params
    from onepass.harness.serve_job import setup_of

    check(cfg)
    sampling = sampling_params(cfg)
    engine = build(cfg)
    drafts, k = draft_source(cfg, engine.cfg.vocab_size)
    s = cfg.serve
    return OpenAIServer(engine, setup_of(cfg, engine, drafts, k), sampling, s.model_name or cfg.model.name, s.host,
                        s.port, s.max_tokens, cfg.sampling.on_device, s.drain_s)


def main(argv: list[str] | None = None) -> None:
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(f"usage: onepass-serve [overrides]\n\n{USAGE}\n\nthe serve section and its defaults:\n"
              f"{OmegaConf.to_yaml(OmegaConf.structured(ServeCfg))}")
        return
    try:
        cfg = compose([a for a in argv if a != "--cfg"])
        if "--cfg" in argv:
            print(OmegaConf.to_yaml(cfg))
            return
        server = server_of(cfg)
        url = server.start()
    except (OnepassError, HydraException, OmegaConfBaseException) as e:   # a bad override or setting: no traceback
        cause = f" ({str(e.__cause__).splitlines()[0]})" if e.__cause__ is not None else ""
        print(f"[error] {e}{cause}", file=sys.stderr)
        sys.exit(2)
    e = server.loop.engine
    print(f"[serve] {server.api.model_name} ({e.cfg.arch}, {e.device}, {e.backend} kernels): batch {e.spec.batch}, "
          f"context {e.spec.ctx}, {cfg.scheduler.mode} scheduler, {cfg.kv_cache.layout} KV (prefix "
          f"{cfg.kv_cache.prefix}), sampling {'greedy' if server.loop.sampling.greedy else server.loop.sampling}; "
          f"OpenAI API at {url}/v1", flush=True)
    stopping = threading.Event()
    caught: list[int] = []

    def on_signal(signum, frame):
        caught.append(signum)
        if len(caught) > 1 and signum == signal.SIGINT:
            raise KeyboardInterrupt   # a second Ctrl-C: no more waiting for open requests
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while not stopping.wait(1.0):
        if not server.loop.alive:
            print(f"[error] {server.loop.arrivals.failure}", file=sys.stderr)
            server.stop()
            sys.exit(1)
    print(f"[serve] stopping: open requests get {server.drain_s:g} s to finish (Ctrl-C again: at once)", flush=True)
    try:
        server.stop()
    except KeyboardInterrupt:
        print("[serve] stopped at once: open requests were cut off", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main(sys.argv[1:])
