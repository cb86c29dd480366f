"""GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 weights repacked once, at load, for the W4A16 kernels (kernels/int4_gemm.py).

`pack(raw, qtype, (N, K))` takes a tensor's raw GGUF bytes (uint8, as the loader reads them; torch order:
N rows of K weights, each row a run of blocks) and returns a `PackedWeight`. The weights stay quantized:
the packed tensors hold the file's bits rearranged, so GPU memory is the file's size (Q4_K: +2.8%, below).
`unpack_ref(pw)` decodes a PackedWeight with plain torch; it equals `engine.quant.dequantize(raw)` bit for
bit for every format (tests/test_int4_gemm.py checks it on random blocks).

Packed layout (G = K / 32 groups of 32 consecutive weights per row; every format is seen by the kernel as
uniform 32-weight groups)

  qweight  int32 [G, N, W], contiguous, group-major: the 32 weights of (row n, group g) are the W words
           qweight[g, n, :] (W = 4 for the 4-bit formats: 16 bytes; W = 8 for Q8_0: 32 bytes). A program
           that owns rows n0..n0+BN-1 reads one contiguous run of BN * 4W bytes per group (one 16-byte
           vector per row and 4-bit group, consecutive rows in consecutive threads).
           4-bit: weight k = 32g + 8j + s sits in word j, bits 4s..4s+3 (s = 0..7), as the unsigned nibble
                  q in 0..15 of the file. Natural order: word j, shifted right by 4s and masked with 15,
                  gives weight 8j + s, so the kernel reads x's 32 columns of a group contiguously.
                  Seen as bytes (little-endian): byte e = 0..15 of the group holds weight 2e in its low
                  nibble and 2e + 1 in its high nibble (the inline-PTX dequantization relies on it).
                  (ggml's own order -- byte i of a block holds weights i and i + 16 -- is undone here.)
           Q8_0:  weight k = 32g + 4j + s is byte s of word j (little-endian), a signed int8: the file's
                  qs bytes unchanged, viewed as int32.
  scales   fp16 (the file's bits), transposed so a group's scales for consecutive rows are contiguous:
             Q4_0, Q8_0, Q4_1: [G, N]        d of the 32-weight block
             Q4_K:             [K/256, N]    d of the 256-weight super-block
  mins     fp16 or None:
             Q4_1:             [G, N]        m of the block
             Q4_K:             [K/256, N]    dmin of the super-block
  sub      uint8 [G, N, 2] or None:
             Q4_K:             (sc, mn): the group's 6-bit scale and min, decoded from the 12 packed bytes
                               (ggml get_scale_min_k4), one byte each

Values (fp32 arithmetic, exactly engine/quant.py's):
  Q4_0: w = d * (q - 8)              Q8_0: w = d * q
  Q4_1: w = d * q + m                Q4_K: w = (d * sc) * q - (dmin * mn)
Q4_K's per-group scale d * sc and min dmin * mn are fp16 x 6-bit products: exact in fp32 (17 bits), not in
fp16, so they are NOT folded into fp16 per-group values (that would round them). d and dmin stay fp16 per
super-block and sc / mn stay integers; the kernel forms d * sc and dmin * mn in fp32 per group (exact), so
its weights are exactly the reference's. Cost: 148 bytes per 256 weights instead of the file's 144
(sc and mn one byte each instead of 12 packed bytes for 16 six-bit values).

Packing is plain torch on raw's device: move the raw bytes to the GPU first and pack there (far faster than on
the CPU: kernels/PROBES.md, kernels/quant_pack.py); `.to(device)` moves a packed weight.

Row operations for the loader (q/k un-permute, V-head reorder, fused q|k|v and gate|up): every packed
tensor is indexed by row along dim 1, so `select_rows` and `cat_rows` are exact row gathers /
concatenations; they never touch K. Column permutations are not supported (a permutation of K inside a
super-block would need per-group d); permute the activation instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from onepass.kernels.errors import GGUFError

GROUP = 32          # weights per group, every format
SUPER = 256         # Q4_K super-block

FORMATS: dict[QT, str] = {QT.Q4_0: "q4_0", QT.Q4_1: "q4_1", QT.Q4_K: "q4_k", QT.Q8_0: "q8_0"}
_BY_NAME: dict[str, QT] = {v: k for k, v in FORMATS.items()}
WORDS_PER_GROUP = {"q4_0": 4, "q4_1": 4, "q4_k": 4, "q8_0": 8}


def packable(qtype: QT | str) -> bool:
    """Whether `pack` takes this GGUF type (the others are dequantized by the loader as before)."""
    try:
        _qtype(qtype)
        return True
    except GGUFError:
        return False


def _qtype(qtype: QT | str) -> QT:
    if isinstance(qtype, str):
        key = qtype.lower()
        if key in _BY_NAME:
            return _BY_NAME[key]
        try:
            qtype = QT[qtype.upper()]
        except KeyError:
            raise GGUFError(f"unknown quantization type {qtype!r}") from None
    qtype = QT(qtype)
    if qtype not in FORMATS:
        names = ", ".join(t.name for t in FORMATS)
        raise GGUFError(f"pack: type {qtype.name} cannot stay quantized (packable: {names}); dequantize it")
    return qtype


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A quantized [N, K] weight in the kernel's layout (module docstring). Immutable; `.to()` copies."""
    qweight: torch.Tensor                 # int32 [G, N, W]
    scales: torch.Tensor                  # fp16 [G, N] (Q4_K: [K/256, N])
    mins: torch.Tensor | None             # fp16 [G, N] (Q4_1) / [K/256, N] (Q4_K) / None
    sub: torch.Tensor | None              # uint8 [G, N, 2] (Q4_K) / None
    fmt: str                              # "q4_0" | "q4_1" | "q4_k" | "q8_0"
    N: int
    K: int
    group_size: int = GROUP

    @property
    def shape(self) -> tuple[int, int]:
        return (self.N, self.K)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def qtype(self) -> QT:
        return _BY_NAME[self.fmt]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.qweight, self.scales, self.mins, self.sub) if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (weights + scales + mins + Q4_K sub-scales)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedWeight":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return dataclasses.replace(self, qweight=mv(self.qweight), scales=mv(self.scales),
                                   mins=mv(self.mins), sub=mv(self.sub))

    def select_rows(self, idx: torch.Tensor) -> "PackedWeight":
        """Rows idx of the weight (out[i] = w[idx[i]]): exact, e.g. the loader's q/k un-permute."""
        idx = torch.as_tensor(idx, dtype=torch.long).to(self.device)
        pick = lambda t: None if t is None else t.index_select(1, idx).contiguous()  # noqa: E731
        return dataclasses.replace(self, qweight=pick(self.qweight), scales=pick(self.scales),
                                   mins=pick(self.mins), sub=pick(self.sub), N=int(idx.numel()))

    def __repr__(self) -> str:
        return (f"PackedWeight({self.fmt}, N={self.N}, K={self.K}, {self.nbytes / 2**20:.2f} MiB, "
                f"device={self.device})")


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Row concatenation [w0; w1; ...] (fused q|k|v, gate|up): same format and K required."""
    assert parts, "cat_rows: nothing to concatenate"
    p0 = parts[0]
    for p in parts[1:]:
        if p.fmt != p0.fmt or p.K != p0.K:
            raise GGUFError(f"cat_rows: cannot fuse {p0.fmt} [.., {p0.K}] with {p.fmt} [.., {p.K}] "
                            "(different formats or K): keep them as separate projections")
    cat = lambda ts: None if ts[0] is None else torch.cat(ts, dim=1).contiguous()  # noqa: E731
    return dataclasses.replace(p0, qweight=cat([p.qweight for p in parts]), scales=cat([p.scales for p in parts]),
                               mins=cat([p.mins for p in parts]), sub=cat([p.sub for p in parts]),
                               N=sum(p.N for p in parts))


# --------------------------------------------------------------------------------------------------
# pack

def _f16_bits(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian bytes -> (...) fp16, bits unchanged."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(R, 32) uint8 values 0..15 in k order -> (R, 4) int32: weight 8j+s at word j, bits 4s..4s+3."""
    b = q[:, 0::2] | (q[:, 1::2] << 4)          # byte i = weights 2i (low) and 2i+1 (high)
    return b.contiguous().view(torch.int32)     # little-endian: byte i is bits 8(i%4).. of word i//4


def _unpack_nibbles(w: torch.Tensor) -> torch.Tensor:
    """Inverse of _pack_nibbles: (R, 4) int32 -> (R, 32) uint8."""
    b = w.contiguous().view(torch.uint8)        # (R, 16)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(-1, 32)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 12) packed Q4_K scale bytes -> (n, 8) six-bit scales, (n, 8) six-bit mins (uint8)."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 63, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return sc, mn


def _group_major(t: torch.Tensor, N: int) -> torch.Tensor:
    """(N * G, ...) per-(row, group) data in row order -> (G, N, ...) contiguous."""
    t = t.reshape(N, -1, *t.shape[1:])
    return t.transpose(0, 1).contiguous()


def pack(raw: torch.Tensor, qtype: QT | str, shape: tuple[int, int]) -> PackedWeight:
    """Repack a [N, K] tensor's raw GGUF bytes (uint8, any shape, on any device) into the kernel layout,
    on raw's device. Exact: unpack_ref(pack(raw)) == engine.quant.dequantize(raw) bit for bit."""
    qt = _qtype(qtype)
    fmt = FORMATS[qt]
    if raw.dtype != torch.uint8:
        raise TypeError(f"pack: raw must be uint8 bytes, got {raw.dtype}")
    if len(shape) != 2:
        raise GGUFError(f"pack: {qt.name} weight must be 2-D [N, K], got shape {tuple(shape)}")
    N, K = (int(d) for d in shape)
    block, size = GGML_QUANT_SIZES[qt]
    if K % block:
        raise GGUFError(f"pack: {qt.name} row length {K} is not a multiple of the block size {block}")
    flat = raw.contiguous().reshape(-1)
    want = N * K // block * size
    if flat.numel() != want:
        raise GGUFError(f"pack: {qt.name} tensor of shape {(N, K)} needs {want} bytes, got {flat.numel()}")
    b = flat.view(-1, size)                      # one row per block, row-major over (n, block)
    mins = sub = None
    if qt == QT.Q8_0:
        qweight = b[:, 2:34].clone(memory_format=torch.contiguous_format).view(torch.int32)   # (N*G, 8)
        scales = _f16_bits(b[:, 0:2])
    elif qt == QT.Q4_0 or qt == QT.Q4_1:
        off = 2 if qt == QT.Q4_0 else 4
        qs = b[:, off:off + 16]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=1)                   # ggml: low nibbles 0..15, high 16..31
        qweight = _pack_nibbles(q)
        scales = _f16_bits(b[:, 0:2])
        if qt == QT.Q4_1:
            mins = _group_major(_f16_bits(b[:, 2:4]), N)
    else:  # Q4_K: 4 chunks of 32 bytes, chunk i = sub-block 2i (low nibbles) and 2i+1 (high)
        qs = b[:, 16:144].reshape(-1, 4, 1, 32)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 32)   # (N*K/32, 32) in k order
        qweight = _pack_nibbles(q)
        scales = _f16_bits(b[:, 0:2])
        mins = _group_major(_f16_bits(b[:, 2:4]), N)
        sc, mn = _k_scale_min(b[:, 4:16])
        sub = _group_major(torch.stack((sc, mn), dim=-1).reshape(-1, 2), N)
    return PackedWeight(qweight=_group_major(qweight, N), scales=_group_major(scales, N), mins=mins, sub=sub,
                        fmt=fmt, N=N, K=K)


# --------------------------------------------------------------------------------------------------
# reference decode

def unpack_int(pw: PackedWeight) -> torch.Tensor:
    """The stored integers q, [N, K] int16: 0..15 for the 4-bit formats, -128..127 for Q8_0."""
    G = pw.K // GROUP
    w = pw.qweight.transpose(0, 1).reshape(pw.N * G, -1)            # (N*G, W) in row order
    if pw.fmt == "q8_0":
        q = w.contiguous().view(torch.int8)
    else:
        q = _unpack_nibbles(w)
    return q.to(torch.int16).reshape(pw.N, pw.K)


def _affine(pw: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every format as w = q * s + c per group, in fp32 [N, G, 32] / [N, G, 1] / [N, G, 1]: q the integers (Q4_0:
    q - 8), s the scale (Q4_K: d * sc), c the offset (Q4_1: m; Q4_K: -(dmin * mn); else -0). s and c are exact."""
    N, G = pw.N, pw.K // GROUP
    q = unpack_int(pw).reshape(N, G, GROUP).float()

    def per_group(t: torch.Tensor) -> torch.Tensor:      # [G', N] -> [N, G, 1]; Q4_K super-block values repeated
        t = t.t().float()
        if t.shape[1] != G:
            t = t.repeat_interleave(SUPER // GROUP, dim=1)
        return t.unsqueeze(-1)

    s = per_group(pw.scales)
    c = torch.full_like(s, -0.0)                          # q * s + (-0) is q * s bitwise, its zeros' sign too
    if pw.fmt == "q4_0":
        q = q - 8
    elif pw.fmt == "q4_1":
        c = per_group(pw.mins)
    elif pw.fmt == "q4_k":
        s = s * pw.sub[..., 0].t().float().unsqueeze(-1)
        c = -(per_group(pw.mins) * pw.sub[..., 1].t().float().unsqueeze(-1))
    return q, s, c


def unpack_ref(pw: PackedWeight) -> torch.Tensor:
    """Decode a PackedWeight into float32 [N, K] with plain torch: engine.quant.dequantize's arithmetic."""
    q, s, c = _affine(pw)
    return (q * s + c).reshape(pw.N, pw.K)


def unpack_folded(pw: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weights a kernel that folds the group scales into 16-bit operands multiplies (kernels/int4_mma.py's
    fold variant), as float32 [N, K]: each group's scale s and offset c (see _affine) rounded to dtype first,
    then w = q * s + c rounded to dtype. q * s is exact in fp32 and adding c is too unless c exceeds q * s by
    ~2^12, so this is one rounding of the exact value, as the packed 16-bit fma does (Q8_0, Q4_0: c = -0, so
    w = q * s rounded once)."""
    q, s, c = _affine(pw)
    s, c = s.to(dtype).float(), c.to(dtype).float()
    return (q * s + c).to(dtype).float().reshape(pw.N, pw.K)


def packed_nbytes(qtype: QT | str, shape: tuple[int, int]) -> int:
    """Bytes `pack` will hold for this tensor (file size; Q4_K 148/144 of it)."""
    qt = _qtype(qtype)
    N, K = (int(d) for d in shape)
    block, size = GGML_QUANT_SIZES[qt]
    if qt == QT.Q4_K:
        return N * K // SUPER * (128 + 4 + 16)
    return N * K // block * size
