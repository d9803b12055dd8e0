"""A Llama layer's matrix products and norms in few torch calls: what the native forward computes them with.

Per token, a layer's projections cost their weights' read plus per-call overhead; transformers' modules spend
about 90 torch calls a layer on one token (norms in seven operations, three projections, casts). Here the query,
key and value rows are one product and the gate and up rows another (their weights put side by side once, in
one tensor each, the modules' own weights rebound to views of it, so memory does not grow and anything reading a
module's weight reads the same values), a Linear's product is its kernel without the module call, and a norm is
`torch.rms_norm`.

While a prefill runs many tokens through the layers (ingest: `Products.hold_dense`), int8 and int4 products of
`DENSE_ROWS` rows or more multiply by their weights held dense in bfloat16 instead, each value the one the kernel
computes, rounded to bfloat16: on a CPU with bfloat16 instructions torch's bfloat16 matrix product (oneDNN) runs a
512-token block about 2.5x faster than the int4 kernel, which dequantizes its weights again for every row block
(benchmarks/ingest_throughput.py). One token (a decode step) reads the fewest bytes through the int4 or int8 kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.model.int4_weights import CodeLayout, Int4Linear, bfloat16_weight, stackable
from kvchat.model.int4_weights import product as int4_product
from kvchat.model.int8_weights import Int8Linear

Product = Callable[[torch.Tensor], torch.Tensor]
LINEAR_KINDS = (nn.Linear, Int8Linear, Int4Linear)
LinearModule = nn.Linear | Int8Linear | Int4Linear
# Rows of a product from which, while dense weights are held, the bfloat16 product beats the int4 and int8 kernels
# (benchmarks/ingest_throughput.py's kernel table); a decode step's one row stays with them.
DENSE_ROWS = 16


class Projection:
    """Several Linear layers with the same input as one matrix product: their weights (and int8 scales) stacked
    into one tensor, the modules' own weights rebound to views of it. int4 weights stack the same way where the
    kernel's packed layout allows it (`int4_weights.stackable`), but their scales and offsets, which the kernel
    reads only as one contiguous tensor, are stacked as a copy (a fifth of the packed weights' bytes); int4 parts
    that do not stack are multiplied one by one. Takes `[n, in]`; an int8 or int4 product is left in bfloat16."""

    def __init__(self, modules: Sequence[LinearModule]) -> None:
        self.kind = type(modules[0])
        if len({type(m) for m in modules}) != 1 or self.kind not in LINEAR_KINDS or any(
                getattr(m, "bias", None) is not None for m in modules):
            raise ValueError("a projection stacks Linear layers of one kind without biases")
        self.in_features, self.out_features = modules[0].in_features, sum(m.out_features for m in modules)
        self.dense: torch.Tensor | None = None  # `hold_dense`'s weights
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        int4 = [m for m in modules if isinstance(m, Int4Linear)]  # every module, or none (one kind)
        if int4 and not stackable([m.out_features for m in modules]):
            self.parts = [(m.weight, m.scale_zero) for m in int4]
            return
        names = ("weight", "scale") if self.kind is Int8Linear else ("weight",)
        if len(modules) == 1:  # nothing to stack
            self.tensors = [getattr(modules[0], name).detach() for name in names]
            self.tensors += [m.scale_zero for m in int4]
            return
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
        if int4:  # [groups, out, 2]: stacked along the output rows
            self.tensors.append(torch.cat([m.scale_zero for m in int4], dim=1))

    def hold_dense(self, layout: CodeLayout) -> None:
        """Hold the int8 or int4 weights dense in bfloat16 too (as `bfloat16_weight`, or an int8 code times its row's
        scale, rounded): products of `DENSE_ROWS` rows or more multiply by them. Float weights stay as they are."""
        if self.kind is Int4Linear:
            parts = self.parts if self.parts is not None else [(self.tensors[0], self.tensors[1])]
            self.dense = torch.cat([bfloat16_weight(weight, scale_zero, layout) for weight, scale_zero in parts])
        elif self.kind is Int8Linear:
            weight, scale = self.tensors
            self.dense = (weight.float() * scale.float()[:, None]).to(torch.bfloat16)

    def drop_dense(self) -> None:
        self.dense = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= DENSE_ROWS:
            return F.linear(x.to(torch.bfloat16), self.dense)  # left in bfloat16, as the kernels leave theirs
        if self.parts is not None:
            return torch.cat([int4_product(x, *part) for part in self.parts], dim=-1)
        if self.kind is Int8Linear:
            return _int8(x, *self.tensors)
        if self.kind is Int4Linear:
            return int4_product(x, *self.tensors)
        return F.linear(x, self.tensors[0])


def product(module: nn.Module) -> Product:
    """`module`'s product without the module call: F.linear for a Linear, the int8 or int4 kernel for an
    Int8Linear or Int4Linear (left in bfloat16, as `_int8`; the next operation upcasts it exactly), as a `Projection`
    of it where it has no bias (so it can hold dense weights). Takes `[n, in]`."""
    if isinstance(module, (Int8Linear, Int4Linear)) and module.bias is None:
        return Projection([module])
    if isinstance(module, Int8Linear):
        return lambda x: _int8(x, module.weight, module.scale)
    if isinstance(module, Int4Linear):
        return lambda x: int4_product(x, module.weight, module.scale_zero)
    if not isinstance(module, nn.Linear):
        raise TypeError(f"no product for a {type(module).__name__}")
    return lambda x: F.linear(x, module.weight, module.bias)


def _int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`Int8Linear`'s product of `x [n, in]` on bfloat16 activations, left in bfloat16 `[n, out]`: the next operation
    on it computes in float32 (type promotion upcasts exactly, as Int8Linear's `.to` does)."""
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), weight, scale)


class Norm(Protocol):
    """A Llama RMSNorm module (transformers' `LlamaRMSNorm`, kvchat's own): what `rms_norm` reads of it."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def variance_epsilon(self) -> float: ...


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """A Llama RMSNorm module's output (in float32, the weight applied in the input's dtype, as transformers'
    `LlamaRMSNorm` computes it), from its `weight` and `variance_epsilon`, in one or two calls."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * torch.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)


class Products:
    """What `build` makes of some Linear modules (`Projection`s, `product`s), made at first use and again when one
    of them is replaced (int8/int4 weights held after loading) or the weights move (a new device or dtype): not kept
    in the state dict. Between `hold_dense` and `drop_dense` its projections hold their weights dense in bfloat16
    (`Projection.hold_dense`), those it builds meanwhile included."""

    def __init__(self, build: Callable[..., tuple]) -> None:
        self._build = build
        self._modules: tuple[nn.Module, ...] = ()
        self._where = 0  # the first module's weight's address when built: a move changes it
        self._built: tuple = ()
        self._dense: CodeLayout | None = None  # held dense: the layout the int4 codes are read with

    def of(self, *modules: nn.Module) -> tuple:
        if modules != self._modules or _weight_address(modules[0]) != self._where:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, whatever mode the forward runs in
                self._built = self._build(*modules)
                if self._dense is not None:
                    self._hold(self._dense)
            self._modules, self._where = modules, _weight_address(modules[0])  # after any rebinding
        return self._built

    @property
    def holds_dense(self) -> bool:
        return self._dense is not None

    def hold_dense(self, layout: CodeLayout) -> None:
        """Hold the products (built: `of` called before) with their weights dense in bfloat16 too."""
        self._dense = layout
        self._hold(layout)

    def drop_dense(self) -> None:
        """Release the dense weights: every product multiplies by its own kernel again."""
        self._dense = None
        for built in self._built:
            if isinstance(built, Projection):
                built.drop_dense()

    @property
    def built(self) -> tuple:
        return self._built

    def _hold(self, layout: CodeLayout) -> None:
        with torch.inference_mode(False), torch.no_grad():
            for built in self._built:
                if isinstance(built, Projection) and built.dense is None:
                    built.hold_dense(layout)


def _weight_address(module: nn.Module) -> int:
    """Where `module`'s weight is (a move to another device or dtype changes it)."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor")
    return weight.data_ptr()


def dense_bytes(products: Products) -> int:
    """What `products.hold_dense` holds: two bytes a weight of its int8 and int4 projections."""
    return sum(2 * p.out_features * p.in_features for p in products.built
               if isinstance(p, Projection) and p.kind in (Int8Linear, Int4Linear))  # fmt: skip
