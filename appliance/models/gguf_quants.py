"""GGUF quantized blocks -> the canonical quantized weight form, kept quantized (no float matrix).

The canonical form (``appliance.layers.methods.qmath``): ``qweight`` int8 ``[N, K]`` holding signed
integers, ``scale`` float32 ``[N, K // group]`` and an optional ``zero_point`` of the same shape, with
``w = (q - zero_point) * scale``. Each GGUF block type we keep is one class in ``KEPT`` (keyed by
``gguf.GGMLQuantizationType[...].name``) that decodes a tensor's raw block bytes into that form; the
reference for every layout is ``gguf.quants`` (its ``dequantize_blocks``), which the tests hold each
class against. Every other type is not kept: the caller dequantizes it to float.

What each type becomes (``u``: the unsigned integers a block stores, ``d``/``dmin``/``m``: its fp16
scale, min scale and min; K-quants: super-blocks of 256 with 6- or 8-bit sub-scales ``sc`` and mins
``mn``):

======  =======================  ==============  ================================================
type    gguf's weight            canonical       mapping
======  =======================  ==============  ================================================
Q4_0    ``d (u - 8)``             w4a8, g32       ``q = u - 8``, scale ``d``. Exact.
Q4_1    ``d u + m``               w4a8, g32, zp   ``q = u - 8``, scale ``d``, ``zp = -8 - m / d``
Q4_K    ``d sc u - dmin mn``      w4a8, g32, zp   ``q = u - 8``, scale ``d sc``, ``zp = -8 + dmin mn / (d sc)``
Q5_0    ``d (u - 16)``            w8a8, g32       ``q = u - 16``, scale ``d``. Exact.
Q5_1    ``d u + m``               w8a8, g32, zp   ``q = u - 16``, like Q4_1
Q5_K    ``d sc u - dmin mn``      w8a8, g32, zp   ``q = u - 16``, like Q4_K
Q8_0    ``d q``                   w8a8, g32       ``q``, scale ``d``. Exact.
Q6_K    ``d sc (u - 32)``         w8a8, g16       ``q = u - 32``, scale ``d sc`` (int8 ``sc``). Exact.
Q3_K    ``d (sc - 32) q3``        w8a8, g16       ``q = q3`` in [-4, 3], scale ``d (sc - 32)``. Exact.
Q2_K    ``d sc u - dmin mn``      w8a8, g16, zp   ``q = u - 2``, like Q4_K
======  =======================  ==============  ================================================

Exact: the products of an fp16 scale (11 significant bits) with sub-scales (<= 8 bits) and integers
(<= 6 bits) fit fp32's 24, so ``(q - 0) * scale`` is gguf's fp32 value bit for bit. With a min, the
zero point is rounded to fp32 (computed from exact fp64 values): ``(q - zp) * scale`` then differs
from the exact ``S u - M`` by at most ``2^-24 |zp * scale| = 2^-24 |M - c S|`` (``c`` the centre
8, 16 or 2), about an fp32 ulp of the group's largest weight, which is also how far gguf's own fp32
sum may be from it. The centre ``c`` (q = u - c) keeps ``|zp|`` and the zero-point term small
where the group straddles 0, as trained weights do. A group whose scale is 0 (``d == 0`` or
``sc == 0``: every weight ``-M``) gets ``q = 0``, the power-of-two scale ``2^floor(log2 |M|)`` (1
for ``M = 0``) and ``zp = M / scale``, which makes it exact (``M / scale`` is exact in fp32) and
leaves nothing of it to meet quantized activations: all of it is the zero point's term (with
``q = -c`` instead, an all-zero group of scale 1 put ``-c`` against them and its A8 rounding
error into the output: random Q2_K layers were 2.2-2.5% off their exact product instead of
0.55%).

The K-quants (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K) also give their own scales (``KQuantScales``: int8 sub-scales
``sc`` (Q3_K: ``sc - 32``) and mins ``mn`` per group, ``d``/``dmin`` per super-block, ``q + shift``
the file's integer), which the low-bit methods hold instead of fp32 per group.

W4 groups run on ``w4a8_dynquant``/``w4a16_int4pack``; W8 groups (16 or 32, with or without zero
point) only on ``w8a8_native`` (``QuantLinear(..., w8_groups=True)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from appliance.errors import ModelLoadError


@dataclass(frozen=True)
class QuantWeight:
    """One weight ``[N, K]`` in the canonical form: ``w = (qweight - zero_point) * scale`` per group of
    ``group`` inputs. ``qweight`` int8 ``[N, K]``, ``scale`` float32 ``[N, K // group]``,
    ``zero_point`` float32 ``[N, K // group]`` or None (symmetric)."""

    scheme: str  # "w4a8" (q in [-8, 7]) or "w8a8" (q in [-128, 127])
    group: int
    qweight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    kquant: "KQuantScales | None" = None  # a K-quant's own scales, besides the canonical form


@dataclass(frozen=True)
class KQuantScales:
    """A K-quant weight's own scales, kept beside the canonical form so that a method can hold them at
    their size in the file (``appliance.layers.methods.lowbit.pack_kquant``) rather than fp32 per
    group: ``w = sup[b] sub[g] (q + shift) - supmin[b] submin[g]`` for the canonical ``q`` of group
    ``g`` (``group`` inputs) in super-block ``b`` (``super_block`` inputs). ``sub``/``submin`` int8
    ``[N, K // group]`` (``submin`` None: no mins), ``sup``/``supmin`` float32 ``[N, K // super_block]``
    (fp16 values, exact). The products are exact in fp32 (see the module docstring)."""

    group: int
    super_block: int
    shift: int
    sub: torch.Tensor
    submin: torch.Tensor | None
    sup: torch.Tensor
    supmin: torch.Tensor | None


class BlockType:
    """One GGUF block type kept quantized. Subclasses set ``name`` (the GGUF type name), ``scheme``,
    ``group`` and ``has_zero_point`` and implement ``decode``; ``block_size`` (weights per block) and
    ``type_size`` (bytes per block) come from ``gguf.GGML_QUANT_SIZES``."""

    name: str
    scheme: str
    group: int
    has_zero_point: bool
    block_size: int
    type_size: int

    # K-quants: q + kshift is the file's integer (``KQuantScales``); kscales gives the scales
    kshift: int | None = None

    def kscales(self, blocks: np.ndarray):
        """uint8 ``[B, type_size]`` -> (int8 sub ``[B, block_size // group]``, int8 submin of that shape
        or None, float64 sup ``[B]``, float64 supmin ``[B]`` or None); K-quants only."""
        raise NotImplementedError

    def decode(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """uint8 ``[B, type_size]`` -> (int8 q ``[B, block_size]``, float32 scale
        ``[B, block_size // group]``, float32 zero point of that shape or None)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        zp = ", zero point" if self.has_zero_point else ""
        return f"<GGUF {self.name} kept as {self.scheme} group {self.group}{zp}>"


# GGUF type name -> how its blocks become the canonical form
KEPT: dict[str, BlockType] = {}


def _keep(cls: type[BlockType]) -> type[BlockType]:
    import gguf

    cls.block_size, cls.type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[cls.name]]
    if cls.block_size % cls.group:
        raise ValueError(f"{cls.name}: group {cls.group} does not divide its block of {cls.block_size}")
    KEPT[cls.name] = cls()
    return cls


def kept(type_name: str) -> BlockType | None:
    """How a tensor of GGUF type ``type_name`` is kept (its ``scheme``, ``group``, ``has_zero_point``),
    without decoding anything; None for a type that is not kept (dequantize it to float)."""
    return KEPT.get(type_name)


def canonical(type_name: str, raw: np.ndarray, n: int, k: int, where: str = "") -> QuantWeight:
    """A GGUF weight of ``n`` rows (outputs) by ``k`` inputs, as raw block bytes (uint8, any shape of
    the right size; ``gguf.GGUFReader`` gives ``tensor.data`` as ``[n, bytes per row]``), in the
    canonical form. Rows stay in the file's order. ``where`` (e.g. "file.gguf: tensor 'blk.0...'")
    prefixes error messages. Raises ``ModelLoadError`` for a type that is not kept or data of the
    wrong size."""
    at = f"{where}: " if where else ""
    bt = KEPT.get(type_name)
    if bt is None:
        raise ModelLoadError(f"{at}GGUF type {type_name} is not kept quantized (kept: {', '.join(KEPT)})")
    if k % bt.block_size:
        raise ModelLoadError(f"{at}{type_name} weight [{n}, {k}]: {k} inputs is not a multiple of the "
                             f"{type_name} block of {bt.block_size}")
    raw = np.asarray(raw)
    want = n * (k // bt.block_size) * bt.type_size
    if raw.dtype != np.uint8 or raw.size != want:
        raise ModelLoadError(f"{at}{type_name} weight [{n}, {k}]: expected {want} bytes ({n * k // bt.block_size} "
                             f"blocks of {bt.type_size}), got {raw.size} {raw.dtype} values of shape {raw.shape}")
    blocks = np.ascontiguousarray(raw).reshape(-1, bt.type_size)
    q, scale, zp = bt.decode(blocks)
    kq = None
    if bt.kshift is not None:
        sub, submin, sup, supmin = bt.kscales(blocks)
        g, s = k // bt.group, k // bt.block_size
        t = lambda a, c, dt: None if a is None else torch.from_numpy(np.ascontiguousarray(a.reshape(n, c), dtype=dt))  # noqa: E731
        kq = KQuantScales(bt.group, bt.block_size, bt.kshift, t(sub, g, np.int8), t(submin, g, np.int8),
                          t(sup, s, np.float32), t(supmin, s, np.float32))
    return QuantWeight(bt.scheme, bt.group, torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))),
                       torch.from_numpy(np.ascontiguousarray(scale.reshape(n, k // bt.group), dtype=np.float32)),
                       None if zp is None else
                       torch.from_numpy(np.ascontiguousarray(zp.reshape(n, k // bt.group), dtype=np.float32)), kq)


# ---------------------------------------------------------------- bit unpacking

def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` (even) of each block (every type's size is even), as float64 [B] (exact)."""
    return blocks.view("<u2")[:, at // 2].view("<f2").astype(np.float64)


def _planes(b: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., L] -> [..., 8 / bits, L]: plane j holds bits [bits j, bits (j + 1)) of every byte."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]
    return (b[..., None, :] >> shifts) & np.uint8((1 << bits) - 1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K/Q5_K sub-scales -> (sc, mn), each uint8 [B, 8] in 0..63. Bytes 0-3 hold
    sc 0-3 in their low 6 bits and the top 2 bits of sc 4-7 above; bytes 4-7 the same for mn; bytes
    8-11 the low 4 bits of sc 4-7 (low nibble) and mn 4-7 (high nibble)."""
    lo_sc, lo_mn, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (mix & 15) | ((lo_sc >> 6) << 4)], axis=1)
    mn = np.concatenate([lo_mn & 63, (mix >> 4) | ((lo_mn >> 6) << 4)], axis=1)
    return sc, mn


# Native unpacking (``appliance_native.gguf_unpack_q``) of these types' integers; the numpy code in
# each class is the reference (tests/quant/test_gguf_quants.py holds the two equal, bit for bit).
# False: numpy only.
USE_NATIVE = True
_NATIVE_KIND = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


def _native_q(name: str, blocks: np.ndarray) -> np.ndarray | None:
    """int8 [B, block size]: the canonical ``q = u - centre`` of ``blocks`` (uint8 [B, type size],
    contiguous) from the native extension; None when it is not built (or ``USE_NATIVE`` is off)."""
    if not USE_NATIVE:
        return None
    from appliance.ops import native

    if not native.is_available():
        return None
    import warnings

    with warnings.catch_warnings():  # a read-only mmap of the file: the kernel only reads it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(blocks)
    return native._require().gguf_unpack_q(t, _NATIVE_KIND[name]).numpy()


def _affine(q: np.ndarray, scale: np.ndarray, low: np.ndarray, centre: int):
    """Groups of ``w = scale * u + low`` (q = u - centre int8 [B, G * g]; scale, low float64 [B, G],
    exact) -> (q, fp32 scale, fp32 zero point ``-centre - low / scale``), see the module docstring;
    a group with scale 0 (every weight ``low``) gets q = 0, a power-of-two scale and the zero point
    ``-low / scale``, exactly."""
    zero = scale == 0
    if zero.any():
        _, e = np.frexp(low)  # |low| in [2^(e-1), 2^e): low / 2^(e-1) in [1, 2), exact
        scale = np.where(zero, np.where(low != 0, np.ldexp(1.0, e - 1), 1.0), scale)
        q = np.where(zero[..., None], np.int8(0), q.reshape(*zero.shape, -1))
    zp = np.where(zero, 0, -centre) - low / scale
    return q.reshape(q.shape[0], -1), scale.astype(np.float32), zp.astype(np.float32)


def _centred(u: np.ndarray, centre: int) -> np.ndarray:
    """Unsigned integers ``u`` [B, ...] -> int8 ``u - centre`` [B, prod(...)]."""
    return (u.astype(np.int16) - centre).astype(np.int8).reshape(u.shape[0], -1)


def _low_high(b: np.ndarray) -> np.ndarray:
    """uint8 [B, L] -> [B, 2L]: the low nibbles of the L bytes, then their high nibbles."""
    return _planes(b, 4).reshape(b.shape[0], -1)


# ---------------------------------------------------------------- the kept types

@_keep
class Q4_0(BlockType):
    """fp16 d, then 16 bytes: weight j in the low nibble of byte j, weight j + 16 in its high one."""

    name, scheme, group, has_zero_point = "Q4_0", "w4a8", 32, False

    def decode(self, blocks):
        q = _native_q(self.name, blocks)
        if q is None:
            q = _low_high(blocks[:, 2:18]).astype(np.int8) - 8
        return q, _f16(blocks, 0)[:, None].astype(np.float32), None


@_keep
class Q4_1(BlockType):
    """fp16 d, fp16 m, then 16 bytes of nibbles as Q4_0."""

    name, scheme, group, has_zero_point = "Q4_1", "w4a8", 32, True

    def decode(self, blocks):
        q = _native_q(self.name, blocks)
        if q is None:
            q = _centred(_low_high(blocks[:, 4:20]), 8)
        return _affine(q, _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None], 8)


def _q5_u(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # qh: 4 bytes, bit j (little-endian) the 5th bit of weight j; qs: nibbles as Q4_0
    return _low_high(qs) | (np.unpackbits(qh, axis=1, bitorder="little") << 4)


@_keep
class Q5_0(BlockType):
    """fp16 d, 4 bytes of 5th bits, 16 bytes of low nibbles."""

    name, scheme, group, has_zero_point = "Q5_0", "w8a8", 32, False

    def decode(self, blocks):
        q = _native_q(self.name, blocks)
        if q is None:
            q = _q5_u(blocks[:, 2:6], blocks[:, 6:22]).astype(np.int8) - 16
        return q, _f16(blocks, 0)[:, None].astype(np.float32), None


@_keep
class Q5_1(BlockType):
    """fp16 d, fp16 m, 4 bytes of 5th bits, 16 bytes of low nibbles."""

    name, scheme, group, has_zero_point = "Q5_1", "w8a8", 32, True

    def decode(self, blocks):
        q = _native_q(self.name, blocks)
        if q is None:
            q = _centred(_q5_u(blocks[:, 4:8], blocks[:, 8:24]), 16)
        return _affine(q, _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None], 16)


@_keep
class Q8_0(BlockType):
    """fp16 d, then the 32 int8 weights in order."""

    name, scheme, group, has_zero_point = "Q8_0", "w8a8", 32, False

    def decode(self, blocks):
        return np.ascontiguousarray(blocks[:, 2:34]).view(np.int8), _f16(blocks, 0)[:, None].astype(np.float32), None


def _k_affine(blocks: np.ndarray, q: np.ndarray, centre: int):
    """Q4_K/Q5_K: fp16 d, fp16 dmin, 12 bytes of sub-scales; q = u - centre [B, 256]. w = d sc u - dmin mn."""
    sc, mn = _k_scales(blocks[:, 4:16])
    return _affine(q, _f16(blocks, 0)[:, None] * sc, -_f16(blocks, 2)[:, None] * mn, centre)


def _k_kscales(blocks: np.ndarray):
    # Q4_K/Q5_K: sc, mn in 0..63 (int8 holds them), fp16 d and dmin
    sc, mn = _k_scales(blocks[:, 4:16])
    return sc.astype(np.int8), mn.astype(np.int8), _f16(blocks, 0), _f16(blocks, 2)


@_keep
class Q4_K(BlockType):
    """fp16 d, fp16 dmin, 12 bytes of 6-bit sub-scales and mins, 128 bytes: bytes 32i..32i+31 hold
    sub-block 2i in their low nibbles and sub-block 2i + 1 in their high ones."""

    name, scheme, group, has_zero_point = "Q4_K", "w4a8", 32, True
    kshift = 8  # q = u - 8

    def kscales(self, blocks):
        return _k_kscales(blocks)

    def decode(self, blocks):
        q = _native_q(self.name, blocks)
        if q is None:
            q = _centred(_planes(blocks[:, 16:144].reshape(-1, 4, 32), 4), 8)
        return _k_affine(blocks, q, 8)


@_keep
class Q5_K(BlockType):
    """Q4_K's header, then 32 bytes of 5th bits (bit j of byte l: weight l of sub-block j), then
    Q4_K's 128 bytes of low nibbles."""

    name, scheme, group, has_zero_point = "Q5_K", "w8a8", 32, True
    kshift = 16  # q = u - 16

    def kscales(self, blocks):
        return _k_kscales(blocks)

    def decode(self, blocks):
        q = _native_q(self.name, blocks)
        if q is None:
            low = _planes(blocks[:, 48:176].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
            q = _centred(low | (_planes(blocks[:, 16:48], 1) << 4), 16)
        return _k_affine(blocks, q, 16)


@_keep
class Q6_K(BlockType):
    """128 bytes of low nibbles (per half h of 128 weights, bytes 64h..64h+63: weights 128h + l in the
    low nibbles, 128h + 64 + l in the high ones), 64 bytes of high 2 bits (per half, bytes
    32h..32h+31, bits 2j..2j+1: weight 128h + 32j + l), 16 int8 sub-scales (one per 16 weights),
    fp16 d. w = d sc (u - 32)."""

    name, scheme, group, has_zero_point = "Q6_K", "w8a8", 16, False
    kshift = 0  # q = u - 32, which is what d sc multiplies

    def kscales(self, blocks):
        return np.ascontiguousarray(blocks[:, 192:208]).view(np.int8), None, _f16(blocks, 208), None

    def decode(self, blocks):
        q = _native_q(self.name, blocks)
        if q is None:
            low = _planes(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, 256)
            high = _planes(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, 256)
            q = (low | (high << 4)).astype(np.int8) - 32
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float64)
        return q, (_f16(blocks, 208)[:, None] * sc).astype(np.float32), None


def _two_bit(qs: np.ndarray) -> np.ndarray:
    # Q2_K/Q3_K's 64 bytes of 2-bit values: per half h, bytes 32h..32h+31, bits 2j..2j+1: weight
    # 128h + 32j + l
    return _planes(qs.reshape(-1, 2, 32), 2).reshape(-1, 256)


@_keep
class Q2_K(BlockType):
    """16 bytes of sub-scales (low nibble sc, high nibble mn, one per 16 weights), 64 bytes of 2-bit
    values, fp16 d, fp16 dmin. w = d sc u - dmin mn."""

    name, scheme, group, has_zero_point = "Q2_K", "w8a8", 16, True
    kshift = 2  # q = u - 2

    def kscales(self, blocks):
        s = blocks[:, 0:16]
        return (s & 15).astype(np.int8), (s >> 4).astype(np.int8), _f16(blocks, 80), _f16(blocks, 82)

    def decode(self, blocks):
        s = blocks[:, 0:16]
        q = _centred(_two_bit(blocks[:, 16:80]), 2)
        return _affine(q, _f16(blocks, 80)[:, None] * (s & 15), -_f16(blocks, 82)[:, None] * (s >> 4), 2)


@_keep
class Q3_K(BlockType):
    """32 bytes of high-bit mask (bit j of byte l: weight 32j + l), 64 bytes of 2-bit values (as
    Q2_K), 12 bytes of 6-bit sub-scales (bytes 0-7: low nibbles of sc 0-7, then their high nibbles of
    sc 8-15; bytes 8-11, bits 2j..2j+1 of byte 8 + i: the top 2 bits of sc 4j + i), fp16 d.
    w = d (sc - 32) q with q = low 2 bits - 4 where the mask bit is clear: q in [-4, 3]."""

    name, scheme, group, has_zero_point = "Q3_K", "w8a8", 16, False
    kshift = 0  # q = q3, which is what d (sc - 32) multiplies

    @staticmethod
    def _sc(blocks):  # the 16 signed sub-scales sc - 32, in [-32, 31]
        s = blocks[:, 96:108]
        sc = _low_high(s[:, 0:8]) | (_planes(s[:, 8:12], 2).reshape(-1, 16) << 4)
        return sc.astype(np.int8) - 32

    def kscales(self, blocks):
        return self._sc(blocks), None, _f16(blocks, 108), None

    def decode(self, blocks):
        hmask = _planes(blocks[:, 0:32], 1).reshape(-1, 256)
        q = _two_bit(blocks[:, 32:96]).astype(np.int8) - 4 * (1 - hmask).astype(np.int8)
        return q, (_f16(blocks, 108)[:, None] * self._sc(blocks).astype(np.float64)).astype(np.float32), None
