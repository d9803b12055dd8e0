"""`kvchat profile-layers` and `kvchat train-indexer`: the per-model data ingest uses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from kvchat import documents
from kvchat.cli.options import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MemoryReadoutMode,
    ModelOpt,
    ThreadsOpt,
    TrainStage,
    TrustOpt,
    int_list,
    load_model,
    open_store,
)
from kvchat.cli.progress import LineTrainProgress, RichTrainProgress, progress_bars
from kvchat.cli.render import emit_json, err, say, table
from kvchat.cli.words import spell
from kvchat.config import DeviceConfig, IndexMemConfig, IngestConfig, ProfileSettings, TrainConfig
from kvchat.errors import UserError


def profile_layers_command(
    model: ModelOpt = IngestConfig.model,
    text: Annotated[Path | None, typer.Option(help="Calibration text file (default: the shipped one).")] = None,
    budget: Annotated[int, typer.Option(help="Simulated cache budget M.")] = ProfileSettings.budget,
    block_size: Annotated[int, typer.Option(help="Simulated prefill block B.")] = ProfileSettings.block_size,
    sink: Annotated[int, typer.Option(help="Sink tokens always visible.")] = ProfileSettings.sink,
    out_file: Annotated[Path | None, typer.Option("--out", help="Profile JSON (default: in $KVCHAT_HOME).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Also draw sensitivity and budgets per layer to this PNG.")] = None,
    trust_remote_code: TrustOpt = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    as_json: JsonOpt = False,
) -> None:
    """Measure how much block prefill disturbs each layer; ingest then budgets layers by it."""
    from kvchat.ingest.layer_profiles import profile_layers, read_calibration, save_plot, save_profile

    calibration, source = read_calibration(text)
    store = open_store()
    lm = load_model(model, store, trust_remote_code, threads, DeviceConfig(device, dtype))
    settings = ProfileSettings(budget=budget, block_size=block_size, sink=sink)
    profile = profile_layers(lm, calibration, settings, source=source)
    target, overridden = save_profile(profile, store.home, out_file)
    if plot is not None:
        save_plot(profile, plot)
    if overridden:
        say(f"kvchat: note: ingest now uses {target} for these weights instead of the shipped {overridden}; "
            "delete it to go back", console=err)
    if as_json:
        emit_json(documents.document(path=str(target), overrides=str(overridden) if overridden else None,
                                     **dataclasses.asdict(profile)))
        return
    table(("layer", "key similarity", "sensitivity"),
          [(i, f"{sim:.5f}", f"{sens:.5f}")
           for i, (sim, sens) in enumerate(zip(profile.similarity, profile.sensitivity, strict=True))],
          right=("layer", "key similarity", "sensitivity"))
    say(f"wrote {target}" + (f" and {plot}" if plot else ""), console=err)


def train_indexer_command(
    model: ModelOpt = IngestConfig.model,
    data: Annotated[list[Path] | None, typer.Option(
        "--data", help="Training text: chat histories (any format ingest reads) or .txt files; repeat for more "
        "(default: chitchat-dataset, kvchat's synthetic conversations and the calibration text).")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps per stage (one chunk each).")] = TrainConfig.steps,
    stage: Annotated[TrainStage, typer.Option(
        help="indexer, memory (on the indexer already at --out) or both.")] = TrainConfig.stage,
    chunks: Annotated[int, typer.Option(help="Training chunks.")] = TrainConfig.train_chunks,
    chunk_tokens: Annotated[int, typer.Option(help="Tokens per chunk.")] = TrainConfig.chunk_tokens,
    seed: Annotated[int, typer.Option(help="Data order, initial weights and held-out split.")] = TrainConfig.seed,
    memory_budgets: Annotated[str, typer.Option(
        help="Memory stage: the budgets its simulated block prefill evicts to, cycled over the chunks; each must "
        "exceed the system prompt's tokens.")] = ",".join(map(str, TrainConfig.memory_budgets)),
    memory_readout: Annotated[MemoryReadoutMode, typer.Option(
        help="Memory stage: how answering reads the memory: mass (its entries join attention's softmax as extra "
        "mass, weighed against the resident entries') or additive (the paper's o + g m(q)).")] = IndexMemConfig.readout,
    out_file: Annotated[Path | None, typer.Option(
        "--out", help="Weights file (default: in $KVCHAT_HOME/profiles/, used by ingest before the shipped ones).",
    )] = None,
    trust_remote_code: TrustOpt = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    as_json: JsonOpt = False,
) -> None:
    """Train IndexMem's indexer (and latent memory) for a model, by distillation from its own attention.

    Resumable: rerun the same command after an interruption. Deterministic for a seed."""
    from kvchat.training import default_out, train

    for path in data or []:
        if path.is_dir():
            raise UserError(f"{path}: a directory; --data takes files (chat histories or .txt), repeat it for each")
        if not path.is_file():
            raise UserError(f"{path}: no such file (--data takes chat histories or .txt files)")
    config = TrainConfig(stage=stage, steps=steps, train_chunks=chunks, chunk_tokens=chunk_tokens, seed=seed,
                         memory_budgets=int_list(memory_budgets, "--memory-budgets"))
    store = open_store()
    lm = load_model(model, store, trust_remote_code, threads, DeviceConfig(device, dtype))
    target = out_file or default_out(store.home, lm)
    with progress_bars(hidden=as_json) as bars:
        progress = RichTrainProgress(bars) if err.is_terminal else LineTrainProgress()
        report = train(lm, target, config, files=data or [], indexmem=IndexMemConfig(readout=memory_readout),
                       progress=progress)
    for note in report.notes:
        say(f"kvchat: note: {spell(note)}", console=err)
    if as_json:
        fields = report.to_dict()
        seconds = fields.pop("seconds")
        emit_json(documents.document(**fields, timings_ms={"total": round(seconds * 1000, 1)}))
        return
    indexer = report.metrics.get("indexer", {})
    memory = report.metrics.get("memory", {})
    say(f"wrote {report.out} ({report.file_bytes / 2**10:.0f} KiB; {', '.join(report.stages)}; "
        f"{report.seconds:.0f} s)")
    if indexer:
        say(f"held-out top-{indexer['fraction']:.0%} overlap with the model's attention: {indexer['top_overlap']:.3f} "
            f"(SnapKV-like {indexer['snapkv_like_top_overlap']:.3f}, random {indexer['random_top_overlap']:.3f})")
    if memory:
        parts = ", ".join(f"{v:.3f} at {k}" for k, v in memory["residual_removed"].items() if v is not None)
        say(f"held-out share of the eviction residual the memory removes: {parts}")
