"""int8 weight-only Linear layers, for decoding on the CPU.

A decode step reads every weight once for one token, so it runs at the speed memory delivers the weights:
float32 SmolLM2-135M reads 540 MB a token. `Int8Linear` holds each Linear's weight as int8 with one
scale per output channel (symmetric, round to nearest) and multiplies with torch's CPU int8 weight-only
kernel (`torch._weight_int8pack_mm`, the kernel torchao's int8 weight-only mode runs on the CPU), on
bfloat16 activations: a quarter of the bytes. Norms, embeddings, attention and the KV cache stay as
loaded. Only the model instance changes (its Linear submodules are replaced); the model's fingerprint is
taken before, so caches built with the float weights answer with the int8 ones.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """`y = x W^T + b` with `W` stored as int8 rows times per-row scales."""

    weight: torch.Tensor  # buffers (register_buffer), typed here for what reads them
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        if (weight.shape != (out_features, in_features) or scale.shape != (out_features,) or weight.dtype != torch.int8
                or scale.dtype != torch.bfloat16):
            raise ValueError(f"int8 weights of {out_features} x {in_features}: weight {tuple(weight.shape)}, "
                             f"scale {tuple(scale.shape)}")  # fmt: skip
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"a bias of {out_features}, not {tuple(bias.shape)}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> Int8Linear:
        """`linear`'s weight rounded to int8 with one scale per output channel (symmetric, round to nearest)."""
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        codes = (weight / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(linear.in_features, linear.out_features, codes, scale.to(torch.bfloat16), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scale).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def float_weight(self) -> torch.Tensor:
        """The weight `[out, in]` these codes and scales stand for, in float32 (for what reads a projection's
        weight rather than multiplying by it: IndexMem's indexer, kvchat.kv.indexer)."""
        return self.weight.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (the decoder's projections and the lm_head) by an `Int8Linear`;
    returns how many. An lm_head tied to the embedding gets its own int8 copy; the embedding is kept."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        model.set_submodule(name, Int8Linear.of(linear))
    return len(names)
