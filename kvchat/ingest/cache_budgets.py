"""The size of an ingest's caches, decided before the first is built: the layer budgets it runs (a profile's
sensitivity, a strategy, CAKE's per-block ones), the pre-flight memory estimate of a plan, and block or full
prefill by what the method allows and the memory holds (kvchat.ingest.plan puts them together).
"""

from __future__ import annotations

from pathlib import Path

from kvchat.config import ANSWER_ROOM, CacheConfig, IngestConfig
from kvchat.errors import UserError
from kvchat.ingest import preflight
from kvchat.ingest.layer_profiles import find_profile
from kvchat.kv.budgets import layer_budgets
from kvchat.kv.cascade import CakeBudgets
from kvchat.kv.heads import HeadBudgets, head_floor
from kvchat.kv.methods import method
from kvchat.messages import command
from kvchat.model.llm import ChatLayout, LoadedModel
from kvchat.settings_table import given


def resolve_layer_budgets(
    cache: CacheConfig, lm: LoadedModel, profile_dirs: list[Path], protected: int, notes: list[str]
) -> tuple[str, list[int] | CakeBudgets, float | None]:
    """The strategy actually used, its per-layer budgets (each above the `protected` system prompt) and,
    for sensitivity, the alpha used. `auto` = sensitivity when a profile of these weights exists (shipped,
    or made by `kvchat profile-layers`), else uniform. `cake` budgets are computed during prefill, from
    each block's attention."""
    strategy = cache.layer_budgets
    if strategy == "cake":
        cake = cache.cake
        return strategy, CakeBudgets(
            cache.budget, cake.queries, cake.tau1, cake.tau2, cake.floor_fraction, cake.cascade
        ), None
    profile = find_profile(lm, profile_dirs) if strategy in ("auto", "sensitivity") else None
    if strategy == "auto":
        strategy = "sensitivity" if profile else "uniform"
        if profile is None:
            notes.append(f"no layer profile for {lm.spec}: uniform budgets (run `{command('profile-layers')}` to make "
                         "one)")
    elif strategy == "sensitivity" and profile is None:
        raise UserError(f"{given('layer_budgets', 'sensitivity')} needs a profile of {lm.spec}: run "
                        f"`{command('profile-layers')}` first")
    alpha = cache.alpha if cache.alpha is not None else (profile.alpha if profile else 1.0)
    budgets = layer_budgets(
        strategy, lm.num_layers, cache.budget, sensitivity=profile.sensitivity if profile else None, alpha=alpha,
        protected=protected,
    )
    return strategy, budgets, alpha if strategy == "sensitivity" else None


def longest_head(
    budgets: list[int] | CakeBudgets, heads: HeadBudgets, shape: preflight.ModelShape, protected: int
) -> int:
    """The most entries one KV head of one layer may keep: the largest layer budget (cake: every other
    layer at its floor), and with adaptive heads that layer's whole share less the other heads' floors."""
    if isinstance(budgets, CakeBudgets):
        largest = shape.layers * budgets.budget - (shape.layers - 1) * budgets.floor(protected)
    else:
        largest = max(budgets)
    if heads.mode == "uniform":
        return largest
    return largest * shape.kv_heads - (shape.kv_heads - 1) * head_floor(largest, protected, heads.floor_fraction)


def estimate_bytes(
    config: IngestConfig,
    lm: LoadedModel,
    layout: ChatLayout,
    context_tokens: int,
    budgets: list[int] | CakeBudgets | None,
    heads: HeadBudgets,
    protected: int,
    *,
    select_from_full: bool = False,
) -> int:
    """The pre-flight estimate (kvchat.ingest.preflight) of building `config`'s caches over `context_tokens`."""
    shape = preflight.ModelShape.of(lm.model)
    return preflight.estimate_ingest_bytes(
        shape,
        budget=config.cache.budget,
        block_size=config.cache.block_size,
        prompt_tokens=config.episodes.patched_prompt_tokens + lm.encode(layout.question("")).shape[-1],
        context_tokens=context_tokens,
        full=budgets is None,
        longest_head=None if budgets is None else longest_head(budgets, heads, shape, protected),
        select_from_full=select_from_full,
    )


def prefill_mode(
    cache: CacheConfig,
    strategy: str,
    history_tokens: int,
    window: int,
    full_bytes: int,
    shape: preflight.ModelShape,
    available: int | None,
) -> str:
    """`block` or `full` (see `CacheConfig.prefill`). `auto` picks `full` when it can run (a method that
    scores after the block, fixed layer budgets, a history inside the model's window) and the estimate of
    holding the whole history fits `available`; an explicit `full` that cannot run is refused."""
    entry = method(cache.method)
    if entry.scorer is None or cache.prefill == "block":
        return "block"  # full KV evicts nothing: both ways build the same cache
    if entry.in_forward:
        why_not = f"{given('method', entry.name)} scores inside each block's forward"
    elif entry.routed:
        why_not = f"{given('method', entry.name)} prefills each episode's own turns, not the whole history"
    elif strategy == "cake":
        why_not = "cake layer budgets come from each block's attention"
    elif window and history_tokens + ANSWER_ROOM > window:
        why_not = f"the history ({history_tokens} tokens with the system prompt) exceeds the model's window ({window})"
    else:
        why_not = None
    if cache.prefill == "full":
        if why_not:
            raise UserError(f"{given('prefill', 'full')} cannot run: {why_not}; use {given('prefill', 'block')} or "
                            "auto")
        return "full"
    fits = available is None or full_bytes - shape.weight_bytes <= available
    return "full" if why_not is None and fits else "block"
