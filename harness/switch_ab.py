"""A/B of module switches on decode steps, in one process: `python -m onepass.harness.switch_ab OVERRIDES... --switch
MODULE.ATTR=A,B [--switch ...] [--batches 8,32] [--tokens 32] [--reps 2]`.

A kernel change behind a module constant (kernels/int4_wgmma_ws.py's X_IN_GEMM_MAX_BT, FRESH_MIN_BT, ...) is judged
by the model's step time, and two separate jobs differ by more than such a change moves (clocks, another
machine). Here one model is built once (Hydra overrides as for `onepass`, e.g. experiment=hybrid_27b_q4) and, per
batch size, every combination of the switches' values gets a fresh step (new CUDA graphs, kernels compiled
for the values) and a static-batch run, in ABAB order over --reps rounds. Printed per variant: the best p50 step
time over the rounds, its ratio to the first variant (every switch at its first value), and whether its greedy
tokens equal the first variant's (a switch meant to keep the bits must say true). Timing only: nothing is logged
to MLflow; a change that wins is then recorded by the experiment itself.

After each change the touched module's functools caches are cleared (compiled-kernel caches keyed without the
switch), and every switch is restored to its original value at the end.

A value written @PATH is the attribute's literal value as assigned at the top level of the Python file PATH, e.g.
an earlier revision of the module (`git show REV:kernels/int4_measured.py > old.py`, then
`--switch kernels.int4_dispatch.MEASURED=@old.py,@kernels/int4_measured.py` compares two dispatch
tables); such a value is printed by its path. MODULE is named inside the onepass package (kernels.gemm) or in
full (onepass.kernels.gemm).
"""
from __future__ import annotations

import argparse
import ast
import gc
import importlib
import itertools
import statistics
import sys
from dataclasses import dataclass

import torch
from hydra.errors import ConfigCompositionException

from onepass.kernels.errors import ConfigError


@dataclass
class Switch:
    """One module attribute and the values to try (the first is the baseline)."""
    path: str
    owner: object
    attr: str
    module: object
    values: list
    original: object
    labels: list | None = None     # how each value is printed (its @PATH where it came from a file)

    def set(self, value) -> None:
        setattr(self.owner, self.attr, value)
        for obj in vars(self.module).values():   # compiled-kernel caches that do not key on the switch
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text            # a bare word: a string value


def value_from_file(path: str, attr: str):
    """The literal value assigned to attr at the top level of the Python file path (the last assignment)."""
    try:
        tree = ast.parse(open(path).read(), filename=path)
    except OSError as e:
        raise ConfigError(f"--switch value @{path}: cannot read it ({e.strerror})") from None
    except SyntaxError as e:
        raise ConfigError(f"--switch value @{path}: not a Python file ({e.msg}, line {e.lineno})") from None
    found = None
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
            found = node.value
    if found is None:
        raise ConfigError(f"--switch value @{path}: no top-level assignment to {attr!r} there")
    try:
        return ast.literal_eval(found)
    except ValueError:
        raise ConfigError(f"--switch value @{path}: {attr} is not a literal there (line {found.lineno})") from None


def _module(name: str):
    """The module `name` names inside the onepass package (kernels.gemm) or in full (onepass.kernels.gemm); None
    when neither imports."""
    for full in ([name] if name.split(".")[0] == "onepass" else ["onepass." + name, name]):
        try:
            return importlib.import_module(full)
        except ModuleNotFoundError:
            continue
    return None


def parse_switch(spec: str) -> Switch:
    """'pkg.module.Attr[.attr]=v1,v2,...' -> Switch. The longest importable prefix is the module; the rest is an
    attribute chain ending at the switch."""
    path, eq, values = spec.partition("=")
    parts = path.split(".")
    if not eq or len(parts) < 2:
        raise ConfigError(f"--switch {spec!r}: write MODULE.ATTR=V1,V2 "
                          "(e.g. kernels.int4_wgmma_ws.X_IN_GEMM_MAX_BT=8,0)")
    texts = [v.strip() for v in values.split(",") if v.strip()]
    vals = [value_from_file(t[1:], parts[-1]) if t.startswith("@") else _value(t) for t in texts]
    labels = [t if t.startswith("@") else None for t in texts]
    if len(vals) < 2:
        raise ConfigError(f"--switch {spec!r}: give at least two values to compare, the baseline first")
    for cut in range(len(parts) - 1, 0, -1):
        module = _module(".".join(parts[:cut]))
        if module is None:
            continue
        owner = module
        for name in parts[cut:-1]:
            if not hasattr(owner, name):
                raise ConfigError(f"--switch {spec!r}: {type(owner).__name__} {owner!r} has no attribute {name!r}")
            owner = getattr(owner, name)
        if not hasattr(owner, parts[-1]):
            raise ConfigError(f"--switch {spec!r}: {'.'.join(parts[:-1])} has no attribute {parts[-1]!r}; a switch "
                              "must already exist (a typo would otherwise time the baseline twice)")
        return Switch(path, owner, parts[-1], module, vals, getattr(owner, parts[-1]), labels)
    raise ConfigError(f"--switch {spec!r}: no importable module in {path!r}")


def variant_name(switches: list[Switch], combo: tuple) -> str:
    def label(s: Switch, v) -> str:
        at = next((lab for lab, x in zip(s.labels or [], s.values) if x is v and lab), None)
        return at or repr(v)
    return ", ".join(f"{s.attr}={label(s, v)}" for s, v in zip(switches, combo))


def run_ab(overrides: list[str], switches: list[Switch], batches: list[int], tokens: int = 32, reps: int = 2,
           out=print) -> list[dict]:
    """The A/B itself; returns one row per (B, variant): best and every p50 step time (ms), ratio to the baseline,
    and whether the tokens equal the baseline's."""
    from hydra import compose, initialize_config_dir

    from onepass.harness.app import CONF_DIR
    from onepass.harness.build import build, sampling_params
    from onepass.harness.workload import prompt_ids

    if tokens < 2 or reps < 1:
        raise ConfigError(f"--tokens {tokens} --reps {reps}: need at least 2 tokens (one decode step) and one round")
    combos = list(itertools.product(*(s.values for s in switches)))
    rows = []
    try:
        for B in batches:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="config", overrides=[*overrides, f"batch.size={B}", "progress=false"])
            built = build(cfg)
            ids = prompt_ids(cfg.workload, built.tokenizer, built.cfg.vocab_size)
            sampling = sampling_params(cfg)
            prefill = cfg.scheduler.prefill
            times: list[list[float]] = [[] for _ in combos]     # by combo index: values may be unhashable
            tokens_of: dict[int, list] = {}
            for _ in range(reps):
                for i, combo in enumerate(combos):
                    for s, v in zip(switches, combo):
                        s.set(v)
                    built.run_static([ids] * B, 2, sampling, (), prefill)     # compile outside the timing
                    r = built.run_static([ids] * B, tokens, sampling, (), prefill)
                    times[i].append(statistics.median(r.step_s) * 1e3)
                    tokens_of.setdefault(i, r.outputs)
                    del r
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
            base = min(times[0])
            for i, combo in enumerate(combos):
                best = min(times[i])
                row = {"B": B, "variant": variant_name(switches, combo), "best_ms": best, "ms": times[i],
                       "vs_baseline": best / base, "same_tokens": tokens_of[i] == tokens_of[0]}
                rows.append(row)
                out(f"[ab] B={B} {row['variant']}: p50 {best:.3f} ms/step ({' / '.join(f'{t:.3f}' for t in row['ms'])})"
                    f", {row['vs_baseline']:.3f}x baseline, same tokens as baseline: {str(row['same_tokens']).lower()}")
    finally:
        for s in switches:
            s.set(s.original)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onepass.harness.switch_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for onepass (e.g. experiment=hybrid_27b_q4)")
    p.add_argument("--switch", action="append", default=[], metavar="MODULE.ATTR=V1,V2",
                   help="a module attribute and its values, the baseline first (repeatable: every combination runs)")
    p.add_argument("--batches", default="8", help="comma-separated batch sizes (default 8)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per timed run (default 32)")
    p.add_argument("--reps", type=int, default=2, help="rounds over the variants, ABAB order (default 2)")
    a = p.parse_args(argv)
    try:
        if not a.switch:
            raise ConfigError("give at least one --switch MODULE.ATTR=V1,V2")
        switches = [parse_switch(s) for s in a.switch]
        try:
            batches = [int(b) for b in a.batches.split(",") if b.strip()]
        except ValueError:
            raise ConfigError(f"--batches {a.batches!r}: comma-separated integers, e.g. 8,32") from None
        run_ab(a.overrides, switches, batches, a.tokens, a.reps)
    except (ConfigError, ConfigCompositionException) as e:     # a bad switch, batch list or override
        print(f"[error] {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
