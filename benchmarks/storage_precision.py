"""How episode files hold keys and values (`--setting cache_storage=...`): bytes on disk against what the answers lose,
on the in-window LoCoMo eval. What chose `CacheConfig.storage`'s default.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/storage_precision.py conv-26.json conv-30.json \
        --out benchmarks/results/records/storage_precision.jsonl --report benchmarks/results/storage_precision.md

Each LoCoMo conversation is cut to the model's window (whole sessions, `kvchat eval`'s in-window set: every category
1-4 question whose evidence is all inside) and ingested at the defaults with the default weights (int4 on a CPU) in
the model's dtype (float32 on a CPU), once, into a scratch store. Every question is routed as `kvchat ask` routes it
and answered greedily (LoCoMo's QA prompt, kvchat's evaluation settings) from the routed episode's cache as each
storage gives it back: written by the codec (`kvchat.kv.codec.encode` with that storage) and read back in the model's
dtype, exactly what `kvchat ask` would answer from. `int4 (held)` is `--cache-precision int4`'s cache, for the scale
of a coarser code. Beside them, full KV (the whole cut history prefilled), as `kvchat eval` compares with.

Per storage: the episode file's bytes (every tensor and metadata entry the store writes), first-answer-token
KL(float32 || storage) and KL(full KV || storage), first-token and answer agreement with the float32 cache's answer
(token F1, as `kvchat eval`), and LoCoMo F1 against gold, with the paired difference from float32 and its 95%
bootstrap interval. Nothing is timed: the load check is reported, and `--allow-busy` measures beside other work
without changing a figure. Records (JSON lines) resume: a question answered under a storage is not answered again.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from _load import Load, checked, shown  # benchmarks/ is on sys.path

from kvchat.config import ANSWER_ROOM, CacheConfig, EvalConfig, IngestConfig, default_home
from kvchat.eval.evaluate import _kl
from kvchat.eval.gold import bootstrap_interval, paired_difference
from kvchat.eval.qa import load_locomo, score_answer, token_f1
from kvchat.history.episodes import route
from kvchat.history.loading import format_turns
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.prefill import block_prefill
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel, generate, load_model, use_threads
from kvchat.store import Store

REFERENCE = "model"  # the dtype the cache was built in (float32 on a CPU)
NUDGED = "float32, nudged"
STORAGES = ("model", NUDGED, "float16", "bfloat16", "int8", "int4 (held)")
FULL = "full KV"
NUDGE = 2.0**-20  # a relative change of a few float32 steps: what no one would call a loss (the noise floor)


def stored_as(cache: EpisodeCache, meta: codec.EpisodeMeta, metadata: dict[str, str], storage: str,
              dtype: torch.dtype) -> tuple[EpisodeCache, int]:  # fmt: skip
    """`cache` written as an episode file in `storage` and read back in `dtype`, and that file's bytes (the stored
    file's other metadata, its turn spans, kept as they are)."""
    source, nudged = cache, storage == NUDGED
    if nudged:  # every key and value moved by a few float32 steps, stored as they are
        storage = "model"
    if storage == "int4 (held)":
        source = cache.copy()
        source.quantize(16, 0, 4)  # CacheConfig.quant_group_4bit, quant_residual: --cache-precision int4's cache
        storage = "model"
    written = codec.meta_of(source, fingerprint=meta.fingerprint, method=meta.method, positions=meta.positions,
                            storage=storage)  # fmt: skip
    tensors, own = codec.encode(source, written)
    if nudged:
        tensors = {k: t * (1 + NUDGE) if k[:2] in ("k.", "v.") else t for k, t in tensors.items()}
    codec_keys = {*meta.to_metadata(), "format_version", "storage"}
    extra = {k: v for k, v in metadata.items() if k not in codec_keys}
    data = safetensors.torch.save(tensors, {**extra, **own, "format_version": codec.format_version(own)})
    back, _ = codec.decode(safetensors.torch.load(data), {**extra, **own}, dtype=dtype)
    return back, len(data)


def answer(lm: LoadedModel, cache: EpisodeCache, prompt: torch.Tensor, tokens: int) -> tuple[torch.Tensor, str]:
    """First-token log-probabilities and the greedy answer, the cache rolled back afterwards."""
    first: list[torch.Tensor] = []
    mark = cache.checkpoint()
    try:
        ids = list(generate(lm, cache, prompt, tokens, first.append))
    finally:
        cache.rollback(mark)
    return first[0].float().log_softmax(-1), lm.decode(ids).strip()


def run(paths: list[Path], out: Path, load: Load) -> list[dict]:
    """Every in-window question of every conversation under every storage; records appended to `out`."""
    records = [json.loads(line) for line in out.open()] if out.exists() else []
    done = {(r["set"], r["qid"], r["storage"]) for r in records if r["kind"] == "answer"}
    use_threads()
    settings = EvalConfig()
    with tempfile.TemporaryDirectory(prefix="kvchat-storage-") as scratch, out.open("a") as sink:
        def keep(record: dict) -> None:
            records.append(record)
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        keep({"kind": "run", "load": load.record(), "date": str(dt.date.today())})
        store = Store(Path(scratch))
        lm = load_model("default", Store(default_home()).models_dir, weights=settings.weights)
        encoder = SentenceEncoder()
        window = lm.context_window - ANSWER_ROOM
        for path in paths:
            qa = load_locomo(path, count_tokens=lambda text: lm.encode(text).shape[-1], max_context=window)
            if all((qa.name, q.qid, s) in done for q in qa.questions for s in (*STORAGES, FULL)):
                continue  # every answer recorded: not ingested again
            config = IngestConfig(cache=dataclasses.replace(CacheConfig(), storage=REFERENCE))  # float32 files
            ingest(qa.turns, name="storage", config=config, store=store, lm=lm, encoder=encoder, replace=True,
                   source=qa.name)  # fmt: skip
            record = store.get("storage")
            layout = ChatLayout.from_tokenizer(lm.tokenizer, record.settings["system_prompt"])
            history = lm.encode("\n".join(format_turns(qa.turns)))
            full = block_prefill(lm.model, lm.encode(layout.before_conversation), history, block_size=512,
                                 budgets=None, scorer=None).cache  # fmt: skip
            centroids = np.asarray([e.centroid for e in record.episodes], dtype=np.float32)
            variants: dict[int, dict[str, tuple[EpisodeCache, int]]] = {}
            for n, question in enumerate(qa.questions, 1):
                episode, _ = route(encoder.embed([question.text])[0], centroids)
                if episode not in variants:
                    tensors, metadata = store.load_episode(record.episodes[episode], lm.fingerprint)
                    cache, meta = codec.decode(tensors, metadata, dtype=lm.dtype)
                    variants[episode] = {s: stored_as(cache, meta, metadata, s, lm.dtype) for s in STORAGES}
                prompt = lm.encode(layout.question(settings.question_template.format(question=question.text)))
                reference = answer(lm, full.copy(), prompt, settings.max_new_tokens)
                base = answer(lm, variants[episode][REFERENCE][0], prompt, settings.max_new_tokens)
                for storage in (FULL, *STORAGES):
                    if (qa.name, question.qid, storage) in done:
                        continue
                    cache, size = (full, 0) if storage == FULL else variants[episode][storage]
                    logprobs, text = {FULL: reference, REFERENCE: base}.get(storage) or answer(
                        lm, cache, prompt, settings.max_new_tokens)
                    keep({"kind": "answer", "set": qa.name, "qid": question.qid, "storage": storage,
                          "episode": episode, "file_bytes": size, "answer": text,
                          "f1": score_answer(text, question), "kl_full": _kl(reference[0], logprobs),
                          "kl_model": None if storage == FULL else _kl(base[0], logprobs),
                          "first_token": None if storage == FULL else int(logprobs.argmax()) == int(base[0].argmax()),
                          "agreement": None if storage == FULL else (token_f1(text, base[1]) if text or base[1]
                                                                      else 1.0)})
                print(f"{qa.name}: {n}/{len(qa.questions)}", file=sys.stderr)
            store.remove("storage")
    return records


def report(records: list[dict], command: str) -> str:
    answers: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["kind"] == "answer":
            answers[r["storage"]].append(r)
    runs = [r for r in records if r["kind"] == "run"]
    f1 = {s: {(r["set"], r["qid"]): r["f1"] for r in rs} for s, rs in answers.items()}
    sets = sorted({r["set"] for rs in answers.values() for r in rs})
    lines = [
        "# Storage precision of episode files: bytes against answers, on the in-window LoCoMo eval",
        "",
        f"`{command}`",
        "",
        f"{dt.date.today()}, {platform.machine()}, torch {torch.__version__}, one thread; the embedded model with its "
        f"default weights (int4 on a CPU), caches built at the defaults in float32; {', '.join(sets)} cut to the "
        f"model's window, every category 1-4 question with its evidence inside ({len(answers.get(REFERENCE, []))} "
        "questions). Nothing is timed; the runs' load: "
        + "; ".join(f"{'busy' if r['load']['busy'] else 'alone'} (1-min load {r['load']['load_1min']})" for r in runs)
        + ".",
        "",
        "| storage | file bytes / episode | of float32 | KL(float32 ‖ it) mean [max] | KL(full KV ‖ it) mean | first "
        "token = float32 | answer agreement | F1 vs gold | - float32 [95% interval] |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    base_bytes = statistics.mean(r["file_bytes"] for r in answers[REFERENCE]) if answers.get(REFERENCE) else 0
    for storage in (FULL, *STORAGES):
        rs = answers.get(storage)
        if not rs:
            continue
        low, high = bootstrap_interval([r["f1"] for r in rs])
        size = statistics.mean(r["file_bytes"] for r in rs)
        diff = "" if storage in (REFERENCE, FULL) else "{:+.3f} [{:+.3f}, {:+.3f}]".format(
            *paired_difference(f1[storage], f1[REFERENCE])[:3])  # fmt: skip
        model_kl = [r["kl_model"] for r in rs if r["kl_model"] is not None]
        lines.append(
            f"| {storage} | {f'{size:,.0f}' if size else ''} | {f'{size / base_bytes:.1%}' if size else ''} | "
            + (f"{statistics.mean(model_kl):.6f} [{max(model_kl):.6f}]" if model_kl else "")
            + f" | {statistics.mean(r['kl_full'] for r in rs):.4f} | "
            + (f"{statistics.mean(r['first_token'] for r in rs if r['first_token'] is not None):.1%}" if model_kl
               else "")
            + " | "
            + (f"{statistics.mean(r['agreement'] for r in rs if r['agreement'] is not None):.1%}" if model_kl else "")
            + f" | {statistics.mean(r['f1'] for r in rs):.3f} [{low:.3f}, {high:.3f}] | {diff} |"
        )
    floor = [r["kl_model"] for r in answers.get(NUDGED, [])]
    if floor:
        noise = statistics.mean(floor)
        ratios = ", ".join(f"{s} {statistics.mean(r['kl_model'] for r in answers[s]) / noise:.1f}x"
                           for s in STORAGES if s not in (REFERENCE, NUDGED) and answers.get(s))  # fmt: skip
        lines += ["", f"The noise floor: `{NUDGED}` moves every key and value by 2^-20 of itself, a few float32 steps, "
                  f"and already costs KL {noise:.6f} (under the default int4 weights any change to a cache moves the "
                  f"first token this much). KL over that floor: {ratios}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", type=Path, help="LoCoMo files")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, resumed")
    parser.add_argument("--report", type=Path)
    args = checked(parser)
    records = run(args.data, args.out, args.load)
    command = "python benchmarks/storage_precision.py " + " ".join(
        (Path(a).name if Path(a).parent.name == "locomo" else shown(Path(a))) if os.path.exists(a) else a
        for a in sys.argv[1:])  # fmt: skip
    text = report(records, command)
    print(text)
    if args.report is not None:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
