"""A Llama layer's matrix products and norms in few torch calls: what the native forward computes them with.

Per token, a layer's projections cost their weights' read plus per-call overhead; transformers' modules spend
about 90 torch calls a layer on one token (norms in seven operations, three projections, casts). Here the query,
key and value rows are one product and the gate and up rows another (their weights put side by side once, in
one tensor each, the modules' own weights rebound to views of it, so memory does not grow and anything reading a
module's weight reads the same values), a Linear's product is its kernel without the module call, and a norm is
`torch.rms_norm`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.model.int4_weights import Int4Linear, stackable
from kvchat.model.int4_weights import product as int4_product
from kvchat.model.int8_weights import Int8Linear

Product = Callable[[torch.Tensor], torch.Tensor]
LINEAR_KINDS = (nn.Linear, Int8Linear, Int4Linear)


class Projection:
    """Several Linear layers with the same input as one matrix product: their weights (and int8 scales) stacked
    into one tensor, the modules' own weights rebound to views of it. int4 weights stack the same way where the
    kernel's packed layout allows it (`int4_weights.stackable`), but their scales and offsets, which the kernel
    reads only as one contiguous tensor, are stacked as a copy (a fifth of the packed weights' bytes); int4 parts
    that do not stack are multiplied one by one. Takes `[n, in]`; an int8 or int4 product is left in bfloat16."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.kind = type(modules[0])
        if len({type(m) for m in modules}) != 1 or self.kind not in LINEAR_KINDS or any(
                getattr(m, "bias", None) is not None for m in modules):
            raise ValueError("a projection stacks Linear layers of one kind without biases")
        self.parts = None
        if self.kind is Int4Linear and not stackable([m.out_features for m in modules]):
            self.parts = [(m.weight, m.scale_zero) for m in modules]
            return
        names = ("weight", "scale") if self.kind is Int8Linear else ("weight",)
        self.tensors = []
        for name in names:
            stacked = torch.cat([getattr(m, name).detach() for m in modules])
            start = 0
            for module in modules:
                rows = getattr(module, name).shape[0]
                view = stacked[start : start + rows]
                if isinstance(getattr(module, name), nn.Parameter):
                    getattr(module, name).data = view
                else:
                    setattr(module, name, view)
                start += rows
            self.tensors.append(stacked)
        if self.kind is Int4Linear:  # [groups, out, 2]: stacked along the output rows
            self.tensors.append(torch.cat([m.scale_zero for m in modules], dim=1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([int4_product(x, *part) for part in self.parts], dim=-1)
        if self.kind is Int8Linear:
            return _int8(x, *self.tensors)
        if self.kind is Int4Linear:
            return int4_product(x, *self.tensors)
        return F.linear(x, self.tensors[0])


def product(module: nn.Module) -> Product:
    """`module`'s product without the module call: F.linear for a Linear, the int8 or int4 kernel for an
    Int8Linear or Int4Linear (left in bfloat16, as `_int8`; the next operation upcasts it exactly). Takes
    `[n, in]`."""
    if isinstance(module, Int8Linear):
        return lambda x: _int8(x, module.weight, module.scale)
    if isinstance(module, Int4Linear):
        return lambda x: int4_product(x, module.weight, module.scale_zero)
    return lambda x: F.linear(x, module.weight, module.bias)


def _int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`Int8Linear`'s product of `x [n, in]` on bfloat16 activations, left in bfloat16 `[n, out]`: the next operation
    on it computes in float32 (type promotion upcasts exactly, as Int8Linear's `.to` does)."""
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), weight, scale)


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """A Llama RMSNorm module's output (in float32, the weight applied in the input's dtype, as transformers'
    `LlamaRMSNorm` computes it), from its `weight` and `variance_epsilon`, in one or two calls."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * torch.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)


class Products:
    """What `build` makes of some Linear modules (a `Projection`, a `product`), made at first use and again when one
    of them is replaced (int8/int4 weights held after loading) or the weights move (a new device or dtype): not kept
    in the state dict."""

    def __init__(self, build: Callable[..., tuple]) -> None:
        self._build = build
        self._modules: tuple[nn.Module, ...] = ()
        self._where = 0  # the first module's weight's address when built: a move changes it
        self._built: tuple = ()

    def of(self, *modules: nn.Module) -> tuple:
        if modules != self._modules or modules[0].weight.data_ptr() != self._where:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, whatever mode the forward runs in
                self._built = self._build(*modules)
            self._modules, self._where = modules, modules[0].weight.data_ptr()  # after any rebinding
        return self._built
