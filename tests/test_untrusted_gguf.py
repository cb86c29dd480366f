"""Untrusted GGUF files: one named mutation per way a file can lie about itself. Each must end in a GGUFError that
names the problem before a model is built from it; none may load as a model that then runs."""
from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from onepass.engine.config import ModelConfig
from onepass.engine.gguf_loader import load_gguf, read_config
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.kernels.errors import GGUFError

CFG = ModelConfig(arch="llama", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                  vocab_size=128, name="tiny", eos_ids=(2,))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    path = tmp_path_factory.mktemp("untrusted") / "clean.gguf"
    write_gguf(path, CFG, random_weights(CFG, seed=3), weight_type="f32")
    return path


def mutant(clean, tmp_path, edit) -> str:
    """A copy of the clean file with edit(reader) applied in place through gguf-py's writable memmap: the field parts
    are views of the file's bytes, so a count or length is rewritten where it lies."""
    path = tmp_path / f"mutant-{Path(clean).name}"
    shutil.copy(clean, path)
    reader = gguf.GGUFReader(path, "r+")
    edit(reader)
    reader.data.flush()
    del reader
    return str(path)


def field(reader, key):
    return reader.fields[key].parts[reader.fields[key].data[0]]


def tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def test_the_clean_file_loads(clean):
    cfg, w, _ = load_gguf(clean, progress=False)
    assert cfg.n_layers == 2 and len(w) > 0


@pytest.mark.parametrize("key,value,match", [
    ("llama.attention.layer_norm_rms_epsilon", np.nan, "layer_norm_rms_epsilon.*finite"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5, "layer_norm_rms_epsilon.*> 0"),
    ("llama.rope.freq_base", 0.0, "freq_base.*> 0"),
    ("llama.rope.freq_base", np.inf, "freq_base.*finite"),
    ("llama.attention.head_count", 0, "head_count.*>= 1"),
    ("llama.attention.head_count_kv", 3, "head_count_kv.*divide"),
    ("llama.embedding_length", 0, "embedding_length.*>= 1"),
])
def test_hyperparameter_out_of_its_domain(clean, tmp_path, key, value, match):
    def edit(r):
        field(r, key)[0] = value
    with pytest.raises(GGUFError, match=match):
        read_config(mutant(clean, tmp_path, edit))


@pytest.mark.parametrize("name,where", [("blk.0.attn_norm.weight", 5), ("blk.1.attn_q.weight", 100)])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weight_is_named(clean, tmp_path, name, where, bad):
    def edit(r):
        tensor(r, name).data.reshape(-1)[where] = bad
    with pytest.raises(GGUFError, match=f"tensor {name}.*non-finite"):
        load_gguf(mutant(clean, tmp_path, edit), progress=False)


def test_block_count_lower_than_the_layers_present(clean, tmp_path):
    def edit(r):
        field(r, "llama.block_count")[0] = 1
    with pytest.raises(GGUFError, match=r"blk\.1\..*block_count is 1"):
        read_config(mutant(clean, tmp_path, edit))


def test_block_count_zero(clean, tmp_path):
    def edit(r):
        field(r, "llama.block_count")[0] = 0
    with pytest.raises(GGUFError, match="block_count"):
        read_config(mutant(clean, tmp_path, edit))


def test_tensor_type_changed_leaves_a_hole(clean, tmp_path):
    """An F32 tensor relabelled F16 needs half its bytes: the rest is a hole before the next tensor."""
    def edit(r):
        tensor(r, "blk.0.attn_norm.weight").field.parts[4][0] = int(gguf.GGMLQuantizationType.F16)   # its type
    with pytest.raises(GGUFError, match="bytes|type"):
        read_config(mutant(clean, tmp_path, edit))


def test_overlapping_tensors(clean, tmp_path):
    def edit(r):
        a, b = r.tensors[1], r.tensors[2]
        b.field.parts[-1][0] = a.field.parts[-1][0]      # b's offset on a's
    with pytest.raises(GGUFError, match="overlap"):
        read_config(mutant(clean, tmp_path, edit))


def test_misaligned_offset(clean, tmp_path):
    def edit(r):
        t = r.tensors[3]
        t.field.parts[-1][0] += 4
    with pytest.raises(GGUFError, match="alignment"):
        read_config(mutant(clean, tmp_path, edit))


def test_tensor_count_one_lower(clean, tmp_path):
    def edit(r):
        field(r, "GGUF.tensor_count")[0] -= 1
    with pytest.raises(GGUFError):
        read_config(mutant(clean, tmp_path, edit))
