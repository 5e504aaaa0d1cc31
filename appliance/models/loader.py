"""Load a model: a Hugging Face directory (config.json, one or many *.safetensors with an index,
generation_config.json; float, compressed-tensors, AWQ or GPTQ) or a GGUF file, quantized or not.

One path for every format (rule 7):
1. ``open_source``: the weight source the checkpoint needs (``appliance.models.weight_sources``);
2. ``build_model_for``: the model on the meta device, a ``QuantLinear`` for every layer all of whose
   checkpoint shards arrive quantized alike (same scheme and group size), a float ``Linear``
   otherwise (a quantized shard of a float layer is dequantized by the layer's loader);
3. ``load_weights``: one loop over the source, each tensor handed to its parameter's loader
   (``appliance.layers.weight_loading``), which knows its shard of a fused weight; streamed tensor by
   tensor from mmap'ed files, so a checkpoint is never held twice in RAM;
4. ``process_weights_after_loading``: float layers quantized when ``--quantization`` asks, float
   parameters cast to the model dtype. The linear method of every layer is then picked and packed by
   ``appliance.layers.linear.select_backends`` once the runner knows its ops.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from appliance.errors import ModelLoadError
from appliance.models.registry import resolve_architecture

log = logging.getLogger("appliance")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    architecture: str
    hf_config: dict
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing (a model directory needs config.json)")
    try:
        return json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from e


def _eos_ids(path: Path, hf: dict) -> tuple[int, ...]:
    ids: list[int] = []

    def add(v):
        if v is None:
            return
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, int) and t not in ids:
                ids.append(t)

    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen}: not valid JSON ({e})") from e
    add(hf.get("eos_token_id"))
    add(_text_config(hf).get("eos_token_id"))
    return tuple(ids)


def _text_config(hf: dict) -> dict:
    """The text model's config: ``text_config`` of a multimodal checkpoint (Gemma 3), else the config."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def _max_position(hf: dict) -> int:
    return int(hf.get("max_position_embeddings") or _text_config(hf).get("max_position_embeddings", 2048))


def model_info(path: Path) -> ModelInfo:
    """The model at ``path``: a model directory, or a GGUF file (its config built in memory from the
    file's metadata; nothing is written)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from appliance.models import gguf_loader

        hf, gen = gguf_loader.gguf_configs(path)
        eos = gen.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(dict.fromkeys(eos if isinstance(eos, list) else [] if eos is None else [eos]))
        return ModelInfo(path, resolve_architecture(hf, path), hf, eos_ids,
                         int(hf.get("max_position_embeddings", 2048)))
    hf = read_config(path)
    arch = resolve_architecture(hf, path / "config.json")
    return ModelInfo(path, arch, hf, _eos_ids(path, hf), _max_position(hf))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    return files


def iter_weights(path: Path, skip=lambda name: False):
    """Yield (file, tensor name, tensor) from every safetensors file, one tensor at a time; tensors
    whose name ``skip`` accepts are never read."""
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if not skip(name):
                        yield f, name, st.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{f}: cannot read safetensors file ({type(e).__name__}: {e})") from e


def load_model(info: ModelInfo, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model of ``info`` as its checkpoint holds it (no quantization asked)."""
    return load(info, dtype, device)


def open_source(info: ModelInfo, quantization: str = "none", group_size: int = 32, linear_backend: str = "auto"):
    """The weight source for ``info`` (see ``appliance.models.weight_sources``). Raises ModelLoadError
    for a quantization_config this appliance does not read, or ``quantization`` asked of a checkpoint
    that is quantized already."""
    from appliance.models import awq_gptq, gguf_loader
    from appliance.models.weight_sources import CompressedTensorsSource, SafetensorsSource, parse_compressed_tensors

    if info.path.is_file():  # a GGUF (model_info accepts no other file)
        keep = gguf_loader.kept_types(quantization, group_size, linear_backend, info.path)
        return gguf_loader.GGUFSource(info.path, keep, info.hf_config)
    if quantization == "gguf" and gguf_loader.gguf_source(info.path) is None:
        raise ModelLoadError(f"{info.path}: quantization=gguf keeps a GGUF file's own quantized tensors; this model "
                             "is a directory, not a GGUF (use none, w8a8 or w4a8)")
    where = str(info.path / "config.json")
    qc = info.hf_config.get("quantization_config")
    source, scheme = None, None
    if isinstance(qc, dict) and qc.get("quant_method") in awq_gptq.METHODS:
        source = awq_gptq.AwqGptqSource(info.path, info.hf_config, awq_gptq.parse(qc, where))
        scheme = "w4a8"
    else:
        spec = parse_compressed_tensors(info.hf_config, where)
        if spec is not None:
            source, scheme = CompressedTensorsSource(info.path, info.hf_config, spec), spec.scheme
    if source is not None:
        if quantization not in ("none", scheme):
            raise ModelLoadError(f"{info.path}: the checkpoint is already quantized ({scheme}); "
                                 f"quantization={quantization} cannot re-quantize it")
        return source
    src = gguf_loader.gguf_source(info.path)  # a directory converted from a GGUF that is still there
    keep = gguf_loader.kept_types(quantization, group_size, linear_backend, src) if src is not None else ()
    if keep:
        return gguf_loader.GGUFSource(src, keep, info.hf_config, float_from=SafetensorsSource(info.path, info.hf_config))
    return SafetensorsSource(info.path, info.hf_config)


def load(info: ModelInfo, dtype: torch.dtype, device: torch.device, quantization: str = "none",
         group_size: int = 32, linear_backend: str = "auto") -> torch.nn.Module:
    """The model of ``info``, quantized as its checkpoint says or as ``quantization`` asks.
    ``linear_backend``: the backend the engine will force, if any (a GGUF's W8 groups run only on
    some). Raises ModelLoadError naming the file, the tensor and what was expected."""
    source = open_source(info, quantization, group_size, linear_backend)
    prequantized = source.prequantized  # its float layers stay float (ignored on purpose)
    model = build_model_for(info, source, device)
    # float layers to be quantized are loaded in fp32 (quantized from the checkpoint's values, not a
    # bf16 copy, as `convert` does)
    # "gguf": the file's quantized projections as they are, the others float
    quantize_floats = quantization in ("w8a8", "w4a8") and not prequantized
    cast_float(model, torch.float32 if quantize_floats else dtype)
    load_weights(model, source, info.architecture)
    if hasattr(source, "close"):  # a GGUF: its mmap'ed pages and parsed metadata are not read again
        source.close()
    process_weights_after_loading(model, quantization if quantize_floats else "none", group_size, dtype, info.path)
    n_q = sum(1 for m in model.modules() if _is_quant(m))
    if n_q and not prequantized:
        log.info("%s: %d projections taken quantized as the file holds them; the others %s", source.path, n_q,
                 "quantized from float" if quantize_floats else "float")
    return model


def _is_quant(m) -> bool:
    """A module holding the canonical quantized form (qweight, weight_scale, weight_zero_point)."""
    from appliance.layers.quant import QuantLinear
    from appliance.layers.vocab import QuantEmbedding

    return isinstance(m, (QuantLinear, QuantEmbedding))


def build_model_for(info: ModelInfo, source, device: torch.device) -> torch.nn.Module:
    """The model on ``device`` (uninitialized): a ``QuantLinear`` for every layer all of whose
    checkpoint weights ``source`` gives quantized with one scheme and group size (an untied lm_head
    too: a GGUF's output.weight of a kept type), else float; a ``QuantEmbedding`` for an embedding
    table it gives quantized.

    The rule for a fused q/k/v or gate/up whose shards differ (a GGUF mixing types, a partly ignored
    compressed-tensors layer): shards that are all grouped W4 / W8 (a Q4_K_M file's Q4_K q/k with a
    Q6_K v) are held together as W8 groups of the smallest group, each shard's integers as they are
    and its scales and zero points repeated over the finer groups: exact (``_widened``). Otherwise the
    whole layer is float, its quantized shards dequantized at load, and it is quantized afterwards only
    if ``--quantization`` asks (as any float layer): a fused layer has one method and one group size."""
    from appliance.layers.linear import Linear
    from appliance.layers.quant import QuantLinear
    from appliance.models.registry import build_model

    qlayers = source.quantized_layers()
    with torch.device("meta"):
        model = build_model(info.architecture, info.hf_config)
        for name, mod in list(model.named_modules()):
            if isinstance(mod, torch.nn.Embedding) and f"{name}.weight" in qlayers:
                _quantized_embedding(model, name, mod, qlayers[f"{name}.weight"], source.path)
                continue
            if not isinstance(mod, Linear) or not qlayers:
                continue
            parent, _, leaf = name.rpartition(".")
            whole = f"{name}.weight"  # a fused layer the checkpoint stores fused (Phi-3) or by shard
            parts = [whole] if whole in qlayers else [f"{parent}.{s}.weight" for s in mod.shards] or [whole]
            kinds = {qlayers.get(p) for p in parts}
            if None in kinds:
                continue
            if len(kinds) != 1:
                wide = _widened(kinds)
                if wide is None:
                    continue
                kinds = {wide}
            scheme, group = kinds.pop()
            try:
                q = QuantLinear(mod.in_features, mod.out_features, scheme, group, mod.bias is not None,
                                dict(mod.shards), w8_groups=scheme == "w8a8" and group is not None)
            except ValueError as e:
                tp = (f" (this rank's part at tensor_parallel_size={mod.tp_group.world_size}; groups must not "
                      f"straddle ranks)" if getattr(mod, "tp_mode", None) in ("row", "row_partial") else "")
                raise ModelLoadError(f"{source.path}: tensor {parts[0]!r}: group size {group} (from the checkpoint's "
                                     f"quantization config) does not divide the input size {mod.in_features}{tp}") from e
            from appliance.layers.parallel import inherit

            inherit(q, mod)
            setattr(model.get_submodule(parent) if parent else model, leaf, q)
    # Module.to_empty's empty_like of a meta tensor runs torch's Python reference, which imports
    # torch.fx's symbolic shapes and with them sympy: ~35 MB of modules resident for good, the largest
    # part of a GGUF load's growth past its weights; empty_strided is the same storage, no import.
    model = model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    for m in model.modules():  # symmetric checkpoints carry no zero points
        if _is_quant(m) and m.weight_zero_point is not None:
            m.weight_zero_point.data.zero_()
    return model


def _widened(kinds: set) -> tuple[str, int] | None:
    """The one form that holds shards of these (scheme, group) forms exactly, or None: W8 groups of
    the smallest group, when every form is grouped W4 or W8 and that group divides the others (int4
    values are int8 values; a scale per 32 is the same scale twice per 16)."""
    if any(g is None for _, g in kinds) or not all(s in ("w4a8", "w8a8") for s, _ in kinds):
        return None
    g = min(g for _, g in kinds)
    return ("w8a8", g) if all(h % g == 0 for _, h in kinds) else None


def _quantized_embedding(model, name: str, mod, form: tuple[str, int | None], path) -> None:
    """Swap the float embedding ``name`` for a ``QuantEmbedding`` of the source's form (its table stays
    quantized; a tied lm_head then runs on a quantized method, see ``appliance.layers.vocab``)."""
    from appliance.layers.vocab import QuantEmbedding

    scheme, group = form
    try:
        q = QuantEmbedding(mod.num_embeddings, mod.embedding_dim, scheme, group or mod.embedding_dim)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {name + '.weight'!r}: {e}") from e
    from appliance.layers.parallel import inherit

    inherit(q, mod)  # a vocabulary-parallel table: the rank's rows
    q.vocab_start = getattr(mod, "vocab_start", 0)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, q)


def load_weights(model: torch.nn.Module, source, architecture: str = "") -> None:
    """The loading loop: every tensor of ``source`` to its parameter's loader (the owning module's
    ``weight_loader``, else ``default_weight_loader``), then a check that every parameter (and every
    shard of a fused one) got one. Raises ModelLoadError naming the file and the tensor."""
    from appliance.layers.weight_loading import WeightLoadError, default_weight_loader
    from appliance.layers.weight_report import note_stored_format, stored_format_of

    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}

    def locate(name: str):
        pname, shard = model.param_for(name)
        mod_name, _, leaf = pname.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        leaf = getattr(mod, "checkpoint_aliases", {}).get(leaf, leaf)  # QuantLinear: weight -> qweight
        return f"{mod_name}.{leaf}" if mod_name else leaf, shard, mod

    def wants_quantized(name: str) -> bool:
        try:
            return _is_quant(locate(name)[2])
        except AttributeError:
            return False

    stored_format = getattr(source, "stored_format", lambda name: None)  # a GGUF's tensor types, AWQ/GPTQ
    split = getattr(model, "split_checkpoint_tensor", None)  # one checkpoint tensor -> several (MoE 3-D experts)
    ignored = getattr(model, "ignored_weight", lambda name: False)  # e.g. a multimodal checkpoint's vision tower
    for f, name, value in _split_all(source.weights(wants_quantized), split):
        if "rotary_emb.inv_freq" in name or ignored(name):
            continue
        if name == "lm_head.weight" and not any(p.startswith("lm_head.") for p in params):
            continue  # tied embeddings: the checkpoint may still carry a copy
        try:
            pname, shard, mod = locate(name)
        except AttributeError:
            pname, shard, mod = name, None, None
        p = params.get(pname)
        if p is None:
            raise ModelLoadError(f"{f}: unexpected tensor {name!r} for {architecture or type(model).__name__}")
        try:
            if hasattr(mod, "weight_loader"):
                mod.weight_loader(p, value, shard)
            else:
                default_weight_loader(p, value, shard)
        except WeightLoadError as e:
            raise ModelLoadError(f"{f}: tensor {name!r} {e} (from the model's config)") from e
        loaded.setdefault(pname, set()).add(shard)
        if not name.endswith(".bias"):  # for doctor and the banner (appliance.layers.weight_report)
            note_stored_format(mod, stored_format(name) or stored_format_of(value))
    check_complete(model, params, loaded, source.path)


def _split_all(weights, split):
    """The source's (file, name, value) stream, each tensor through the model's
    ``split_checkpoint_tensor(name, value)`` when it has one (a fused 3-D MoE expert tensor becomes
    one tensor per expert); its errors get the file's name."""
    for f, name, value in weights:
        if split is None:
            yield f, name, value
            continue
        try:
            for n, v in split(name, value):
                yield f, n, v
        except ModelLoadError as e:
            raise ModelLoadError(f"{f}: {e}") from e


def process_weights_after_loading(model: torch.nn.Module, quantization: str, group_size: int,
                                  dtype: torch.dtype, path: Path | str = "") -> None:
    """After the loop: every float projection (but lm_head) quantized to ``quantization`` unless it is
    "none"; float parameters cast to ``dtype`` (QuantLinear's integers and fp32 scales stay)."""
    from appliance.layers.quant import quantize_model

    if quantization != "none":
        try:
            quantize_model(model, quantization, group_size)
        except ValueError as e:
            raise ModelLoadError(f"{path}: cannot quantize to {quantization}: {e}") from e
    cast_float(model, dtype)
    model.eval()


def cast_float(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Model dtype for float parameters; quantized weights, their fp32 scales and fp32 zero points
    stay as they are (a K-quant's zero point is -min/scale, a fraction that bf16 would round; a
    QuantEmbedding returns its rows in ``dtype``)."""
    from appliance.layers.vocab import QuantEmbedding

    held = ("qweight", "weight_scale", "weight_zero_point")
    for mod in model.modules():
        quant = _is_quant(mod)
        if isinstance(mod, QuantEmbedding):
            mod.dtype = dtype
        for name, p in list(mod.named_parameters(recurse=False)):
            if quant and name in held:
                continue
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def check_complete(model, params, loaded: dict[str, set], path: Path, optional=lambda name: False) -> None:
    """Every parameter (and every shard of a fused one) got a checkpoint tensor, else ModelLoadError
    naming what is missing. ``optional(name)`` exempts parameters a format may leave out."""
    missing = []
    for pname in params:
        mod_name, _, leaf = pname.rpartition(".")
        if _is_quant(model.get_submodule(mod_name)) and leaf in ("weight_scale", "weight_zero_point"):
            pname_q = f"{mod_name}.qweight"  # filled with qweight, by the same record
            if loaded.get(pname_q):
                continue
        shards = getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "shards", None)
        got = loaded.get(pname, set())
        # a fused weight is filled by all its shards, or whole (Phi-3 stores qkv_proj, gate_up_proj)
        want = set(shards) if shards and None not in got else {None}
        if not want <= got and not optional(pname):
            missing.append(pname)
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks tensors for {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
