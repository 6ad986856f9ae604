"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over the paged KV cache.

Weights are held in HF naming after loading, then fused per layer (q|k|v and gate|up) so a
layer is four matmuls. Forward runs on a flat batch of tokens from many sequences; attention
is the only part that looks at sequence boundaries (through ``AttentionMetadata``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.attention import AttentionMetadata
from services.engine.backend import Backend
from services.engine.config import ModelConfig
from services.engine.errors import ModelLoadError
from services.engine.kv_cache import KVCache
from services.engine.layer_ops import LayerOps
from services.engine.layer_ops import rms_norm as rms_norm  # re-exported (tests, kernels)
from services.engine.linear import LinearLayer, Weight, fuse, make_linear
from services.engine.quant import QuantWeight
from services.engine.rope import Rotary
from services.engine.row_roles import RowRoles

if TYPE_CHECKING:  # the model reads a step's inputs; it does not build them
    from services.engine.step_state import TailRows

# (layer, keys, values) of the step's tokens, called once the layer's KV is in the cache
LayerHook = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: LinearLayer  # q | k | v fused: out = (heads + 2 * kv_heads) * head_dim
    o: LinearLayer
    mlp_norm: torch.Tensor
    gate_up: LinearLayer  # gate | up fused: out = 2 * intermediate
    down: LinearLayer


class Embedding:
    """Token embeddings, dense or quantized (rows are dequantized as they are gathered)."""

    def __init__(self, w: Weight, dtype: torch.dtype) -> None:
        self.w = w
        self.dtype = dtype

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.w, QuantWeight):
            return self.w.dequantize(ids).to(self.dtype)
        return self.w[ids]


class LlamaModel:
    """Inference-only decoder. Build with ``from_state_dict``."""

    def __init__(
        self,
        cfg: ModelConfig,
        embed: Embedding,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: LinearLayer,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = Rotary(cfg, max_positions, dtype, device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding gather reads only a few rows)."""
        esize = self.norm.element_size()
        n = self.norm.numel() * esize + self.lm_head.nbytes
        for lw in self.layers:
            n += (lw.attn_norm.numel() + lw.mlp_norm.numel()) * esize
            n += sum(lin.nbytes for lin in (lw.qkv, lw.o, lw.gate_up, lw.down))
        return n

    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        sd: dict[str, Weight],
        *,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        pack: torch.dtype | None = None,
    ) -> LlamaModel:
        """Build from HF-named weights, dense tensors or ``QuantWeight`` (linears and the
        embedding); raises ModelLoadError naming a missing or misshapen one."""

        def weight(name: str, shape: tuple[int, ...] | None = None) -> Weight:
            t = sd.get(name)
            if t is None:
                raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
            if shape is not None and tuple(t.shape) != shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}"
                )
            return t if isinstance(t, QuantWeight) else t.to(dtype=dtype, device=device)

        def get(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            t = weight(name, shape)
            return t.dequantize().to(dtype) if isinstance(t, QuantWeight) else t

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in sd else None

        def linear(names: list[str], shapes: list[tuple[int, int]], bias) -> LinearLayer:
            return make_linear(fuse([weight(n, s) for n, s in zip(names, shapes)]), bias, pack)

        h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_b = None
            if cfg.attention_bias:
                qkv_b = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            gu_b = None
            if cfg.mlp_bias:
                gu_b = torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])
            attn = p + "self_attn."
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight", (h,)),
                    qkv=linear(
                        [attn + f"{n}_proj.weight" for n in "qkv"],
                        [(q_out, h), (kv_out, h), (kv_out, h)],
                        qkv_b,
                    ),
                    o=linear(
                        [attn + "o_proj.weight"],
                        [(h, q_out)],
                        opt(attn + "o_proj.bias") if cfg.o_bias else None,
                    ),
                    mlp_norm=get(p + "post_attention_layernorm.weight", (h,)),
                    gate_up=linear(
                        [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                        [(inter, h), (inter, h)],
                        gu_b,
                    ),
                    down=linear(
                        [p + "mlp.down_proj.weight"],
                        [(h, inter)],
                        opt(p + "mlp.down_proj.bias") if cfg.mlp_bias else None,
                    ),
                )
            )
        embed = weight("model.embed_tokens.weight", (cfg.vocab_size, h))
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in sd
        head_w = embed if tied else weight("lm_head.weight", (cfg.vocab_size, h))
        # NOTE: its own layout even when tied and dense (speed); a quantized one is shared
        lm_head = make_linear(head_w, None, pack)
        return cls(
            cfg,
            Embedding(embed, dtype),
            layers,
            get("model.norm.weight", (h,)),
            lm_head,
            max_positions,
            dtype,
            device,
        )

    @staticmethod
    def _mlp(
        lw: LayerWeights, h: torch.Tensor, roles: RowRoles | None, ops: LayerOps
    ) -> torch.Tensor:
        """down(silu(gate) * up). Where gate_up runs a bf16 packed GEMM (prompts on AMX hosts),
        its result stays bf16 through the activation into down's bf16 GEMM: the fp32 round trip
        of the widest activations (2 x intermediate, then intermediate) was the largest
        conversion cost of a prompt; down's result stays bf16 too, into the next norm (which
        widens it exactly). Without roles only: invariant rows keep fp32."""
        gate_up = lw.gate_up(h, roles, keep=roles is None)
        return lw.down(ops.silu_and_mul(gate_up), roles, keep=roles is None)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        cache: KVCache,
        meta: AttentionMetadata,
        backend: Backend,
        logits_idx: torch.Tensor,  # [num_sampled] rows whose next-token logits are needed
        layer_hook: LayerHook | None = None,
        roles: RowRoles | None = None,  # of the rows; None: kernels by batch size
        sampled_roles: RowRoles | None = None,  # of the rows logits_idx names
        tail: TailRows | None = None,  # the rows the last layer computes past its KV
    ) -> torch.Tensor:
        """Returns fp32 logits [num_sampled, vocab]. ``layer_hook(i, k, v)`` runs right after
        layer i's keys and values ([num_tokens, kv_heads, head_dim]) are in the cache.

        NOTE: no host sync anywhere in here (sizes come from tensor shapes and ``meta``'s host
        fields), so a CUDA graph can capture a decode step whole."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        ops, attention = backend.ops, backend.attention
        n = input_ids.shape[0]
        x = self.embed[input_ids]  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        rope = ops.rope_tables(positions, self.rotary)
        attention.prepare(meta)
        # NOTE: where a linear rounds its input rows to bf16 (prompts over the packed GEMM),
        # the norm before it writes them in bf16 and the linear after attention keeps its bf16
        # result for the next norm: the same bits, two conversion passes fewer a norm
        last = len(self.layers) - 1
        for i, lw in enumerate(self.layers):
            h, residual = ops.add_rms_norm(
                x, residual, lw.attn_norm, eps, lw.qkv.input_dtype(n, roles)
            )
            q, k, v = lw.qkv(h, roles).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q, k = ops.rope_and_cache(
                q.view(n, cfg.num_heads, cfg.head_dim),
                k.view(n, cfg.num_kv_heads, cfg.head_dim),
                v.view(n, cfg.num_kv_heads, cfg.head_dim),
                rope,
                cache,
                i,
                meta.slot_mapping,
            )
            if layer_hook is not None:
                layer_hook(i, k, v.view(n, cfg.num_kv_heads, cfg.head_dim))
            if i == last and tail is not None:
                if tail.rows.shape[0] == 0:  # no logits due: the keys and values were all
                    return torch.empty((0, cfg.vocab_size), device=x.device)
                q, residual = q.index_select(0, tail.rows), residual.index_select(0, tail.rows)
                n, meta, roles = tail.rows.shape[0], tail.meta, tail.roles
                logits_idx = tail.logits_idx
                attention.prepare(meta)
            attn = attention.forward(q, cache, i, meta).reshape(n, self.q_size)
            x = lw.o(attn, roles, keep=roles is None)
            h, residual = ops.add_rms_norm(
                x, residual, lw.mlp_norm, eps, lw.gate_up.input_dtype(n, roles)
            )
            x = self._mlp(lw, h, roles, ops)
        assert residual is not None
        h, _ = ops.add_rms_norm(x[logits_idx], residual[logits_idx], self.norm, eps)
        return self.lm_head(h, sampled_roles).float()
