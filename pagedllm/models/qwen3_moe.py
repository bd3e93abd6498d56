"""Qwen3-MoE: Qwen3's attention (q/k norms) with a mixture-of-experts MLP in the layers the
config names (pagedllm/layers/moe.py computes it grouped by expert).  Other layers keep a
dense MLP.  Expert weights load from any checkpoint form: one tensor per expert and
projection (`mlp.experts.{e}.gate_proj.weight`, as the published checkpoints store them),
transformers 5's stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, or a GGUF's
stacked gate, up and down (`ffn_gate_exps` ...).  Experts kept
quantized in a GGUF are dequantized at load; they run in the model's dtype."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.fused_ops import LayerOps
from pagedllm.layers.linear import Linear
from pagedllm.layers.lora import LayerLora
from pagedllm.layers.moe import grouped_experts, route
from pagedllm.layers.quantized import QuantizedWeight
from pagedllm.layers.tensor_parallel import TensorParallel
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import DecoderLayer, LlamaModel, QuantizedBuilder
from pagedllm.models.sharding import ShardLayout


def _dense(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


class MoeDecoderLayer(DecoderLayer):
    projection_sources = {name: DecoderLayer.projection_sources[name] for name in ("qkv_proj", "o_proj")}

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, shard: ShardLayout, tp: TensorParallel, window: int = 0
    ) -> None:
        super().__init__(config, dtype, shard, tp, window)
        experts, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        del self.gate_up_proj, self.down_proj
        self.router = nn.Parameter(torch.empty(experts, hidden, dtype=dtype), requires_grad=False)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype), requires_grad=False)

    def load_extra_weights(self, weights: dict, prefix: str, quantized: QuantizedBuilder | None) -> None:
        p = prefix + "mlp."
        self.router.copy_(_dense(LlamaModel.take(weights, p + "gate.weight")))
        if p + "experts.gate_up_proj" in weights:  # transformers 5's stacked form
            self.experts_gate_up.copy_(_dense(weights[p + "experts.gate_up_proj"]))
            self.experts_down.copy_(_dense(LlamaModel.take(weights, p + "experts.down_proj")))
            return
        if p + "experts.gate_proj.weight" in weights:  # a GGUF's: gate and up stacked apart
            gate, up = (_dense(LlamaModel.take(weights, p + f"experts.{n}_proj.weight")) for n in ("gate", "up"))
            self.experts_gate_up.copy_(torch.cat([gate, up], dim=1))
            self.experts_down.copy_(_dense(LlamaModel.take(weights, p + "experts.down_proj.weight")))
            return
        for e in range(self.router.shape[0]):
            q = f"{p}experts.{e}."
            gate, up = (_dense(LlamaModel.take(weights, q + n + ".weight")) for n in ("gate_proj", "up_proj"))
            self.experts_gate_up[e].copy_(torch.cat([gate, up]))
            self.experts_down[e].copy_(_dense(LlamaModel.take(weights, q + "down_proj.weight")))

    def prepare_linears(self, backend: str, small_batch=None, quantized: QuantizedBuilder | None = None) -> None:
        """The attention projections as the llama layer builds them; each expert's gate/up and down
        as Linears of their own (the stacked weights are then dropped where the Linears copied them)."""
        super().prepare_linears(backend, small_batch, quantized)
        for e in range(self.router.shape[0]):
            self.linears[f"experts.{e}.gate_up"] = Linear(self.experts_gate_up.data[e], backend, small_batch)
            self.linears[f"experts.{e}.down"] = Linear(self.experts_down.data[e], backend, small_batch)
        if backend != "torch":
            self.experts_gate_up.data = torch.empty(0, dtype=self.experts_gate_up.dtype)
            self.experts_down.data = torch.empty(0, dtype=self.experts_down.dtype)

    def mlp(self, h: torch.Tensor, ops: LayerOps, lora: LayerLora | None = None) -> torch.Tensor:
        weights, experts = route(torch.nn.functional.linear(h, self.router), self.top_k, self.normalize)
        linears = self.linears

        def run_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return linears[f"experts.{e}.down"](ops.silu_mul(linears[f"experts.{e}.gate_up"](rows)))

        return grouped_experts(h, weights, experts, run_expert)


class Qwen3MoeModel(LlamaModel):
    layer_math = None  # experts: the layer loop runs every step
    supports_lora = False  # an adapter's MLP update would need one per expert

    def layer_class_for(self, index: int) -> type[DecoderLayer]:
        return MoeDecoderLayer if self.config.layer_moe[index] else DecoderLayer
