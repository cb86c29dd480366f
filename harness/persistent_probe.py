"""Probe: the persistent decode step's settings (K tile, warps) against the kernel-per-op step on one model's shapes,
random bf16 weights made on the GPU, each step form's layers captured as one CUDA graph, at rows 1..16. Prints each
setting's time per step of the layers (the LM head is the same in both forms), the weights' floor at the card's copy
rate, and the largest difference of the final residual rows from the kernel-per-op step's (kernels/PROBES.md).

    python -m onepass.harness.persistent_probe --model llama-3.2-1b --rows 1,16 \
        --forms "block_k=512,num_warps=8,stages=0;stages=4,block_k=256"

Each form is a set of PersistentStep settings (kernels/persistent_step.py FORM_SETTINGS); the others keep their
defaults. Each form's phases are timed too (one timed launch: every program's clock at every barrier), and so is
the step's count of grid barriers with nothing between them, first. `--weights q4_0`
(or q4_1, q4_k, q8_0) keeps the layers' projections packed: random valid blocks, as engine.weights=packed runs them.
"""
from __future__ import annotations

import argparse

import torch

from onepass.engine.fused_model import FusedDecoder
from onepass.engine.gguf_loader import ROPE_FREQS
from onepass.engine.gguf_writer import random_weights
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.harness.roofline import copy_bandwidth
from onepass.harness.synth import random_packed, synthetic_config
from onepass.kernels.backend import get_step_kernels
from onepass.kernels.decode_attention import device_num_sms, make_workspace
from onepass.kernels.errors import ConfigError
from onepass.kernels.persistent_step import PersistentStep, barrier_cost_us, parse_form


def _time_us(fn) -> float:
    """Microseconds per call of fn replayed as a CUDA graph (triton's graph timer: warmed up, then the median)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def model_shape(name: str):
    """conf/model/<name>.yaml's `synthetic` shapes as the harness composes them (the schema's defaults filled in)."""
    from hydra import compose, initialize_config_dir

    from onepass.harness.app import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        model = compose(config_name="config", overrides=[f"model={name}"]).model
    if model.get("synthetic") is None:
        raise ConfigError(f"model {name!r} has no synthetic shapes (conf/model/{name}.yaml); the probe makes random "
                          "weights in a model's shapes")
    return model.synthetic


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--position", type=int, default=100, help="every row's position (its keys 0..position are read)")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "q4_0", "q4_1", "q4_k", "q8_0"),
                    help="the layers' projections: bf16, or kept packed in this format")
    ap.add_argument("--forms", default="block_k=512,num_warps=8",
                    help="settings to time, ';' between forms, ',' between a form's settings")
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    shape = model_shape(args.model)
    cfg = synthetic_config(args.model, shape)
    weights = {k: v if k == ROPE_FREQS else v.to(dt) for k, v in random_weights(cfg, device=dev).items()}
    if args.weights != "bf16":
        g = torch.Generator(device=dev).manual_seed(2)
        for name, w in weights.items():
            if name.startswith("blk.") and w.dim() == 2:
                weights[name] = random_packed(tuple(w.shape), args.weights, w.shape[1] ** -0.5, dev, g)
    model = FusedDecoder(cfg, weights, get_step_kernels("triton"), max_pos=args.position + 2)
    kv = ContiguousKVCache(cfg, 17, args.position + 2, dt, dev)
    bw = copy_bandwidth(dev)
    layer_bytes = model.weight_bytes() - model.lm_head.numel() * dt.itemsize - model.out_norm.numel() * dt.itemsize
    print(f"[probe] {args.model} ({args.weights}): layers' weights {layer_bytes / 1e9:.3f} GB, "
          f"floor {layer_bytes / bw * 1e6:.1f} us at {bw / 1e12:.2f} TB/s; rows at position {args.position}; "
          f"{device_num_sms(dev)} SMs")
    for per_sm in (1, 2):
        n = per_sm * device_num_sms(dev)
        cost = barrier_cost_us(n, 1 + 5 * cfg.n_layers, dev)
        print(f"[probe] the step's {1 + 5 * cfg.n_layers} grid barriers alone, {n} programs of 4 warps: "
              f"{cost['period']:.2f} us a barrier ({cost['sync']:.2f} us from the last arrival to program 0 leaving)",
              flush=True)
    g = torch.Generator(device=dev).manual_seed(1)
    for R in [int(r) for r in args.rows.split(",")]:
        tokens = torch.randint(3, cfg.vocab_size, (R,), generator=g, device=dev)
        positions = torch.full((R,), args.position, device=dev)
        slots = torch.arange(R, device=dev)
        buf = model.buffers(R)
        ws = make_workspace(R, cfg.n_heads, cfg.head_dim, args.position + 2, device_num_sms(dev), dev)
        run = lambda: model.hidden(tokens, positions, slots, kv, buf, ws, max_len=args.position + 2)  # noqa: E731
        model.persistent = False
        base = _time_us(run)
        ref = run().clone()
        model.persistent = True
        grid = [parse_form(f) for f in args.forms.split(";")]
        times_us = []
        for settings in grid:
            try:
                model._persistent = (kv, PersistentStep(model, kv, **settings))
                us = _time_us(run)
            except Exception as e:   # a form whose tiles do not fit (shared memory, registers): said, and skipped
                times_us.append(float("inf"))
                print(f"[probe] R={R} persistent {settings}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            times_us.append(us)
            err = (run().float() - ref.float()).abs().max().item()
            k = model._persistent[1].compiled
            ptx = k.asm["ptx"]
            print(f"[probe] R={R} persistent {settings} {us:.1f} us ({base / us:.2f}x, "
                  f"{layer_bytes / bw * 1e6 / us:.0%} of floor, max |diff| {err:.3g}; "
                  f"{getattr(k, 'n_regs', '?')} registers, {getattr(k, 'n_spills', '?')} spilled, "
                  f"{ptx.count('cp.async.ca') + ptx.count('cp.async.cg')} cp.async in the PTX)", flush=True)
            model._persistent = (kv, PersistentStep(model, kv, timed=True, **settings))
            run()
            torch.cuda.synchronize()
            st = model._persistent[1].stamped_us()
            print(f"[probe] R={R} phases of {settings} (us, summed over layers; a phase's barrier wait included; "
                  "in brackets: from the last program's arrival at the barrier to its opening; the slowest "
                  "program's work; the programs' mean work): "
                  + ", ".join(f"{p} {t:.1f} ({st['sync'][p]:.1f}; {st['slowest'][p]:.1f}; {st['mean'][p]:.1f})"
                              for p, t in st["time"].items()), flush=True)
        fastest_us, fastest = min(zip(times_us, grid), key=lambda t: t[0])
        print(f"[probe] R={R}: kernel-per-op {base:.1f} us; fastest persistent {fastest} {fastest_us:.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
