"""The model runner: the only place that turns a schedule into tensors. Owns the model and the
preallocated KV cache. Device-agnostic: everything is created on ``self.device``."""
from __future__ import annotations

import logging
import time

import numpy as np
import psutil
import torch

from appliance.config import EngineConfig
from appliance.config import parse_speculative_config
from appliance.distributed.parallel_state import get_tp_group
from appliance.engine.cuda_graphs import DecodeGraphRunner, cuda_graph_capture
from appliance.engine.device import activation_reserve_bytes, check_dtype_on_device, gpu_kv_budget_bytes
from appliance.engine.scheduler import SchedulerOutput
from appliance.layers.linear import select_backends
from appliance.layers.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from appliance.layers.fused_moe import Router
from appliance.models.loader import ModelInfo
from appliance.models.loader import load as load_model
from appliance.errors import InvalidRequestError
from appliance.ops import get_ops
from appliance.ops.reference import kv_cache_is_quantized, kv_cache_torch_dtype, kv_scale_shape
from appliance.runtime.allocator import release_free_memory

log = logging.getLogger("appliance")

GiB = 1 << 30
DEFAULT_KV_FRACTION = 0.25  # of available RAM
DEFAULT_KV_CAP_GIB = 4.0


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, dtype: torch.dtype, max_model_len: int,
                 device: torch.device, pooler_config=None):
        self.config = config
        # a pooling runner (pooler_config given): execute_pooling, no logits
        self.pooler = None
        if pooler_config is not None:
            from appliance.layers.pooler import Pooler

            self.pooler = Pooler(pooler_config)
        check_dtype_on_device(dtype, device)
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.model = load_model(info, dtype, device, config.quantization, config.quant_group_size,
                                config.linear_backend)
        self.ops = get_ops(config.attention_backend, device.type)
        if config.batch_invariant and not getattr(self.ops, "ROW_INVARIANT", False):
            raise InvalidRequestError(
                f"batch_invariant needs the native kernels (row-invariant attention); this engine runs the "
                f"{self.ops.__name__.rsplit('.', 1)[-1]} ops (attention_backend={config.attention_backend!r} on "
                f"{device.type}; build the extension: python -m appliance.ops.native --build)", "batch_invariant")
        self.model.prepare(max_model_len, device)
        # Speculative decoding verifies 1 + k tokens per step at batch 1. A backend chosen at 1 row
        # alone can cost twice as much there (torch's sgemm at 4 rows of a 576-wide layer: 1.7-2.4x
        # its 1-row time, the prepacked native panels 1.0x), which ate the gain of accepted drafts.
        verify_rows = ((1 + parse_speculative_config(config.speculative_config).num_speculative_tokens,)
                       if config.speculative_config else ())
        self.linear_backends = select_backends(self.model, config.linear_backend, dtype, device, verify_rows,
                                               batch_invariant=config.batch_invariant)
        if config.batch_invariant:  # float projections that are not linear layers (the MoE router)
            for m in self.model.modules():
                if hasattr(m, "make_row_invariant"):
                    m.make_row_invariant()
        release_free_memory()  # the checkpoint forms that packing freed
        # layer group (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) -> backends it uses
        groups: dict[str, set] = {}
        for name, mod in self.model.named_modules():
            if hasattr(mod, "backend") and hasattr(mod, "in_features"):
                groups.setdefault(name.rsplit(".", 1)[-1], set()).add(mod.backend)
        self.linear_groups = {g: ",".join(sorted(b)) for g, b in groups.items()}
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        # a tensor-parallel rank's cache holds its share of the KV heads (appliance.distributed)
        self.num_kv_heads = cfg.num_key_value_heads // get_tp_group().world_size
        self.head_size = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        # When every layer is windowed, the largest window: blocks before it are read by no layer,
        # and the engine frees them. None when some layer attends to everything (or no windows).
        windows = list(getattr(cfg, "sliding_windows", None) or [None])
        self.sliding_window = None if None in windows else max(windows)
        self.kv_dtype = self._kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        self.num_blocks = self._num_blocks(config)
        shape = self.ops.kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        # Zeroed once: positions past a sequence's length are masked, but must never hold NaN.
        self.kv_cache = torch.zeros((self.num_layers, 2, *shape), dtype=self.kv_dtype, device=device)
        self.last_prepare_s = 0.0
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.num_layers)]
        # a quantized cache's per-row scales, in the same paged layout (ones: never 0 or NaN)
        self.kv_scale, self.kv_scales = None, None
        if kv_cache_is_quantized(self.kv_dtype):
            sshape = kv_scale_shape(self.num_blocks, self.block_size, self.num_kv_heads)
            self.kv_scale = torch.ones((self.num_layers, 2, *sshape), dtype=torch.float32, device=device)
            self.kv_scales = [(self.kv_scale[i, 0], self.kv_scale[i, 1]) for i in range(self.num_layers)]
        # decode graphs: a pooling runner never decodes
        self.graphs = (self._decode_graphs(config, max_model_len)
                       if device.type == "cuda" and self.pooler is None else None)

    @staticmethod
    def _kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        kv = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        # The CUDA kernels (ops/triton_kernels.py) read caches of the model's dtype only
        if device.type == "cuda" and kv != dtype:
            raise InvalidRequestError(
                f"kv_cache_dtype (--kv-cache-dtype) {kv_cache_dtype!r} is not supported on CUDA with a "
                f"{str(dtype).removeprefix('torch.')} model; valid there: auto"
                + (", bfloat16" if dtype == torch.bfloat16 else ""), "kv_cache_dtype")
        return kv

    @property
    def bytes_per_block(self) -> int:
        """KV bytes one block takes over all layers: K and V rows of the cache's dtype, plus a float32
        scale per row when the cache is quantized."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        row = self.head_size * elem + (4 if kv_cache_is_quantized(self.kv_dtype) else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory * GiB
        elif self.device.type == "cuda":
            budget = self._gpu_kv_budget(config)
        else:
            budget = min(DEFAULT_KV_FRACTION * psutil.virtual_memory().available, DEFAULT_KV_CAP_GIB * GiB)
            # the default is the host's: data-parallel replicas, loading at once, share it
            budget /= config.data_parallel_size
        n = int(budget // self.bytes_per_block)
        if n < 1:
            raise ValueError(f"kv_cache_memory={budget / GiB:.3f} GiB holds no KV block "
                             f"(one block needs {self.bytes_per_block / GiB:.6f} GiB)")
        return n

    def _decode_graphs(self, config: EngineConfig, max_model_len: int) -> DecodeGraphRunner | None:
        if config.enforce_eager:
            return None
        if any(isinstance(m, Router) for m in self.model.modules()):
            # expert routing counts tokens per expert on the host (grouped_experts): not capturable
            log.info("decode CUDA graphs off: mixture-of-experts routing synchronizes with the host")
            return None
        t0 = time.perf_counter()
        graphs = DecodeGraphRunner(self.model, self.ops, self.kv_caches, config.max_num_seqs,
                                   -(-max_model_len // self.block_size), self.device, cuda_graph_capture())
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", graphs.sizes, time.perf_counter() - t0)
        return graphs

    def _gpu_kv_budget(self, config: EngineConfig) -> int:
        # weights are loaded by now, so mem_get_info's "used" includes them
        free, total = torch.cuda.mem_get_info(self.device)
        cfg = self.model.config
        reserve = activation_reserve_bytes(
            cfg.hidden_size, getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
            (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.vocab_size,
            config.max_num_batched_tokens, config.max_num_seqs)
        return gpu_kv_budget_bytes(free, total, config.gpu_memory_utilization, reserve)

    def _inputs(self, sched: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        logits_idx: list[int] = []
        max_blocks = 0
        any_context = False
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.all_token_ids[start:end])
            num_spec = end - req.num_tokens  # > 0: draft tokens follow the known ones (speculation)
            if num_spec > 0:
                input_ids.extend(req.spec_token_ids[:num_spec])
            bt = req.block_ids
            if n == 1:
                positions.append(start)
                slots.append(bt[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(bt, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            any_context |= start > 0
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            max_blocks = max(max_blocks, len(bt))
            if num_spec > 0:  # logits at the last known token and at every draft, to verify them
                logits_idx.extend(range(qsl[-1] - 1 - num_spec, qsl[-1]))
            elif end == req.num_tokens:
                logits_idx.append(qsl[-1] - 1)
        table = np.zeros((len(sched.scheduled), max_blocks), dtype=np.int32)
        for i, (req, _) in enumerate(sched.scheduled):
            table[i, : len(req.block_ids)] = req.block_ids
        dev = self.device
        if dev.type == "cuda":
            # built on the host, pinned, copied without blocking: the copies queue behind the previous
            # step's kernels instead of waiting for them (torch.tensor(..., device=cuda) would sync)
            def to_dev(t):
                return t.pin_memory().to(dev, non_blocking=True)
        else:
            def to_dev(t):
                return t
        md = AttentionMetadata(
            slot_mapping=to_dev(torch.tensor(slots, dtype=torch.int64)),
            block_table=to_dev(torch.from_numpy(table)),
            seq_lens=to_dev(torch.tensor(seq_lens, dtype=torch.int32)),
            query_start_loc=to_dev(torch.tensor(qsl, dtype=torch.int32)),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens),
            is_prefill_only=not any_context,
        )
        ids = to_dev(torch.tensor(input_ids, dtype=torch.int64))
        pos = to_dev(torch.tensor(positions, dtype=torch.int64))
        return ids, pos, md, logits_idx

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prompt_logprob_rows: dict[int, tuple[int, int]] | None = None):
        """Run one step. Returns (logits [num_sampling_rows, vocab] float32: one row per request that
        samples, 1 + its drafts for a speculating one, in batch order; and for each batch
        index in ``prompt_logprob_rows`` the float32 log-softmax of every position of its chunk)."""
        t0 = time.perf_counter()
        ids, pos, md, logits_idx = self._inputs(sched)
        self.last_prepare_s = time.perf_counter() - t0  # input preparation, reported apart from the forward
        if (self.graphs is not None and md.max_query_len == 1 and not prompt_logprob_rows
                and self.graphs.padded_size(ids.shape[0]) is not None):
            hidden = self.graphs.run(ids, pos, md)  # a decode batch: padded, replayed
        else:
            with set_forward_context(ForwardContext(md, self.kv_caches, self.ops, self.kv_scales)):
                hidden = self.model(ids, pos)
        logits = self.model.compute_logits(hidden[logits_idx]) if logits_idx else None
        extra = {}
        if prompt_logprob_rows:
            qsl = md.query_start_loc.tolist()
            for i in prompt_logprob_rows:
                extra[i] = torch.log_softmax(self.model.compute_logits(hidden[qsl[i]:qsl[i + 1]]), dim=-1)
        return logits, extra

    @torch.inference_mode()
    def execute_pooling(self, sched: SchedulerOutput) -> dict[str, list[float]]:
        """Run one step of pooling requests (prompt chunks only). Every chunk's final hidden states go
        to the pooler; returns {request id: pooled vector} for the requests whose prompt this step
        completes, after the head (the request's ``pooling_params``: dimensions, normalize)."""
        t0 = time.perf_counter()
        ids, pos, md, _ = self._inputs(sched)
        self.last_prepare_s = time.perf_counter() - t0
        with set_forward_context(ForwardContext(md, self.kv_caches, self.ops, self.kv_scales)):
            hidden = self.model(ids, pos)
        qsl = md.query_start_loc.tolist()
        out = {}
        for i, (req, n) in enumerate(sched.scheduled):
            start = req.num_computed_tokens  # before this step's update
            last = start + n == req.num_tokens
            pooled = self.pooler.add_chunk(req.request_id, start, hidden[qsl[i]:qsl[i + 1]], last)
            if pooled is not None:
                pp = req.pooling_params
                out[req.request_id] = self.pooler.head(pooled, pp.dimensions, pp.normalize).tolist()
        return out
