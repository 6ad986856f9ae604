"""A whole pure-decode step on CPU in one C call: the CPU's answer to a CUDA graph.

A batch-1 decode step of SmolLM2-135M computes in about 12 ms, but run op by op from Python
(about ten C calls and a few tensor allocations per layer, 30 layers) it spent another 4-5 ms
on dispatch: over a quarter of the step. ``FusedDecode`` describes the model once, at engine
start, as C structs of pointers to its weights and KV cache (``pdserve_decode_step`` in
``cpu_kernels/kernels.c``), and runs every layer of a step of up to ``MAX_BATCH`` tokens
(a decode batch, a speculative verification, a short prompt) in one call; the embedding
lookup before it and the lm_head and sampling after it stay as they are.

Invariants: the same kernels in the model's op order (``LlamaModel.forward`` with the ``cpu``
backend), so for a pure decode step its logits equal the per-op path's bit for bit (tested);
and every token is computed by the same row arithmetic whatever else is in the step, so
prompt-lookup speculation gives bit-identical tokens and log-probabilities (tested).
It applies when the engine runs the ``cpu`` backend in fp32 and every layer linear is a
``QuantLinear`` (a GGUF kept quantized, or ``quantization: int8 | int4``); otherwise the
engine keeps the per-op path.
"""

from __future__ import annotations

import ctypes

import torch

from services.engine.attention import AttentionMetadata
from services.engine.cpu_backend import token_rows
from services.engine.cpu_kernels import library
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.quant import QuantLinear

MAX_BATCH = 32  # the kernels' rows per pass over the weights (MAX_ROWS in kernels.c)

_P = ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("N", ctypes.c_int32),
        ("K", ctypes.c_int32),
        ("qs", _P),
        ("d", _P),
        ("mn", _P),
        ("bias", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _P),
        ("mlp_norm", _P),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("window", ctypes.c_int32),
        ("kv_format", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_slots", ctypes.c_int64),
        ("cos", _P),
        ("sin", _P),
        ("final_norm", _P),
        ("layers", ctypes.POINTER(_Layer)),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    assert t.is_contiguous() and t.device.type == "cpu", "weights are contiguous host tensors"
    return t.data_ptr()


def _linear(lin: object) -> _Linear:
    assert isinstance(lin, QuantLinear)
    w = lin.w  # the kernels' blocked layout
    if lin.bias is not None:
        assert lin.bias.dtype == torch.float32
    return _Linear(
        4 if w.kind == "q4" else 8,
        lin.out_features,
        lin.in_features,
        _ptr(w.qb),
        _ptr(w.db),
        _ptr(w.mb),
        _ptr(lin.bias),
    )


class FusedDecode:
    """``run`` computes a pure decode step's final hidden states; see the module docstring."""

    @staticmethod
    def supported(model: LlamaModel, backend_name: str) -> bool:
        return (
            backend_name == "cpu"
            and model.norm.dtype == torch.float32
            and library.load() is not None
            and all(
                isinstance(getattr(lw, n), QuantLinear)
                for lw in model.layers
                for n in ("qkv", "o", "gate_up", "down")
            )
        )

    def __init__(
        self, model: LlamaModel, cache: KVCache, max_model_len: int, max_rows: int = MAX_BATCH
    ) -> None:
        # max_rows: steps of more tokens run op by op (by step size, the packed GEMM wins there)
        self.max_rows = min(max_rows, MAX_BATCH)
        lib = library.load()
        assert lib is not None
        self.lib = lib
        self.model = model
        cfg = model.cfg
        self._layers = (_Layer * cfg.num_layers)(
            *(
                _Layer(
                    _ptr(lw.attn_norm),
                    _ptr(lw.mlp_norm),
                    _linear(lw.qkv),
                    _linear(lw.o),
                    _linear(lw.gate_up),
                    _linear(lw.down),
                    _ptr(cache.k[i]),
                    _ptr(cache.v[i]),
                )
                for i, lw in enumerate(model.layers)
            )
        )
        kc = cache.k[0]
        self._model = _Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            cfg.sliding_window or 0,
            cache.format_code,
            cache.block_size,
            kc.shape[1] * kc.shape[2],
            _ptr(model.rotary.cos),
            _ptr(model.rotary.sin),
            _ptr(model.norm),
            self._layers,
        )
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        per_row = 4 * h + 3 * i + (3 * cfg.num_heads + 2 * cfg.num_kv_heads) * d
        self._work = torch.empty(MAX_BATCH * per_row)
        group = cfg.num_heads // cfg.num_kv_heads
        self._scores = torch.empty(max(max_model_len, 1) * (group + 2) + 2)  # + row offsets

    def fits(self, meta: AttentionMetadata, verify: bool = False) -> bool:
        """``verify``: a speculative verification step. It fuses up to MAX_BATCH rows
        whatever ``max_rows`` says, so each of its rows rounds as a plain one-token step's
        row does and one request's speculation is lossless (by step size, rows of several
        requests' steps round by the step anyway)."""
        return sum(meta.query_lens) <= (MAX_BATCH if verify else self.max_rows)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final norm's output [tokens, hidden] for a step of at most ``MAX_BATCH`` tokens.

        Every token is one row of the C step, attending as a decode query over its own
        sequence's positions up to and including itself (seq_len = position + 1, its
        sequence's block table): for a span of several tokens (a speculative verification, a
        short prompt) that is exactly causal attention, since the step writes every row's
        keys and values before any row attends. So a token's arithmetic is the same whether
        it is decoded alone, in a batch, or verified as a draft."""
        x = self.model.embed[input_ids].float().contiguous()
        out = torch.empty_like(x)
        tables, lens = token_rows(meta)
        assert tables.dtype == torch.int32 and lens.dtype == torch.int32
        self.lib.pdserve_decode_step(
            ctypes.byref(self._model), x.shape[0], x.data_ptr(), positions.data_ptr(),
            meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), self._work.data_ptr(), self._scores.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out
