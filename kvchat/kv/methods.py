"""The method registry: every eviction method kvchat knows, its scorer and its properties.

`--method`'s choices, its help text, option validation and the settings an ingest records all read this
table. Adding a method is one scorer (kvchat.kv.scoring or a module of its own) and one `Method` line
below; ARCHITECTURE.md walks through it. Factories import the scorers when called, so the command line
can list methods without loading torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvchat.kv.config import CacheConfig
    from kvchat.kv.scoring import Scorer
    from kvchat.kv.trained import TrainedIndexMem

from kvchat.kv.config import INFINIPOT_PROMPT, KVZIP_PROMPT, SNAPKV_QUERIES, STREAMING_SINK

__all__ = ["INFINIPOT_PROMPT", "KVZIP_PROMPT", "SNAPKV_QUERIES", "STREAMING_SINK"]  # where they were first


class PromptLayout(Protocol):
    """Where a user turn sits in the model's chat template (kvchat.model.llm.ChatLayout)."""

    @property
    def before_question(self) -> str: ...

    @property
    def after_question(self) -> str: ...

    def question(self, text: str) -> str: ...


@dataclass(frozen=True)
class ScorerInputs:
    """What a method's scorer may be built from, for one episode's cache."""

    encode: Callable[[str], torch.Tensor]  # text -> token ids [1, n]
    layout: PromptLayout
    cache: CacheConfig
    episode_prompt: str = ""  # the episode's patched prompt text (instruction + medoid segments)
    model: nn.Module | None = None  # the frozen model (a trained scorer reads its projections)
    trained: TrainedIndexMem | None = None  # a `trained` method's weights


@dataclass(frozen=True)
class Method:
    """One eviction method. `scorer` is None for a method that keeps everything."""

    name: str
    summary: str                                   # one line for --help and docs/commands.md
    scorer: Callable[[ScorerInputs], Scorer] | None
    across_heads: bool = False   # scores are attention weights, comparable across a layer's heads:
                                 # adaptive (AdaKV) head budgets apply
    in_forward: bool = False     # scores inside the block's forward, no probe pass (kvchat.kv.scoring)
    episodic: bool = False       # one cache per episode, each scored by that episode's patched prompt
    trained: bool = False        # needs trained weights shipped in profiles/ or made by a train command
    routed: bool = False         # episodic, and each episode's cache prefills only its own segments' turns
    recalls: bool = False        # part of the budget goes to raw turns retrieved for each question (answer.recall)


def _epicache(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.scoring import PatchedPromptScorer

    return PatchedPromptScorer(inputs.encode(inputs.layout.question(inputs.episode_prompt)), inputs.cache.pool_kernel)


def _infinipot(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.scoring import PatchedPromptScorer

    return PatchedPromptScorer(inputs.encode(inputs.layout.question(INFINIPOT_PROMPT)), inputs.cache.pool_kernel)


def _snapkv(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.scoring import BlockPromptScorer

    empty = inputs.encode("")
    return BlockPromptScorer(empty, empty, SNAPKV_QUERIES, inputs.cache.block_size, inputs.cache.pool_kernel)


def _kvzip(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.scoring import BlockPromptScorer

    layout = inputs.layout
    return BlockPromptScorer(
        inputs.encode(layout.before_question + KVZIP_PROMPT + "\n"),
        inputs.encode(layout.after_question),
        tail=None,
        block_size=inputs.cache.block_size,
        pool_kernel=inputs.cache.pool_kernel,
    )


def _streaming(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.scoring import RecencyScorer

    return RecencyScorer(sink=min(STREAMING_SINK, inputs.cache.budget // 4))


def _keydiff(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.scoring import KeyDiffScorer

    return KeyDiffScorer()


def _cake(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.scoring import CakeScorer

    cake = inputs.cache.cake
    return CakeScorer(cake.queries, cake.gamma, cake.pool_kernel)


def _indexmem(inputs: ScorerInputs) -> Scorer:
    from kvchat.kv.indexer import IndexerScorer

    if inputs.trained is None or inputs.model is None:
        raise ValueError("indexmem scores with trained weights and the model they were trained on")
    return IndexerScorer.for_cache(inputs.trained.indexer, inputs.model, inputs.cache)


REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        Method("epicache", "episodic: each episode's patched prompt scores the cache (EpiCache, the default)",
               _epicache, across_heads=True, episodic=True),
        Method("routed", "episodic, each episode's cache built from its own turns only, in history order (EpiCache's "
               "episodes routed by their turns: one pass over the history in all)", _epicache, across_heads=True,
               episodic=True, routed=True),
        Method("recall", "routed episode caches keep part of the budget (half); the question's top chunks "
               "of raw turns (by their words) fill the rest, prefilled on top of the cache", _epicache,
               across_heads=True, episodic=True, routed=True, recalls=True),
        Method("full", "keep everything: the reference", None),
        Method("streaming", f"sink min({STREAMING_SINK}, M/4) + most recent (StreamingLLM)", _streaming),
        Method("snapkv", f"prompt = the block's last {SNAPKV_QUERIES} tokens (SnapKV)", _snapkv, across_heads=True),
        Method("infinipot", "a summarize prompt (InfiniPot)", _infinipot, across_heads=True),
        Method("kvzip", "a repeat prompt followed by the block (KVzip)", _kvzip, across_heads=True),
        Method("keydiff", "distance from the block's mean key (KeyDiff)", _keydiff),
        Method("cake", "mean + 200 x variance of the attention of the block's last 32 tokens, evicting each "
               "layer during the block's forward (CAKE)", _cake, in_forward=True),
        Method("indexmem", "a trained indexer, blended with the attention of the block's last "
               f"{SNAPKV_QUERIES} queries, scores entries inside the block's forward; what is evicted feeds a "
               "latent memory read while answering (IndexMem)", _indexmem, across_heads=True,
               in_forward=True, trained=True),
    )
}
METHODS = tuple(REGISTRY)
AUTO_METHOD = "auto"  # --method's default: the first of AUTO_METHODS within the model's window, the second beyond
AUTO_METHODS = ("epicache", "recall")
METHOD_CHOICES = (AUTO_METHOD, *METHODS)
# What `kvchat ingest --help` offers; the other methods are the baselines `kvchat eval` compares, accepted as well
USER_METHODS = (AUTO_METHOD, "epicache", "recall", "full")


def method(name: str) -> Method:
    """The registry entry of `name`; ValueError naming the choices when there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r} (choose from {', '.join(METHODS)})") from None


def candidates(name: str) -> list[Method]:
    """The registry entries `name` may run as: auto's, unresolved, or the method it names."""
    return [method(m) for m in (AUTO_METHODS if name == AUTO_METHOD else (name,))]


def may_recall(name: str) -> bool:
    """Whether `name` (a registry method or auto, unresolved) spends part of its budget on recalled turns."""
    return any(m.recalls for m in candidates(name))


def across_heads_methods() -> tuple[str, ...]:
    """Methods whose scores compare across heads (adaptive head budgets need one)."""
    return tuple(m.name for m in REGISTRY.values() if m.across_heads)
