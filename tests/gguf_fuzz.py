"""Mutated tiny GGUF files and what the engine makes of each: refused with a GGUFError or ConfigError, or loaded and
run to a verdict. Anything else (a traceback, a hang, memory without bound) is a failure.

    python -m tests.gguf_fuzz --mutants 300 --seed 0     # prints the outcome counts as JSON

tests/test_gguf_fuzz.py runs it in a child process under a memory limit; each mutant has a time limit here."""
from __future__ import annotations

import argparse
import json
import random
import resource
import signal
import struct
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

SECONDS_PER_MUTANT = 10.0
PROMPT = [5, 9, 14, 3, 7]
NEW_TOKENS = 4


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout


def base_files(folder: Path) -> dict[str, Path]:
    """Three clean files: llama with a byte-level tokenizer and chat template, qwen3 (tied head), qwen35 with an MTP
    block (arrays in its metadata)."""
    from tokenizers.pre_tokenizers import ByteLevel

    from onepass.engine.config import ModelConfig
    from onepass.engine.gguf_writer import random_weights, write_gguf

    small = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=256, eos_ids=(2,))
    cfgs = {
        "llama": ModelConfig(arch="llama", n_layers=2, head_dim=16, name="fuzz-llama", **{**small, "vocab_size": 260}),
        "qwen3": ModelConfig(arch="qwen3", n_layers=2, head_dim=16, qk_norm=True, tie_embeddings=True,
                             name="fuzz-qwen3", **small),
        "qwen35": ModelConfig(arch="qwen35", n_layers=4, head_dim=16, qk_norm=True, name="fuzz-qwen35",
                              full_attention_interval=2, rotary_dim=8, rope_sections=(2, 1, 1, 0),
                              attn_output_gate=True, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=8,
                              gdn_conv_kernel=4, mtp_layers=1, **small),
    }
    tokens = sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "<|end|>"]   # 260 = the llama's vocab_size
    tokenizer = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                 "tokenizer.ggml.token_type": [1] * 259 + [3], "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
                 "tokenizer.chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"}
    out = {}
    for arch, cfg in cfgs.items():
        out[arch] = folder / f"{arch}.gguf"
        write_gguf(out[arch], cfg, random_weights(cfg, seed=1), weight_type="f32",
                   tokenizer_meta=tokenizer if arch == "llama" else None)
    return out


def _places(path: Path) -> dict[str, list]:
    """Byte places of the clean file's header a mutation can aim at: (offset, numpy dtype, what) per item."""
    reader = gguf.GGUFReader(path, "r")
    places: dict[str, list] = {"scalar": [], "count": [], "strlen": [], "tensor": [], "header": []}
    for key, field in reader.fields.items():
        at = field.offset
        sizes = [p.nbytes for p in field.parts]
        offs = [at + sum(sizes[:i]) for i in range(len(sizes))]
        if key.startswith("GGUF."):
            places["header"].append((offs[0], field.parts[0].dtype, key))
            continue
        places["strlen"].append((offs[0], np.dtype(np.uint64), f"{key} (key length)"))
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.STRING:
            places["strlen"].append((offs[3], np.dtype(np.uint64), f"{key} (value length)"))
        elif vtype == gguf.GGUFValueType.ARRAY:
            places["count"].append((offs[4], np.dtype(np.uint64), f"{key} (array count)"))
            if field.types[-1] == gguf.GGUFValueType.STRING and len(offs) > 5:
                places["strlen"].append((offs[5], np.dtype(np.uint64), f"{key}[0] (length)"))
        else:
            places["scalar"].append((offs[3], field.parts[3].dtype, key))
    for t in reader.tensors:
        sizes = [p.nbytes for p in t.field.parts]
        offs = [t.field.offset + sum(sizes[:i]) for i in range(len(sizes))]
        n_dims = int(t.field.parts[2][0])
        places["tensor"] += [(offs[2], np.dtype(np.uint32), f"{t.name} n_dims"),
                             (offs[4], np.dtype(np.uint32), f"{t.name} type"),
                             (offs[5], np.dtype(np.uint64), f"{t.name} offset")]
        places["tensor"] += [(offs[3] + 8 * d, np.dtype(np.uint64), f"{t.name} dim {d}") for d in range(n_dims)]
    places["data_start"] = reader.data_offset
    return places


def _extreme(dtype: np.dtype, rng: random.Random):
    if dtype.kind == "f":
        return rng.choice([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e38, 1e-45, rng.uniform(-1e6, 1e6)])
    info = np.iinfo(dtype)
    return rng.choice([0, 1, info.max, info.max // 2, info.min, rng.randint(info.min, info.max)])


def mutate(clean: Path, out: Path, rng: random.Random, places: dict) -> str:
    """Write one mutant of `clean` to `out`; return what was changed."""
    data = bytearray(clean.read_bytes())
    kind = rng.choice(["scalar", "count", "strlen", "tensor", "header", "header_byte", "data", "truncate"])
    if kind in ("scalar", "count", "strlen", "tensor", "header") and places[kind]:
        at, dtype, what = rng.choice(places[kind])
        if kind in ("count", "strlen"):
            value = rng.choice([0, 1, 2**31, 2**33, 2**62, 2**64 - 1, rng.randrange(2**40)])
        elif kind == "tensor" and what.endswith("offset"):
            value = rng.choice([0, 1, 31, 2**40, rng.randrange(len(data))])
        else:
            value = _extreme(dtype, rng)
        data[at:at + dtype.itemsize] = np.array([value]).astype(dtype).tobytes()
        what = f"{kind}: {what} = {value}"
    elif kind == "header_byte":
        at = rng.randrange(places["data_start"])
        data[at] = rng.randrange(256)
        what = f"header byte {at} = {data[at]}"
    elif kind == "data":
        at = rng.randrange(places["data_start"], len(data) - 4)
        pattern = rng.choice([b"\xff\xff\xff\x7f", struct.pack("<f", 3e38), struct.pack("<f", float("inf")),
                              bytes(rng.randrange(256) for _ in range(4))])
        span = rng.choice([1, 16, 4096])
        for i in range(span):
            p = at + 4 * i
            if p + 4 <= len(data):
                data[p:p + 4] = pattern
        what = f"data at {at}: {span} x {pattern.hex()}"
    else:
        cut = rng.randrange(len(data))
        del data[cut:]
        what = f"truncated at {cut} of {len(clean.read_bytes())} bytes"
    out.write_bytes(bytes(data))
    return what


def run_one(path: Path) -> tuple[str, str]:
    """(outcome, detail): refused, loaded and verified, loaded and failed its verdict (with its reason), or crashed."""
    from onepass.engine.engine import Engine
    from onepass.engine.sampler import SamplingParams
    from onepass.engine.verify import verify_greedy
    from onepass.kernels.errors import ConfigError, GGUFError

    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_MUTANT)
    try:
        engine = Engine.from_gguf(path, device="cpu", batch=2, ctx=16)
        if engine.tokenizer is not None:
            engine.tokenizer.encode("the head")
            if engine.tokenizer.chat_template:
                engine.tokenizer.encode_chat("hello")
        prompt = [t % engine.cfg.vocab_size for t in PROMPT]
        single = engine.run_static([prompt], NEW_TOKENS, SamplingParams())
        batch = engine.run_static([prompt] * 2, NEW_TOKENS, SamplingParams())
        verdict = verify_greedy(batch.outputs, single.outputs[0], single.logits_finite)
        return ("verified", "") if verdict.ok else ("failed verdict", verdict.reason)
    except GGUFError as e:
        return "GGUFError", str(e).splitlines()[0][:160]
    except ConfigError as e:
        return "ConfigError", str(e).splitlines()[0][:160]
    except Timeout:
        return "timeout", f"over {SECONDS_PER_MUTANT:.0f} s"
    except BaseException as e:  # noqa: BLE001 - the fuzz's point: anything else is a failure, reported
        return "traceback", f"{type(e).__name__}: {e}".splitlines()[0][:160] + "\n" + traceback.format_exc(limit=4)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def fuzz(mutants: int, seed: int, start: int = 0) -> dict:
    """Mutants start..mutants-1; each one's line (JSON) is printed as it ends, so a run cut short still tells."""
    counts: Counter = Counter()
    bad: list[dict] = []
    reasons: list[str] = []
    slowest = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        bases = base_files(folder)
        places = {arch: _places(p) for arch, p in bases.items()}
        for i in range(start, mutants):
            rng = random.Random(f"{seed}/{i}")   # mutant i is the same whatever ran before it
            arch = rng.choice(sorted(bases))
            path = folder / f"mutant-{i}.gguf"
            what = mutate(bases[arch], path, rng, places[arch])
            print(json.dumps({"mutant": i, "arch": arch, "mutation": what}), flush=True)
            t0 = time.perf_counter()
            outcome, detail = run_one(path)
            took = time.perf_counter() - t0
            slowest = max(slowest, took)
            counts[outcome] += 1
            print(json.dumps({"mutant": i, "outcome": outcome, "detail": detail, "s": round(took, 3)}), flush=True)
            if outcome == "failed verdict":
                reasons.append(detail)
            if outcome in ("traceback", "timeout"):
                bad.append({"mutant": i, "arch": arch, "mutation": what, "outcome": outcome, "detail": detail})
            path.unlink()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # bytes (Linux reports KiB)
    return {"mutants": mutants - start, "seed": seed, "counts": dict(counts), "failures": bad, "slowest_s": slowest,
            "peak_rss_bytes": peak, "reasons": sorted(set(reasons))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="the first mutant's index (to go on after a hang)")
    ap.add_argument("--address-space-gib", type=float, default=0,
                    help="cap this process's address space, so a mutant that allocates without bound fails alone")
    args = ap.parse_args()
    if args.address_space_gib:
        cap = int(args.address_space_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    print(json.dumps({"summary": fuzz(args.mutants, args.seed, args.start)}))


if __name__ == "__main__":
    main()
