"""4-bit weight-only Linear layers (`--weights int4`), for decoding on the CPU.

`Int4Linear` holds a weight in groups of `GROUP` input columns, each group as 4-bit codes with a scale and an
offset, `w = (code - 8) * scale + zero`: torch's CPU int4 layout, multiplied by its CPU int4 weight-only kernel
(`torch._weight_int4pack_mm_for_cpu`, the kernel torchao's int4 weight-only mode runs on the CPU) on bfloat16
activations. With the scales and offsets in bfloat16 that is 0.625 bytes a weight, against int8's 1 and float32's 4.

The embedded model ships its decoder weights in exactly this form (its GGUF's Q4_1: 4-bit codes in groups of 32
with a scale and a minimum), so for it the codes found here are the file's own and only the rounding of the
scale and offset to bfloat16 differs from the float weights: closer to them than int8 with one scale per row.
Other weights lose what any 4-bit group quantization loses. The lm_head (the vocabulary projection, which the
embedded model keeps in 8 bits) and any Linear whose shape the kernel cannot take become `Int8Linear`s.
"""

from __future__ import annotations

import torch
from torch import nn

from kvchat.model.int8_weights import Int8Linear

GROUP = 32          # input columns per scale and offset (Q4_1's block)
ROWS_MULTIPLE = 16  # the kernel takes output rows in multiples of 16
ROW_BLOCK = 64      # and packs them in blocks of 64 (a shorter last block)
GRID_TOLERANCE = 1e-3  # of a step: how far from its level a weight of a 4-bit group may lie (float rounding)


class Int4Linear(nn.Module):
    """`y = x W^T + b` with `W` in 4-bit groups of `GROUP` columns (asymmetric: a scale and an offset each)."""

    weight: torch.Tensor  # buffers (register_buffer), typed here for what reads them
    scale_zero: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, scale_zero: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        if (in_features % GROUP or out_features % ROWS_MULTIPLE or weight.shape != (out_features, in_features // 2)
                or weight.dtype != torch.uint8 or scale_zero.shape != (in_features // GROUP, out_features, 2)
                or scale_zero.dtype != torch.bfloat16 or not scale_zero.is_contiguous()):
            raise ValueError(f"int4 weights of {out_features} x {in_features} (in_features % {GROUP} == 0, "
                             f"out_features % {ROWS_MULTIPLE} == 0): weight {tuple(weight.shape)}, scales and "
                             f"offsets {tuple(scale_zero.shape)}")  # fmt: skip
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"a bias of {out_features}, not {tuple(bias.shape)}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", weight)           # [out, in / 2] uint8, torch's packed layout
        self.register_buffer("scale_zero", scale_zero)   # [in / GROUP, out, 2] bfloat16
        self.register_buffer("bias", bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> Int4Linear:
        """`linear`'s weight in 4-bit groups: each group's scale and offset from its minimum and maximum, rounded to
        bfloat16 first, then the codes chosen against the rounded ones."""
        if not fits(linear):
            raise ValueError(f"int4 weights need in_features % {GROUP} == 0 and out_features % {ROWS_MULTIPLE} == 0")
        out_features = linear.out_features
        groups = linear.weight.detach().float().reshape(out_features, -1, GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12).to(torch.bfloat16)
        zero = (low + 8 * scale.float()).to(torch.bfloat16)
        start = zero.float() - 8 * scale.float()  # the value of code 0
        codes = ((groups - start[..., None]) / scale.float()[..., None]).round_().clamp_(0, 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(out_features, -1), 1)
        scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(linear.in_features, out_features, packed, scale_zero, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = product(flat, self.weight, self.scale_zero).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def float_weight(self) -> torch.Tensor:
        """The weight `[out, in]` these groups stand for, in float32, each value as the kernel gives it (rounded to
        bfloat16): the kernel's product with the identity, since the packed layout is torch's own."""
        identity = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.weight.device)
        return product(identity, self.weight, self.scale_zero).float().T.contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weights in groups of {GROUP}"


def product(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """`x [m, in]` times the packed `weight`, in bfloat16 `[m, out]`. `scale_zero` must be contiguous: the kernel
    reads it by its shape, not its strides."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), weight, GROUP, scale_zero)


class CodeLayout:
    """Where torch's CPU int4 packing puts each 4-bit code, per weight shape, read off the packer itself: positions
    packed 4 bits at a time say which nibble of which byte holds which code. No layout is assumed (it differs between
    full blocks of `ROW_BLOCK` rows and a shorter last one, and is torch's to change); a shape's is found once per
    instance."""

    def __init__(self) -> None:
        self._sources: dict[tuple[int, int], torch.Tensor] = {}

    def codes(self, weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """The codes `[out, in]` (uint8, 0..15) packed in `weight` `[out, in / 2]`."""
        source = self._source(out_features, in_features)
        nibbles = torch.stack([weight & 15, weight >> 4], dim=-1).flatten()   # each byte's low nibble, then high
        codes = torch.empty(out_features * in_features, dtype=torch.uint8)
        codes[source] = nibbles
        return codes.view(out_features, in_features)

    def _source(self, out_features: int, in_features: int) -> torch.Tensor:
        """For each nibble of the packing, in `codes`' order, the flat position `[out, in]` of its code."""
        shape = (out_features, in_features)
        if shape not in self._sources:
            position = torch.arange(out_features * in_features, dtype=torch.int64).view(shape)
            source = torch.zeros(out_features * in_features, dtype=torch.int64)
            for shift in range(0, max(int(position[-1, -1]), 1).bit_length(), 4):
                digit = ((position >> shift) & 15).to(torch.int32)
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 1)
                source |= torch.stack([packed & 15, packed >> 4], dim=-1).flatten().to(torch.int64) << shift
            self._sources[shape] = source
        return self._sources[shape]


def bfloat16_weight(weight: torch.Tensor, scale_zero: torch.Tensor, layout: CodeLayout) -> torch.Tensor:
    """The weight `[out, in]` that packed `weight` and its groups' `scale_zero` stand for, each value computed as the
    kernel computes it (`(code - 8) * scale + offset` in float32) and rounded to bfloat16: what a bfloat16 matrix
    product multiplies by in the int4 kernel's place."""
    groups, out_features = scale_zero.shape[0], scale_zero.shape[1]
    codes = layout.codes(weight, out_features, groups * GROUP).view(out_features, groups, GROUP)
    scale, zero = scale_zero.float().transpose(0, 1).unbind(-1)                     # [out, groups] each
    values = (codes.float() - 8).mul_(scale[..., None]).add_(zero[..., None])
    return values.view(out_features, -1).to(torch.bfloat16)


def fits(linear: nn.Linear) -> bool:
    """Whether the kernel takes `linear`'s shape."""
    return linear.in_features % GROUP == 0 and linear.out_features % ROWS_MULTIPLE == 0


def stackable(rows: list[int]) -> bool:
    """Whether Linears of `rows` output rows each, packed one by one and concatenated, are the packing of their
    concatenation: every part but the last fills whole blocks."""
    return all(n % ROW_BLOCK == 0 for n in rows[:-1])


def on_4_bit_grid(weight: torch.Tensor) -> bool:
    """Whether every group of `GROUP` columns of `weight` holds only the 16 levels between its minimum and maximum
    (to float rounding): weights a 4-bit group format such as Q4_1 stored, which `Int4Linear` holds exactly."""
    groups = weight.detach().float().reshape(weight.shape[0], -1, GROUP)
    low = groups.amin(dim=-1, keepdim=True)
    step = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    levels = (groups - low) / step
    return bool(((levels - levels.round()).abs() <= GRID_TOLERANCE).all())


def holds_4_bit_groups(model: nn.Module) -> bool:
    """Whether every Linear `quantize_linears` would make int4 already holds 4-bit groups (`on_4_bit_grid`): then
    int4 weights lose only the bfloat16 rounding of each group's scale and offset (`--weights auto`)."""
    four = [linear for _, linear in _int4_candidates(model)]
    return bool(four) and all(on_4_bit_grid(linear.weight) for linear in four)


def quantize_linears(model: nn.Module) -> int:
    """Replace the decoder's `nn.Linear`s of `model` by `Int4Linear`s, and the lm_head (and any Linear the kernel
    cannot take) by `Int8Linear`s; returns how many became int4. The embedding is kept."""
    four = {name for name, _ in _int4_candidates(model)}
    for name in [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        model.set_submodule(name, Int4Linear.of(linear) if name in four else Int8Linear.of(linear))
    return len(four)


def _int4_candidates(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The Linears that become int4: every one but the lm_head whose shape the kernel takes."""
    outputs = getattr(model, "get_output_embeddings", None)  # transformers' models name their lm_head so
    head = outputs() if callable(outputs) else None
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head and not name.endswith("lm_head") and fits(module)]
