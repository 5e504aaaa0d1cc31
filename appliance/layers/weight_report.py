"""What a loaded model's weights are, per layer group: the stored format (as the checkpoint holds
it), the linear method each runs with, and the resident bytes. The one place ``appliance doctor
--model`` and the server's start-up banner take it from.

A group is (role, stored format, method): the role is the projection kind (``qkv``, ``o``,
``gate_up``, ``down``, ``lm_head``, ``embedding``; ``expert ...`` inside a mixture of experts;
``other`` for norms and the rest), the stored format what the weight loading loop recorded for the
layer (``appliance.models.loader.load_weights``: a GGUF tensor type such as ``Q4_K``, ``F32`` /
``BF16`` / ``F16`` for float checkpoints, ``AWQ-int4`` / ``GPTQ-int4``, ``w8a8 g32``-style for other
quantized records; a fused layer whose shards differ lists each, ``Q4_K+Q6_K``). Resident bytes are
the tensors the forward pass holds after packing (the method's packed tensors, a bias, a canonical
form still read by a tied embedding, parameters of other modules), each storage counted once: a
tied lm_head and its embedding share one table, counted in the group that comes first.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

# checkpoint leaf name -> role
_ROLES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "o_proj": "o",
          "gate_proj": "gate_up", "up_proj": "gate_up", "gate_up_proj": "gate_up", "down_proj": "down",
          "lm_head": "lm_head", "embed_tokens": "embedding"}
# float dtypes by the names safetensors and GGUF give them
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class WeightGroup:
    role: str
    stored: str
    method: str
    layers: int
    bytes: int


def stored_format_of(value) -> str:
    """The stored format of a checkpoint tensor as a weight source yields it, when the source names
    none itself: the float dtype, or a quantized record's scheme and group size."""
    from appliance.layers.weight_loading import QuantizedWeight, ShiftedWeight

    if isinstance(value, QuantizedWeight):
        return f"{value.scheme} g{value.group_size}"
    if isinstance(value, ShiftedWeight):
        value = value.value
    dtype = getattr(value, "dtype", None)
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def note_stored_format(module: nn.Module | None, fmt: str) -> None:
    """Record that a weight of ``module`` arrived stored as ``fmt`` (called by the loading loop)."""
    if module is not None and fmt:
        module.__dict__.setdefault("stored_formats", {})[fmt] = None


def _role(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    role = _ROLES.get(leaf, "other")
    return f"expert {role}" if ".experts." in f".{name}." and role != "other" else role


def _tensors(mod: nn.Module) -> list[torch.Tensor]:
    """The tensors ``mod`` holds for its forward pass (see the module docstring)."""
    from appliance.layers.linear import LinearBase

    out = []
    packed = getattr(mod, "packed", None) if isinstance(mod, LinearBase) else None
    if isinstance(packed, dict):
        out += [t for t in packed.values() if isinstance(t, torch.Tensor)]
    out += [p for p in mod.parameters(recurse=False)]
    return out


def _key(t: torch.Tensor):
    try:
        return (t.untyped_storage().data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    except (RuntimeError, NotImplementedError):  # an opaque (oneDNN-reordered) tensor: no storage pointer
        return id(t)


def _method(name: str, mod: nn.Module) -> str:
    from appliance.layers.linear import LinearBase

    if isinstance(mod, LinearBase):
        return mod.backend
    if isinstance(mod, nn.Embedding) or hasattr(mod, "num_embeddings"):
        return "lookup(lm_head)" if getattr(mod, "_rows_from", None) is not None else "lookup"
    return "-"


def weight_groups(model: nn.Module) -> list[WeightGroup]:
    """One row per (role, stored format, method) over every module holding weights: embedding, qkv, o,
    gate_up, down, lm_head, then the rest; within a role in model order."""
    seen: set = set()
    rows: dict[tuple[str, str, str], list[int]] = {}
    # a tied lm_head is stored as its embedding (appliance.layers.vocab.tied_lm_head)
    tied = {id(m.__dict__["_tied_head"]): m for m in model.modules() if "_tied_head" in m.__dict__}
    for name, mod in model.named_modules():
        tensors = _tensors(mod)
        if not tensors:
            continue
        formats = mod.__dict__.get("stored_formats") or tied.get(id(mod), mod).__dict__.get("stored_formats", {})
        nbytes = 0
        for t in tensors:
            k = _key(t)
            if k in seen or t.numel() == 0:
                continue
            seen.add(k)
            nbytes += t.numel() * t.element_size()
        stored = "+".join(sorted(formats)) or "-"
        row = rows.setdefault((_role(name), stored, _method(name, mod)), [0, 0])
        row[0] += 1
        row[1] += nbytes
    order = {r: i for i, r in enumerate(("embedding", "qkv", "o", "gate_up", "down", "lm_head"))}

    def rank(key):  # a decoder's order, experts after their dense kind, the rest last; stable within
        role = key[0].removeprefix("expert ")
        return order.get(role, len(order)) + (0.5 if key[0].startswith("expert ") else 0)

    return [WeightGroup(r, s, m, n, b) for (r, s, m), (n, b) in sorted(rows.items(), key=lambda kv: rank(kv[0]))]


def total_bytes(groups: list[WeightGroup]) -> int:
    return sum(g.bytes for g in groups)


def as_dicts(groups: list[WeightGroup]) -> list[dict]:
    """JSON-safe rows (the engine core sends them to the server process for its banner)."""
    return [asdict(g) for g in groups]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def format_groups(groups: list[WeightGroup | dict]) -> str:
    """A compact text table: role, stored format, method, layers, resident MiB, then the total."""
    gs = [g if isinstance(g, WeightGroup) else WeightGroup(**g) for g in groups]
    head = ("role", "stored", "method", "layers", "resident")
    body = [(g.role, g.stored, g.method, str(g.layers), _mib(g.bytes)) for g in gs]
    body.append(("total", "", "", str(sum(g.layers for g in gs)), _mib(total_bytes(gs))))
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'>' if i >= 3 else '<'}{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r).rstrip() for r in [head, *body])
