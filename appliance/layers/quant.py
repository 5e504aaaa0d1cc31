"""Quantized linear layers: W8A8 and W4A8, swapped in for ``Linear`` at load.

One canonical form per layer, whatever the source (a float checkpoint quantized at load, a
compressed-tensors checkpoint, a converted one): ``qweight`` int8 ``[out, in]`` holding the signed
integer values (int8 in [-127, 127], or [-128, 127] from a GGUF's Q8_0; int4 in [-8, 7]),
``weight_scale`` float32
``[out, in // group_size]`` (``group_size == in``: one scale per output channel) and, for W4,
``weight_zero_point`` float32 of the same shape (W8 too when grouped): ``w = (q - zero_point) * scale``.

W8 is symmetric per channel, rounded to nearest (a GGUF's blocks are W8 groups of 32 or 16, some
with a zero point, see below: only ``w8a8_native`` runs W8 groups, ``backend_valid`` keeps them from
the other backends).
W4 is rounded to nearest on each group's min/max grid (16 levels from the group's minimum to its maximum, a float zero point): the grid of GGUF's
Q4_1, in which the default model ships, where a symmetric 4-bit grid costs +22-32% perplexity;
quantizing Q4_1's dequantized weights this way gives back its integers exactly (only the scales
move, rounded to bf16: a weight by up to 15 * 2^-8 of a step). Symmetric W4 checkpoints load with
zero point 0. Fused projections (q/k/v, gate/up) are one QuantLinear: scales are per output row, so
quantizing the fused weight equals quantizing its shards.

A GGUF's Q4_0 and Q4_1 blocks are this form already at group size 32, and a GGUF loaded with w4a8 at
that group size (the default; so the default model too) takes them as they are
(``appliance.models.gguf_loader.GGUFSource``): ``q = u - 8`` of the block's nibbles ``u``, its
fp16 scale ``d`` (held exactly, not rounded to bf16), zero point 0 (Q4_0) or ``-8 - m / d`` (Q4_1,
``w = d * u + m``). Q4_0 scales may be negative. Likewise a GGUF loaded with w8a8 takes its Q8_0
blocks as W8 at group size 32 (``gguf_loader.GGUFSource``): the block's int8 ``q`` as they are
(-128 included) and its fp16 ``d`` as the fp32 scale, exactly; those layers run on ``w8a8_native``.
Every GGUF block type kept this way (K-quants, Q5 types) and its mapping: ``appliance.models.gguf_quants``.

Activations (A8) are quantized per token, dynamically, asymmetrically to int8 (KleidiAI's qai8dx
scheme, ``methods.qmath.quant_act``), by every A8 method.

Each method (``appliance.layers.methods``: ``int8`` for W8, ``int4`` for W4) packs that form once
(``set_backend``) and has an exact fp64 reference of the math it performs (``reference``), which the
tests hold it against. The module-level ``pack``, ``run``, ``reference``, ``backend_valid`` and
``host_problem`` take a method's name; ``QuantLinear`` goes through ``pack`` and ``run``.
"""
from __future__ import annotations

import torch
from torch import nn

from appliance.layers import methods
from appliance.layers.linear import LinearBase, relative_cost
from appliance.layers.methods.int8 import onednn_int8_problem  # noqa: F401 - its public name (w8a8_onednn)
from appliance.layers.methods.qmath import QuantMethod, dequantize  # noqa: F401 - dequantize: public here
from appliance.layers.methods.qmath import offset as _offset  # noqa: F401 - tests use these names
from appliance.layers.methods.qmath import quant_act as _quant_act  # noqa: F401
from appliance.layers.methods.qmath import quant_act_asym as _quant_act_asym  # noqa: F401

SCHEMES = ("w8a8", "w4a8")
# scheme -> names of the methods that run it, in the registry's order
BACKENDS = {scheme: tuple(m.name for m in methods.of_scheme(scheme)) for scheme in SCHEMES}
QUANT_BACKENDS = tuple(b for bs in BACKENDS.values() for b in bs)


# ---------------------------------------------------------------- quantization (round to nearest)

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K] in [-127, 127], float32 scale [N, 1]), per-channel symmetric."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K] in [-8, 7], float32 scale and zero point [N, K // group]): each
    group's [min, max] in 16 steps, ``w ~ (q - zp) * scale``.

    Group scales are rounded to bf16 first (KleidiAI keeps them in bf16), so every backend and a
    saved checkpoint see the same scale values; channel-wise scales stay fp32."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"quant_group_size={group_size} does not divide the input size {k}")
    wg = w.float().reshape(n, k // group_size, group_size)
    mn, mx = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((mx - mn) / 15).clamp(min=1e-12)
    if group_size != k:
        scale = scale.to(torch.bfloat16).float().clamp(min=1e-12)
    u = torch.round((wg - mn[..., None]) / scale[..., None]).clamp(0, 15)
    return (u - 8).to(torch.int8).reshape(n, k), scale, -8 - mn / scale


def pack_int4_to_int32(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack-quantized``: int4 [-8, 7] [N, K] -> int32 [N, K / 8], value j of each
    run of 8 at bits 4j, stored offset by +8."""
    n, k = q.shape
    u = (q.to(torch.int32) + 8).reshape(n, k // 8, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_int32_to_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    n = packed.shape[0]
    shifts = torch.arange(8, dtype=torch.int32) * 4
    u = (packed.to(torch.int32)[..., None] >> shifts) & 0xF
    return (u.reshape(n, -1)[:, :k] - 8).to(torch.int8)


# ---------------------------------------------------------------- the methods, by name

def _method(backend: str, what: str) -> QuantMethod:
    m = methods.get(backend)
    if not isinstance(m, QuantMethod):
        raise ValueError(f"{what} {backend!r}")
    return m


def reference(backend: str, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 result of the quantized math ``backend`` performs. x [M, K] -> [M, N] float64."""
    return _method(backend, "no reference for backend").reference(x, qweight, scale, bias, zero_point)


def pack(backend: str, qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> dict:
    """Everything ``run`` needs, built once from the canonical form."""
    return _method(backend, "unknown quantized backend").pack(qweight, scale, zero_point)


def run(backend: str, p: dict, x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """x [M, K] float32/bf16 -> [M, N] float32 (without bias); ``p`` from ``pack`` of an [n, k] weight."""
    return _method(backend, "unknown quantized backend").apply(p, x)


def _native_available() -> bool:
    from appliance.ops import native

    return native.is_available()


def host_problem(backend: str) -> str | None:
    """Why ``backend`` cannot run on this host (its CPU, torch build and ISA caps), or None."""
    m = methods.get(backend)
    return None if m is None else m.host_problem()


def backend_valid(backend: str, scheme: str, n: int, k: int, group_size: int) -> bool:
    """Whether ``backend`` can run a ``scheme`` layer of ``[n, k]`` with this group size on this host."""
    m = methods.get(backend)
    return m is not None and m.scheme == scheme and m.takes(n, k, group_size) and m.host_problem() is None


def packed_bytes(p: dict) -> int:
    return sum(v.numel() * v.element_size() for v in p.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------- the layer

# Before set_backend a QuantLinear computes the fp64 reference of its scheme's weight-only method.
_UNPACKED_REFERENCE = {"w8a8": "w8a16_int8pack", "w4a8": "w4a16_int4pack"}


class QuantLinear(LinearBase):
    """y = x W^T + b with W held quantized (see the module docstring). x [..., in] -> [..., out]."""

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int | None = None,
                 bias: bool = False, shards: dict[str, tuple[int, int]] | None = None, w8_groups: bool = False):
        """W8 layers are per channel (``group_size`` ignored) unless ``w8_groups``: then W8 keeps
        ``group_size`` too, and a zero point as W4 does (a GGUF's blocks: Q8_0 group 32, Q6_K group 16,
        Q5_1/Q5_K with zero points; ``appliance.models.gguf_quants``), which only ``w8a8_native`` takes."""
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"quantization must be one of none, {', '.join(SCHEMES)}; got {scheme!r}")
        g = in_features if (scheme == "w8a8" and not w8_groups) or not group_size else group_size
        if in_features % g:
            raise ValueError(f"quant_group_size={g} does not divide the input size {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size = scheme, g
        self.qweight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, in_features // g, dtype=torch.float32),
                                         requires_grad=False)
        # W4 and grouped W8: w = (q - zero_point) * scale (0 for symmetric checkpoints)
        self.weight_zero_point = nn.Parameter(torch.zeros(out_features, in_features // g, dtype=torch.float32),
                                              requires_grad=False) if scheme == "w4a8" or w8_groups else None
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        self.method: QuantMethod | None = None  # set_backend's choice
        self.packed: dict | None = None  # what the method packed

    @classmethod
    def from_float(cls, lin: nn.Module, scheme: str, group_size: int | None) -> QuantLinear:
        w = lin.weight.data
        q = cls(lin.in_features, lin.out_features, scheme, group_size, lin.bias is not None, dict(lin.shards))
        from appliance.layers.parallel import inherit

        inherit(q, lin)  # a rank's part quantized as it is (its sizes are the part's already)
        if "stored_formats" in lin.__dict__:  # what the checkpoint held (appliance.layers.weight_report)
            q.__dict__["stored_formats"] = dict(lin.__dict__["stored_formats"])
        if scheme == "w8a8":
            q.qweight.data, q.weight_scale.data = quantize_int8(w)
        else:
            q.qweight.data, q.weight_scale.data, q.weight_zero_point.data = quantize_int4(w, q.group_size)
        if lin.bias is not None:
            q.bias.data = lin.bias.data.clone()
        return q

    # a checkpoint's "<layer>.weight" (a QuantizedWeight record) fills qweight, scale and zero point
    checkpoint_aliases = {"weight": "qweight"}

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: str | None = None) -> None:
        """A ``QuantizedWeight`` into the shard's rows, or the bias (``appliance.layers.weight_loading``)."""
        from appliance.layers.weight_loading import load_quant_linear

        load_quant_linear(self, param, loaded, shard_id)

    @property
    def shape_key(self) -> str:
        # "|6b" / "|5b": a W8 layer whose values fit 6 / 5 bits (w6a8_native / w5a8_native are candidates
        # for it, not for the others)
        six = "" if self.scheme != "w8a8" else "|5b" if self._fits_bits(5) else "|6b" if self._fits_bits(6) else ""
        kq = "|kq" if self._kquant_methods() else ""
        return f"{self.scheme}g{self.group_size}|{self.out_features}x{self.in_features}{six}{kq}"

    def kquant_tables(self) -> dict | None:
        """The layer's K-quant scales (``gguf_quants.KQuantScales`` of every shard, or of the tied
        embedding's table) as whole-layer tables at the layer's group: ``sub``/``submin`` int8 [N, K/G],
        ``sup``/``supmin`` float32 [N, K/S] (``submin``/``supmin`` None where no shard has mins; zeros for
        the rows of one that has none), ``shift`` int16 [N], ``group``, ``super``. None unless every row
        has them at one super-block size: the layer is then packed from its canonical form only."""
        if "_kq_tables" in self.__dict__:
            return self.__dict__["_kq_tables"]
        store = self.__dict__.get("_kquant")
        tied = self.__dict__.get("tied_embedding")
        if store is None and tied is not None:
            store = tied.__dict__.get("_kquant")
        self.__dict__["_kq_tables"] = t = _kquant_tables(store, self.shards, self.out_features, self.in_features,
                                                          self.group_size) if store else None
        return t

    def preferred_backend(self) -> str | None:
        """A method chosen without measuring unless another is asked for: one that keeps the layer's
        K-quant scales (its weights at rest at about the file's size, and the fewest bytes a decode
        step reads), or None."""
        kq = self._kquant_methods()
        return kq[0] if kq else None

    def _kquant_methods(self) -> list[str]:
        """The valid methods that would hold this layer's K-quant scales (none without them)."""
        if "_kq_methods" not in self.__dict__:
            t = self.kquant_tables()
            self.__dict__["_kq_methods"] = [] if t is None else [
                m.name for m in methods.of_scheme(self.scheme)
                if hasattr(m, "takes_kquant") and m.host_problem() is None
                and backend_valid(m.name, self.scheme, self.out_features, self.in_features, self.group_size)
                and m.takes_kquant(self.qweight.data, t)]
        return self.__dict__["_kq_methods"]

    def _fits_bits(self, bits: int) -> bool:
        """Whether every value lies in [-2^(bits-1), 2^(bits-1) - 1] (a low-bit method's range)."""
        if "_qrange" not in self.__dict__:  # decided once, on the loaded weights (released after packing)
            q = self.qweight.data.numpy()  # numpy's int8 min/max are ~100x faster than torch's
            self.__dict__["_qrange"] = (int(q.min()), int(q.max())) if q.size else None
        r = self.__dict__["_qrange"]
        return r is not None and r[0] >= -(1 << (bits - 1)) and r[1] < 1 << (bits - 1)

    def candidates(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        if device.type != "cpu":
            return []
        names = [m.name for m in methods.of_scheme(self.scheme)
                 if backend_valid(m.name, self.scheme, self.out_features, self.in_features, self.group_size)
                 and (not hasattr(m, "bits") or self.scheme != "w8a8" or self._fits_bits(m.bits))]
        # w5a8_native runs w6a8_native's kernel on one plane less: the 6-bit form is only offered where
        # it would keep the layer's K-quant scales (which the 5-bit form does not)
        if "w5a8_native" in names and "w6a8_native" not in self._kquant_methods():
            names = [n for n in names if n != "w6a8_native"]
        return names

    def measure(self, candidates: list[str], rows, timer) -> dict[str, float]:
        n, k = self.out_features, self.in_features
        w = torch.randn(n, k) * 0.02
        qw, s, *zp = quantize_int8(w) if self.scheme == "w8a8" else quantize_int4(w, self.group_size)
        if self.scheme == "w8a8" and self.group_size != k:  # time the layer's own group size
            s = s.repeat_interleave(k // self.group_size, dim=1)
        fns, held = {}, {}
        for name in candidates:
            m = methods.get(name)
            # timing does not depend on the values: a method taking fewer bits gets them clamped
            c = 1 << (getattr(m, "bits", 8) - 1)
            p = pack(name, qw.clamp(-c, c - 1) if self.scheme == "w8a8" and c < 128 else qw, s, *zp)
            held[name] = packed_bytes(p)
            xs = {m: torch.randn(m, k) for m in rows}  # not timed
            fns[name] = {m: (lambda x=xs[m], b=name, p=p: run(b, p, x, n, k)) for m in rows}
        self.__dict__["_timed_bytes"] = held
        return relative_cost(fns, timer)

    def held_bytes(self, candidates: list[str]) -> dict[str, int]:
        """The bytes each candidate's packing of this shape held when ``measure`` timed it."""
        held = self.__dict__.pop("_timed_bytes", {})
        return {c: held[c] for c in candidates if c in held}

    def set_backend(self, name: str) -> None:
        if self.qweight.numel() == 0:
            raise RuntimeError("QuantLinear.set_backend: already packed (the canonical weights are released)")
        names = [m.name for m in methods.of_scheme(self.scheme)]
        if name not in names:
            raise ValueError(f"linear backend {name!r} cannot run {self.scheme} layers; use one of {', '.join(names)}")
        # pack and run by name (thin over the method): the seam a test stands in at for a kernel
        if name in self._kquant_methods():
            self.packed = methods.get(name).pack_kquant(self.qweight.data, self.kquant_tables())
        else:
            self.packed = pack(name, self.qweight.data, self.weight_scale.data, self._zp())
        self.method = methods.get(name)
        for key in ("_kquant", "_kq_tables"):  # packed (or not taken): no longer read
            self.__dict__.pop(key, None)
        tied = self.__dict__.get("tied_embedding")  # a QuantEmbedding sharing the canonical tensors
        if tied is not None and not self.method.gives_rows:
            return  # the embedding still reads its rows from them (appliance.layers.vocab)
        # the canonical form is no longer read (int8pack holds qweight itself, by reference)
        for t in (self.qweight, self.weight_scale, self.weight_zero_point):
            if t is not None:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if tied is not None:  # the embedding reads its rows from the packed form now
            tied.__dict__["_rows_from"] = self
            tied.__dict__.pop("_kquant", None)

    def weight_bytes(self) -> int:
        b = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        if self.packed is not None:  # plus the canonical form where it is still held (a tied embedding reads it)
            held = sum(t.numel() * t.element_size() for t in (self.qweight, self.weight_scale, self.weight_zero_point)
                       if t is not None)
            return packed_bytes(self.packed) + b + held
        return self.qweight.numel() * (1 if self.scheme == "w8a8" else 0.5) + self.weight_scale.numel() * 8 + b

    def _zp(self) -> torch.Tensor | None:
        return None if self.weight_zero_point is None else self.weight_zero_point.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:  # not packed yet (before select_backends): the fp64 reference math
            # W8 groups (and their zero points) are w8a8_native's alone
            name = ("w8a8_native" if self.scheme == "w8a8" and self.group_size != self.in_features
                    else _UNPACKED_REFERENCE[self.scheme])
            y = reference(name, x.reshape(-1, self.in_features), self.qweight.data, self.weight_scale.data,
                          zero_point=self._zp())
        else:
            y = run(self.backend, self.packed, x.reshape(-1, self.in_features), self.out_features, self.in_features)
        if self.bias is not None:
            y = y + self.bias.float()
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.tp_mode is not None:
            from appliance.layers.parallel import finish

            return finish(self, y)
        return y

    def fused_descriptor(self):
        # as forward applies it: the method's kernel, then the bias in float32, cast to x's dtype
        d = None if self.packed is None else self.method.fused_descriptor(self.packed)
        return None if d is None else d.with_bias(self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}, "
                f"group={self.group_size}, bias={self.bias is not None}, backend={self.backend}")


def _kquant_tables(store: dict, shards: dict, n: int, k: int, g: int) -> dict | None:
    # shard id -> (first row, rows); a layer the file stores whole (or unfused) is one shard, None
    parts = [(None, 0, n)] if None in store or not shards else [(sid, o, r) for sid, (o, r) in shards.items()]
    if any(sid not in store for sid, _, _ in parts):
        return None
    kqs = [store[sid] for sid, _, _ in parts]
    sb = kqs[0].super_block
    if any(kq.super_block != sb or kq.group % g for kq in kqs) or k % sb or sb % g:
        return None
    has_min = any(kq.submin is not None for kq in kqs)
    sub = torch.zeros(n, k // g, dtype=torch.int8)
    submin = torch.zeros(n, k // g, dtype=torch.int8) if has_min else None
    sup = torch.zeros(n, k // sb, dtype=torch.float32)
    supmin = torch.zeros(n, k // sb, dtype=torch.float32) if has_min else None
    shift = torch.zeros(n, dtype=torch.int16)
    for (_, o, r), kq in zip(parts, kqs):
        if tuple(kq.sub.shape) != (r, k // kq.group) or tuple(kq.sup.shape) != (r, k // sb):
            return None
        rep = kq.group // g  # a scale per 32 is the same scale twice per 16 (a widened fused layer)
        sub[o:o + r] = kq.sub.repeat_interleave(rep, dim=1)
        sup[o:o + r] = kq.sup
        if kq.submin is not None:
            submin[o:o + r] = kq.submin.repeat_interleave(rep, dim=1)
            supmin[o:o + r] = kq.supmin
        shift[o:o + r] = kq.shift
    return {"group": g, "super": sb, "sub": sub, "submin": submin, "sup": sup, "supmin": supmin, "shift": shift}


def quantize_model(model: nn.Module, scheme: str, group_size: int | None, skip=("lm_head",)) -> nn.Module:
    """Swap every float ``Linear`` (except those named in ``skip``) for a QuantLinear, in place."""
    from appliance.layers.linear import Linear

    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            full = f"{name}.{cname}" if name else cname
            if isinstance(child, Linear) and cname not in skip and full not in skip:
                setattr(mod, cname, QuantLinear.from_float(child, scheme, group_size))
    return model
