"""The decode step replayed as one CUDA graph: on a GPU, a small model's step costs its kernel launches (about 25
a layer, kvchat.model.decode_step), not its arithmetic, and a graph launches all of them at once. Built on the step
(`CudaGraphStep` wraps a `DecodeStep`, which knows nothing of graphs); `LoadedModel.decode_step` picks it on a GPU.

A graph replays the same kernels on the same memory, so the step it records
- takes the token, its position and each layer's write index from tensors on the GPU, filled before each replay;
- writes the token's key, value and position into each layer's own buffers at that index, in the room
  `generate` reserves for the answer (`UniformLayer.buffers`), and counts them live after the replay
  (`UniformLayer.extend`), so the cache holds what `append_token` would have put there;
- attends over each layer's whole buffer with a mask of its live entries and the token.
A graph is recorded for one cache's buffers, and again for another cache or when the buffers change (they grew).
It keeps their addresses, not the tensors, and the cache only by a weak reference, so a cache dropped after its
answers (serve's LRU) is freed.
`StaticStep` is that computation without the graph, which is how the CPU tests it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from kvchat.kv import backends
from kvchat.kv.attention import attend
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.layers import UniformLayer
from kvchat.model.decode_step import DecodeStep

_log = logging.getLogger(__name__)


def graphable(cache: EpisodeCache) -> bool:
    """Whether every layer can take the next token in place (a graph cannot allocate)."""
    return all(type(layer) is UniformLayer and layer.writable_room >= 1 for layer in cache.layers)


def _uniform_layers(cache: EpisodeCache) -> list[UniformLayer]:
    """`cache`'s layers, every one uniform (`graphable` checked it)."""
    layers = [layer for layer in cache.layers if type(layer) is UniformLayer]
    if len(layers) != len(cache.layers):
        raise RuntimeError("a CUDA graph steps caches of uniform layers only")
    return layers


def _buffers_key(cache: EpisodeCache) -> tuple:
    """What a recorded step is bound to: the address and capacity of every layer's buffers."""
    return tuple((k.data_ptr(), v.data_ptr(), p.data_ptr(), k.shape[2]) for k, v, p in
                 (layer.buffers for layer in _uniform_layers(cache)))


class StaticStep:
    """`DecodeStep.run` over fixed tensors: the buffers of `cache`'s layers, the token `ids [1]`, and
    `where [layers + 1]` (each layer's write index, then the token's position)."""

    def __init__(self, step: DecodeStep, cache: EpisodeCache) -> None:
        self.step, self.key = step, _buffers_key(cache)
        self.buffers = [layer.buffers for layer in _uniform_layers(cache)]
        device = self.buffers[0][0].device
        self.ids = torch.zeros(1, dtype=torch.long, device=device)
        self.where = torch.zeros(len(self.buffers) + 1, dtype=torch.long, device=device)
        self._host = torch.zeros(self.where.shape, dtype=torch.long, pin_memory=device.type == "cuda")
        self._slots = torch.arange(max(k.shape[2] for k, _, _ in self.buffers), device=device)
        for layer, (keys, values, _) in zip(_uniform_layers(cache), self.buffers, strict=True):
            # Masked entries weigh 0, but 0 x NaN is NaN: the room must not hold whatever memory held before.
            keys[:, :, layer.size :].zero_()
            values[:, :, layer.size :].zero_()

    def load(self, cache: EpisodeCache, ids: torch.Tensor) -> None:
        """Fill the inputs for the token `ids` fed on top of `cache`."""
        self._host[:-1] = torch.tensor(cache.sizes)
        self._host[-1] = cache.next_position
        self.where.copy_(self._host, non_blocking=True)
        self.ids.copy_(ids.view(1))

    def run(self) -> torch.Tensor:
        """The step on the loaded inputs: logits `[1, 1, vocab]`; the token's entries written, not yet live."""
        return self.step.run(self.ids, self.where[-1:].view(1, 1), self._attend)

    def _attend(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float) -> torch.Tensor:
        keys, values, positions = self.buffers[index]
        slot = self.where[index : index + 1]
        keys.index_copy_(2, slot, key.to(keys.dtype))
        values.index_copy_(2, slot, value.to(values.dtype))
        positions.index_copy_(1, slot, self.where[-1:].expand(positions.shape[0], 1))
        live = (self._slots[: keys.shape[2]] <= slot).view(1, 1, 1, -1)
        return attend(query, keys, values, live, scale).transpose(1, 2)

    @staticmethod
    def advance(cache: EpisodeCache) -> None:
        """After a run: the token's entries live in every layer, its position taken."""
        for layer in _uniform_layers(cache):
            layer.extend(1)
        cache.note_decoded()


class CudaGraphStep:
    """`step` (a `DecodeStep`) on a GPU, recorded once per set of buffers as a CUDA graph and replayed per token; the
    eager step where a graph cannot run (`cuda_graphs` off, flashinfer's attention, a cache without room) or could
    not be recorded (then graphs are off from there on)."""

    def __init__(self, step: DecodeStep) -> None:
        self.step = step
        # A dynamic RoPE (NTK "dynamic") recomputes its frequencies from the position on the host: not in a graph.
        rotary = step.model.model.rotary_emb
        self.cuda_graphs = "dynamic" not in str(getattr(rotary, "rope_type", "default"))
        self._cache: Callable[[], EpisodeCache | None] = lambda: None  # the cache recorded for, weakly
        self._static: StaticStep | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    def applies(self, cache: EpisodeCache, ids: torch.Tensor) -> bool:
        return self.step.applies(cache, ids)

    @torch.inference_mode()
    def __call__(self, cache: EpisodeCache, ids: torch.Tensor) -> torch.Tensor:
        """Logits `[1, 1, vocab]` of the token after `ids [1, 1]`; the token is appended to `cache`."""
        if self.cuda_graphs and ids.is_cuda and graphable(cache) and (
                backends.decode_backend(ids.device, self.step.model.dtype) == "torch"):  # flashinfer's: un-graphed
            self.step.check_context(cache)
            logits = self._replayed(cache, ids)
            if logits is not None:
                return logits
        return self.step(cache, ids)

    def _replayed(self, cache: EpisodeCache, ids: torch.Tensor) -> torch.Tensor | None:
        """The step as a CUDA graph's replay; None, with graphs off from then on, where recording or replaying one
        fails (a kernel a graph cannot hold): the eager step then feeds the token, which the failed graph has not
        made live in the cache."""
        try:
            logits = self._run_graph(cache, ids)
        except RuntimeError as exc:
            _log.warning("kvchat: answering without CUDA graphs: %s", exc)
            self.cuda_graphs = False
            self._static = self._graph = self._logits = None
            self._cache = lambda: None
            return None
        StaticStep.advance(cache)
        return logits

    def _run_graph(self, cache: EpisodeCache, ids: torch.Tensor) -> torch.Tensor:
        """Replay the graph recorded for `cache`'s buffers (recording it first where there is none)."""
        static, graph, logits = self._static, self._graph, self._logits
        if self._cache() is not cache or static is None or graph is None or logits is None or (
                static.key != _buffers_key(cache)):  # fmt: skip
            logits = self._record(cache, ids)
        else:
            static.load(cache, ids)
            graph.replay()
        return logits.clone()  # the next replay overwrites the graph's own

    def _record(self, cache: EpisodeCache, ids: torch.Tensor) -> torch.Tensor:
        """Record the step for `cache`'s buffers, after one run outside the graph (which allocates what the
        kernels need and leaves the token's entries written, as a replay would)."""
        self._static = self._graph = self._logits = None  # the previous graph's memory goes first
        self._cache = lambda: None
        static = StaticStep(self.step, cache)
        static.load(cache, ids)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = static.run()
        graph.replay()
        static.buffers = []  # the graph has their addresses; holding the tensors would keep a dropped cache alive
        self._static, self._graph, self._logits, self._cache = static, graph, logits, weakref.ref(cache)
        return logits
