"""Pre-flight memory estimate for an ingest: refuse one that cannot fit before it starts, rather than
be killed by the OOM killer halfway. The estimate follows the bound block prefill promises
(ARCHITECTURE.md): peak KV entries per layer <= budget + block + patched prompt, whatever the
history's length.

The device matters: on CUDA the model, the cache and the activations live in GPU memory, so what may still
be allocated is `torch.cuda.mem_get_info`'s free figure, not the host's; numbers take the model dtype's bytes
(`ModelShape.dtype_bytes`: 2 in bfloat16, 4 in float32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvchat.errors import UserError
from kvchat.kv.shape import ModelShape as ModelShape  # the estimate's input, named here too
from kvchat.messages import option, setting

ACTIVATION_FACTOR = 20  # numbers per token and hidden unit alive in one layer's forward (MLP, norms, residual)
FLOAT_BYTES = 4  # attention scores kvchat records are float32 whatever the weights' dtype
POSITION_BYTES = 8  # int64 position per cached entry and KV head


def estimate_ingest_bytes(
    shape: ModelShape,
    *,
    budget: int,
    block_size: int,
    prompt_tokens: int,
    context_tokens: int,
    full: bool,
    longest_head: int | None = None,
    select_from_full: bool = False,
) -> int:
    """Peak bytes of one ingest, weights included (an upper estimate, not a measurement).

    Live entries per layer: budget + block + patched prompt, or with `full` the whole context
    (system prompt + history, `context_tokens`). Layer and head budgets move entries between layers
    and heads but keep the mean at `budget`; `longest_head` (default `budget`) is the most one head of
    one layer may keep, which sizes the largest attention matrix. On top of the live cache: the
    finished cache of the previous episode plus its serialised copy while it is written (2 x kept
    entries), one layer's copy while a block is appended, one block's activations, and one layer's
    attention scores for the block and for the patched prompt (weights and softmax; ragged heads are
    padded to the longest there). `select_from_full` (`--prefill full`): the whole context stays live while
    each episode's patched prompt scores it and `budget` entries per layer are copied out.
    """
    if select_from_full:
        live, kept, widest = context_tokens + prompt_tokens, budget, context_tokens + prompt_tokens
        full = False  # the patched prompt's scores are counted below
    else:
        live = context_tokens if full else budget + block_size + prompt_tokens
        kept = context_tokens if full else budget
        widest = live if full else (longest_head or budget) + block_size + prompt_tokens
    entry = shape.kv_heads * (2 * shape.head_dim * shape.dtype_bytes + POSITION_BYTES)  # K, V, position
    cache = (live + 2 * kept) * entry * shape.layers + widest * entry
    activations = block_size * shape.hidden * ACTIVATION_FACTOR * shape.dtype_bytes
    scores = (block_size + (0 if full else 2 * prompt_tokens)) * widest * shape.heads * FLOAT_BYTES
    return shape.weight_bytes + cache + activations + scores


def available_bytes(
    device: torch.device | str = "cpu", *, cuda_free: Callable[[torch.device], tuple[int, int]] | None = None
) -> int | None:
    """Memory this process may still allocate on `device`. CUDA: the GPU's free bytes (`cuda_free`, default
    torch.cuda.mem_get_info, returns (free, total)). CPU: /proc/meminfo's MemAvailable, capped by a cgroup
    limit (v2 or v1) when one is set; None where nothing is readable (not Linux): the check is skipped."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = (cuda_free or torch.cuda.mem_get_info)(device)
        return int(free)
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        available = next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit, usage = int(Path(limit_file).read_text()), int(Path(usage_file).read_text())
        except (OSError, ValueError):  # absent, or "max": no limit
            continue
        available = min(available, max(limit - usage, 0))
    return available


def check_fits(estimate: int, *, resident: int, available: int | None, device: torch.device | str = "cpu") -> None:
    """Refuse an ingest whose estimate, less the `resident` bytes already allocated (the loaded model),
    exceeds `available` (on `device`). `available=None` (unknown) lets it run."""
    if available is None or estimate - resident <= available:
        return
    device = torch.device(device)
    memory = "memory" if device.type == "cpu" else f"GPU memory ({device})"
    raise UserError(
        f"this ingest needs an estimated {_gib(estimate)} of {memory} at its peak ({_gib(estimate - resident)} "
        f"more than the loaded model) but only {_gib(available)} is available: lower {setting('budget')} or "
        f"{setting('block_size')}, or pass {option('force')} to run it anyway"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
