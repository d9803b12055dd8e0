"""The options several commands share, and loading the store, model and encoder they name."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from kvchat.config import (
    CACHE_PRECISIONS,
    DEVICES,
    DTYPES,
    HEAD_BUDGETS,
    LAYER_BUDGETS,
    MEMORY_READOUTS,
    OFFLOAD_MODES,
    POSITION_MODES,
    PREFILL_MODES,
    RECALL_ENTRIES,
    TRAIN_STAGES,
    WEIGHT_MODES,
    DeviceConfig,
    default_home,
)
from kvchat.errors import UserError
from kvchat.kv.methods import METHOD_CHOICES

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout (for scripts; see docs/scripting.md).")]
DeviceOpt = Annotated[Literal[DEVICES], typer.Option(  # type: ignore[valid-type]
    help="Where the model runs. auto: CUDA when torch sees a GPU, else the CPU.")]
DtypeOpt = Annotated[Literal[DTYPES], typer.Option(  # type: ignore[valid-type]
    help="The model's dtype, and its caches'. auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16, or "
    "float16 (CUDA only). A cache answers in any dtype, converted on load.")]
ThreadsOpt = Annotated[int | None, typer.Option(min=1,
    help="Torch threads (default: $OMP_NUM_THREADS, else the cores this process may use). Running several "
    "kvchat processes? Give each cores / processes.")]
# Choices are real choices: listed in --help, completed by the shell, refused by the parser (exit 2).
Positions = Literal[POSITION_MODES]  # type: ignore[valid-type]
Prefill = Literal[PREFILL_MODES]  # type: ignore[valid-type]
Method = Literal[METHOD_CHOICES]  # type: ignore[valid-type]
LayerBudgets = Literal[LAYER_BUDGETS]  # type: ignore[valid-type]
HeadBudgets = Literal[HEAD_BUDGETS]  # type: ignore[valid-type]
Offload = Literal[OFFLOAD_MODES]  # type: ignore[valid-type]
CachePrecision = Literal[CACHE_PRECISIONS]  # type: ignore[valid-type]
RecallEntries = Literal[RECALL_ENTRIES]  # type: ignore[valid-type]
TrainStage = Literal[TRAIN_STAGES]  # type: ignore[valid-type]
MemoryReadoutMode = Literal[MEMORY_READOUTS]  # type: ignore[valid-type]
Weights = Literal[WEIGHT_MODES]  # type: ignore[valid-type]
BuildWeightsOpt = Annotated[Weights, typer.Option("--weights", help="Linear weights, as ask's.")]
ModelOpt = Annotated[str, typer.Option(help="'default', a model dir or a .gguf file.")]
TrustOpt = Annotated[bool, typer.Option(help="Allow a model dir's own Python code.")]
ForceOpt = Annotated[bool, typer.Option(help="Run even when the memory estimate exceeds the available memory.")]


def complete_conversation(incomplete: str) -> list[str]:
    """Stored conversation names, for shell completion."""
    try:
        return [r.name for r in open_store().conversations() if r.name.startswith(incomplete)]
    except Exception:  # completion must never print a traceback into the shell
        return []


NameArg = Annotated[str, typer.Argument(help="Conversation name.", autocompletion=complete_conversation)]


def open_store(*, frees_space: bool = False):
    """The store at $KVCHAT_HOME (imported here: the store is not needed for --help); `frees_space` for a
    command that frees space, so it still runs on a full disk (`Store`)."""
    from kvchat.store import Store

    return Store(default_home(), frees_space=frees_space)


def load_model(spec: str, store, trust_remote_code: bool = False, threads: int | None = None,
               device: DeviceConfig = DeviceConfig(), weights: str = "float"):
    """The model `spec` names, placed and threaded as asked (torch and transformers load here, not before)."""
    from kvchat.cli.progress import ConversionDisplay
    from kvchat.model import llm
    from kvchat.model.device import resolve

    placement = resolve(device)  # a device this machine lacks is refused before anything loads
    llm.use_threads(threads)
    with ConversionDisplay() as conversion:  # a first GGUF conversion shows itself
        return llm.load_model(spec, store.models_dir, trust_remote_code=trust_remote_code, placement=placement,
                              weights=weights, conversion=conversion)


def load_encoder():
    from kvchat.model.encoder import SentenceEncoder

    return SentenceEncoder()


def int_list(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated option's integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers (got {text!r})") from None
    if not values:
        raise UserError(f"{option} is empty")
    return values
