"""IndexMem's latent memory (Yang et al. 2026, §3.2): evicted entries are folded into a fixed-size state
instead of being forgotten, and read back while answering.

Slow weights per layer (trained, `MemoryWeights`: a feature map phi and a gate g), fast state per layer and
KV head (`LatentMemory`), so each query head reads exactly what its own KV head evicted. Two readouts: the
paper's additive one, and the default "mass" readout, which weighs the memory against the resident entries
as extra softmax mass using attention's own log-sum-exp. The update and readout formulas, and the choices
made where the paper is ambiguous, are in docs/how-it-works.md, "IndexMem's latent memory in detail".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from kvchat.kv.config import MEMORY_READOUTS, IndexMemConfig
from kvchat.kv.indexer import IndexMemShape
from kvchat.kv.rope import rotate_keys

if TYPE_CHECKING:
    from kvchat.kv.cache import Evicted

GATE_BIAS = -2.0  # a new memory starts mostly closed (g about 0.12): training opens it where it helps
CLOSED_GATE = -1e4  # a gate bias that shuts a layer's memory (g = 0): kvchat.training closes layers it does not help
FEATURE_CAP = 30.0  # mass readout: log phi(x) = W x capped here, so sums over thousands of entries stay finite
MIN_MASS = 1e-30    # mass readout: phi(q).z below this is no memory at all (nothing written)
INITIAL_DECAY = 1e-3  # mass readout: gamma before training (an entry 1000 tokens back weighs exp(-1) as much)


def gate_closed(weights: MemoryWeights, layer: int) -> bool:
    """Whether `layer`'s memory is shut (`CLOSED_GATE`): nothing is written to it or read from it."""
    gate = weights.gate_of(layer)
    return bool(gate.bias.item() <= CLOSED_GATE / 2 and not gate.weight.any())


class MemoryWeights(nn.Module):
    """The slow weights of every layer: phi and the gate (see the module docstring)."""

    def __init__(self, shape: IndexMemShape, readout: str = "additive") -> None:
        super().__init__()
        if readout not in MEMORY_READOUTS:
            raise ValueError(f"unknown memory readout {readout!r} (choose from {', '.join(MEMORY_READOUTS)})")
        self.shape, self.readout = shape, readout
        self.phi = nn.ModuleList(nn.Linear(shape.head_dim, shape.memory_dim, bias=False) for _ in range(shape.layers))
        gates = [nn.Linear(shape.head_dim, 1) for _ in range(shape.layers)]
        for gate in gates:
            nn.init.zeros_(gate.weight)
            nn.init.constant_(gate.bias, GATE_BIAS)
        self.gate = nn.ModuleList(gates)
        if readout == "mass":  # c per layer; kvchat.training sets it from the data before the first step
            self.log_scale = nn.Parameter(torch.zeros(shape.layers))
            self.decay_rate = nn.Parameter(torch.full((shape.layers,), INITIAL_DECAY))  # gamma = |decay_rate|

    # nn.ModuleList types its items as Module: what each of these two holds, by layer.
    def phi_of(self, layer: int) -> nn.Linear:
        return cast(nn.Linear, self.phi[layer])

    def gate_of(self, layer: int) -> nn.Linear:
        return cast(nn.Linear, self.gate[layer])

    def gamma(self, layer: int) -> torch.Tensor:
        """Mass readout: layer `layer`'s decay of an entry's mass per token of distance from the query."""
        return self.decay_rate[layer].abs()


def features(phi: nn.Linear, x: torch.Tensor, readout: str = "additive") -> torch.Tensor:
    """phi(x): the linear map (additive), or its exponential, capped (mass: positive features)."""
    projected = phi(x.float())
    return projected if readout == "additive" else projected.clamp(max=FEATURE_CAP).exp()


def write_terms(phi: nn.Linear, keys: torch.Tensor, values: torch.Tensor, weight: torch.Tensor | None = None,
                readout: str = "additive"):
    """What entries add to (M, b) before eta: `keys`, `values` `[..., n, head_dim]` (pre-RoPE keys), optional
    per-entry `weight [..., n]` (1 = evicted); returns `M [..., d_mem, head_dim]` and `b [..., d_mem]`: the sum
    of phi(k)^2 (additive) or of phi(k) (mass, the normaliser z)."""
    feats = features(phi, keys, readout)
    weighted = feats * weight.unsqueeze(-1) if weight is not None else feats
    norm = weighted * feats if readout == "additive" else weighted
    return weighted.transpose(-1, -2) @ values.float(), norm.sum(-2)


def read(phi: nn.Linear, gate: nn.Linear, m: torch.Tensor, b: torch.Tensor, queries: torch.Tensor, eps: float):
    """The gated readout `g(q) m(q)` `[q_heads, n, head_dim]` of pre-RoPE `queries [q_heads, n, head_dim]` from
    states `m [kv_heads, d_mem, head_dim]`, `b [kv_heads, d_mem]` (query head i reads KV head i // group)."""
    kv_heads = m.shape[0]
    q = queries.float().unflatten(0, (kv_heads, -1))                     # [kv, group, n, d]
    features = phi(q)                                                    # [kv, group, n, d_mem]
    numerator = features @ m.unsqueeze(1)                                # [kv, group, n, d]
    denominator = (features * features) @ b[:, None, :, None] + eps      # [kv, group, n, 1]
    gated = torch.sigmoid(gate(q)) * numerator / denominator
    return gated.flatten(0, 1)


def read_mass(phi: nn.Linear, gate: nn.Linear, log_scale: torch.Tensor, m: torch.Tensor, z: torch.Tensor,
              queries: torch.Tensor, attended: torch.Tensor, log_mass: torch.Tensor,
              shift: torch.Tensor | float = 0.0) -> torch.Tensor:
    """What the mass readout adds to attention's output `attended [q_heads, n, head_dim]`, whose log-sum-exp
    over the entries each query attends to is `log_mass [q_heads, n, 1]`: `w (m(q) - o_attn)` (module
    docstring), from states `m [kv_heads, d_mem, head_dim]`, `z [kv_heads, d_mem]`; `queries` pre-RoPE;
    `shift [n, 1]`: each query's distance decay from the state's reference position, `-gamma (t - r)`."""
    kv_heads = m.shape[0]
    q = queries.float().unflatten(0, (kv_heads, -1))                     # [kv, group, n, d]
    feats = features(phi, q, "mass")                                     # [kv, group, n, d_mem]
    numerator = feats @ m.unsqueeze(1)                                   # [kv, group, n, d]
    mass = feats @ z[:, None, :, None]                                   # [kv, group, n, 1]
    present = mass > MIN_MASS
    mass = torch.where(present, mass, torch.ones_like(mass))
    log_memory = torch.nn.functional.logsigmoid(gate(q)) + log_scale + shift + mass.log()
    share = torch.where(present, torch.sigmoid(log_memory - log_mass.float().unflatten(0, (kv_heads, -1))), 0.0)
    out = attended.float().unflatten(0, (kv_heads, -1))
    return (share * (numerator / mass - out)).flatten(0, 1)


class LatentMemory:
    """The fast state of one episode cache plus the slow weights that write and read it.

    `writer(rotary_emb)` is an `EpisodeCache.on_evict` observer; `readout(rotary_emb, position_ids)` is what
    kvchat's attention adds during one forward (kvchat.kv.forward passes it when the cache has a memory).
    """

    def __init__(self, weights: MemoryWeights, config: IndexMemConfig = IndexMemConfig(),
                 m: list[torch.Tensor] | None = None, b: list[torch.Tensor] | None = None,
                 ref: torch.Tensor | None = None) -> None:
        s = weights.shape
        self.weights = weights.eval().requires_grad_(False)
        self.shape, self.config = s, config
        self.m = m if m is not None else [torch.zeros(s.kv_heads, s.memory_dim, s.head_dim) for _ in range(s.layers)]
        self.b = b if b is not None else [torch.zeros(s.kv_heads, s.memory_dim) for _ in range(s.layers)]
        # mass readout: per layer, the position the state's distance decay is relative to (the last written)
        self.ref = ref if ref is not None else torch.zeros(s.layers)
        self.written = 0  # entries written (all layers and heads), for reports
        self.closed = [gate_closed(weights, layer) for layer in range(s.layers)]  # shut gates: skipped

    def write(self, layer_idx: int, evicted: list[Evicted], rotary_emb: nn.Module) -> None:
        """Fold what layer `layer_idx` evicts (per KV head: post-RoPE keys, values, positions) into its state."""
        if self.closed[layer_idx]:
            return
        lam, eta = self.config.decay, self.config.write_strength
        phi, readout = self.weights.phi_of(layer_idx), self.weights.readout
        with torch.no_grad():
            self.m[layer_idx].mul_(lam)
            self.b[layer_idx].mul_(lam)
            if readout == "mass":  # move the reference to the last position written, decaying what is there
                gamma, ref = self.weights.gamma(layer_idx), self.ref[layer_idx]
                last = max([float(p.max()) for _, _, p, *_ in evicted if p.numel()], default=float(ref))
                new_ref = max(float(ref), last)
                self.m[layer_idx].mul_(torch.exp(-gamma * (new_ref - ref)))
                self.b[layer_idx].mul_(torch.exp(-gamma * (new_ref - ref)))
                self.ref[layer_idx] = new_ref
            for h, (keys, values, positions, *_) in enumerate(evicted):
                if keys.shape[0] == 0:
                    continue
                pre = rotate_keys(keys[None, None], -positions[None].to(torch.long), rotary_emb)[0, 0]
                weight = None
                if readout == "mass":
                    weight = torch.exp(-gamma * (self.ref[layer_idx] - positions.to(torch.float32)))
                m_add, b_add = write_terms(phi, pre, values, weight, readout=readout)
                self.m[layer_idx][h] += eta * m_add
                self.b[layer_idx][h] += eta * b_add
                self.written += keys.shape[0]

    def writer(self, rotary_emb: nn.Module):
        """An `EpisodeCache.on_evict` observer writing into this memory."""
        return lambda layer_idx, evicted: self.write(layer_idx, evicted, rotary_emb)

    def readout(self, rotary_emb: nn.Module, position_ids: torch.Tensor) -> MemoryRead:
        """What attention adds for a forward of tokens at `position_ids [1, n]`."""
        return MemoryRead(self, rotary_emb, position_ids)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.m, *self.b, self.ref))

    def to(self, device: torch.device | str) -> LatentMemory:
        """Move the state and weights to `device` (a cache loaded on a GPU); they stay float32."""
        self.weights.to(device)
        self.m = [t.to(device) for t in self.m]
        self.b = [t.to(device) for t in self.b]
        self.ref = self.ref.to(device)
        return self


@dataclass(frozen=True)
class MemoryRead:
    """kvchat.kv.attention.MemoryReadout for one forward: rotates the queries back to pre-RoPE, reads."""

    memory: LatentMemory
    rotary_emb: nn.Module
    position_ids: torch.Tensor

    def needs_log_mass(self, layer_idx: int) -> bool:
        """The mass readout needs attention's output and log-sum-exp (an open layer's, that is)."""
        return self.memory.weights.readout == "mass" and not self.memory.closed[layer_idx]

    def __call__(self, layer_idx: int, query: torch.Tensor, attended: torch.Tensor | None = None,
                 log_mass: torch.Tensor | None = None) -> torch.Tensor:
        mem = self.memory
        if mem.closed[layer_idx]:
            return torch.zeros_like(query)
        heads, n = query.shape[1], query.shape[2]
        pre = rotate_keys(query, -self.position_ids.to(torch.long).expand(heads, n), self.rotary_emb)[0]
        w = mem.weights
        with torch.no_grad():
            if w.readout == "mass":
                if attended is None or log_mass is None:
                    raise ValueError("the mass readout needs attention's output and log-sum-exp")
                distance = self.position_ids[0].to(torch.float32)[:, None] - mem.ref[layer_idx]      # [n, 1]
                out = read_mass(w.phi_of(layer_idx), w.gate_of(layer_idx), w.log_scale[layer_idx], mem.m[layer_idx],
                                mem.b[layer_idx], pre, attended[0], log_mass[0],
                                -w.gamma(layer_idx) * distance) * mem.config.mass_scale
            else:
                out = read(w.phi_of(layer_idx), w.gate_of(layer_idx), mem.m[layer_idx], mem.b[layer_idx], pre,
                           mem.config.eps) * mem.config.readout_scale
        return out.unsqueeze(0).to(query.dtype)
