"""`kvchat eval`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from kvchat import documents
from kvchat.cli.options import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ThreadsOpt,
    Weights,
    int_list,
    load_encoder,
    load_model,
    open_store,
)
from kvchat.cli.progress import RichEvalProgress, progress_bars
from kvchat.cli.render import beside_table, emit_json, err, say, table
from kvchat.cli.words import spell
from kvchat.config import (
    CacheConfig,
    DeviceConfig,
    EvalConfig,
    IngestConfig,
    OffloadConfig,
)
from kvchat.eval.report import COLUMNS as EVAL_COLUMNS
from kvchat.eval.report import cell as eval_cell


def eval_command(
    data: Annotated[list[Path] | None, typer.Argument(
        metavar="DATA", help="LoCoMo-format conversation files with QA.")] = None,
    methods: Annotated[str, typer.Option(help="Comma-separated methods; full KV always runs as the reference.")] = (
        ",".join(EvalConfig.methods)
    ),
    budgets: Annotated[str, typer.Option(help="Comma-separated budgets M.")] = ",".join(map(str, EvalConfig.budgets)),
    max_context: Annotated[int | None, typer.Option(
        help="Keep whole sessions from the start up to this many tokens (default: the model's window minus "
        "room for the answer) and only questions whose evidence is all inside.")] = EvalConfig.max_context,
    questions: Annotated[int | None, typer.Option(
        help="At most N questions per conversation, spread evenly over the file.")] = EvalConfig.questions,
    categories: Annotated[str, typer.Option(
        help="LoCoMo categories: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial.")] = (
        ",".join(map(str, EvalConfig.categories))
    ),
    synthetic: Annotated[int, typer.Option(help="Also run N planted-fact conversations (deterministic).")] = 0,
    model: Annotated[str, typer.Option(help="'default' (embedded SmolLM2-135M), a model dir or a .gguf file.")] = (
        IngestConfig.model
    ),
    offload: Annotated[str, typer.Option(
        help="Comma-separated offload modes, each run with every method and budget: none, icecache (with "
        "icecache, full KV runs once more, paged past the system prompt and the last tokens).")] = "none",
    retrieve: Annotated[int, typer.Option(help="--offload icecache: entries per layer and KV head read (R).")] = (
        OffloadConfig.retrieve
    ),
    cache_precision: Annotated[str, typer.Option(
        help="Comma-separated cache precisions, each run with every method and budget: full, int8, int4 (as for "
        "ingest; quantized variants are named .../precision=int8 or .../precision=int4).")] = CacheConfig.precision,
    out_path: Annotated[Path | None, typer.Option("--out", help="Append per-question records here (JSON lines); "
                                                  "a re-run skips what the file already has.")] = None,
    report: Annotated[Path | None, typer.Option(help="Write a markdown report (and a PNG plot beside it).")] = None,
    per_conversation: Annotated[bool, typer.Option(
        help="One row per conversation and variant in the table and --json (the report stays pooled).")] = False,
    against: Annotated[str, typer.Option(
        help="full: compare with full KV's answers (the history must fit the model's window); gold: score every "
        "system against the gold answers, whole conversations, beside rag and recent at equal KV entries; auto: "
        "gold for a history that does not fit the window.")] = EvalConfig.against,
    chunk_tokens: Annotated[int, typer.Option(help="Against gold: tokens per chunk of the rag baseline.")] = (
        EvalConfig.chunk_tokens
    ),
    setting: Annotated[list[str] | None, typer.Option(
        metavar="KEY=VALUE", help="A saved setting of every variant's ingest, as `kvchat ingest --setting` takes it "
        "(block_size, prefill, ...: docs/commands.md); repeatable.")] = None,
    threads: ThreadsOpt = None,
    weights: Annotated[Weights, typer.Option(
        help="The Linear weights the caches are built and the answers decoded with, as `kvchat ingest` and "
        "`kvchat ask` hold them (auto: int4 for the embedded model on a CPU).")] = (
        EvalConfig.weights
    ),
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    as_json: JsonOpt = False,
) -> None:
    """Measure answer quality of methods x budgets against full KV on LoCoMo files (F1, agreement, KL), or against
    the gold answers beside rag and recent where a history does not fit the model's window."""
    from kvchat.eval import evaluate, gold, summary
    from kvchat.settings import with_settings

    config = EvalConfig(
        methods=_names(methods), budgets=int_list(budgets, "--budgets"), max_context=max_context,
        questions=questions, categories=int_list(categories, "--categories"), against=against,
        chunk_tokens=chunk_tokens, weights=weights,
    )
    base = with_settings(IngestConfig(model=model), setting or [])
    variant_list = evaluate.plan_variants(data or [], synthetic, config, base, offloads=_names(offload),
                                          precisions=_names(cache_precision), retrieve=retrieve)
    results = evaluate.ResultsFile(out_path)
    store = open_store()
    lm = load_model(model, store, threads=threads, device=DeviceConfig(device, dtype), weights=config.weights)
    sets = evaluate.qa_sets(data or [], synthetic, lm, config)
    for s in sets:
        if s.sessions_total:
            say(f"kvchat: {s.name}: {s.sessions_kept}/{s.sessions_total} sessions, "
                f"{len(s.questions)} questions with all evidence inside", console=err)
    full_sets, gold_sets = gold.by_reference(sets, lm, config.against, base.system_prompt)
    encoder = load_encoder()
    with progress_bars(hidden=as_json) as bars:
        records = evaluate.evaluate(
            full_sets, variant_list, lm=lm, encoder=encoder, config=config, base=base, results=results,
            profile_dirs=[store.home / "profiles"], progress=RichEvalProgress(bars),
        )
        if gold_sets:
            systems = gold.gold_variants([(v.key, v.cache) for v in variant_list], config.budgets,
                                         config.chunk_tokens, base.cache)  # fmt: skip
            records = gold.evaluate_gold(
                gold_sets, systems, lm=lm, encoder=encoder, results=results, config=config, base=base,
                profile_dirs=[store.home / "profiles"], progress=RichEvalProgress(bars),
            )
    gold_names = {s.name for s in gold_sets}
    against_gold = [r for r in gold.gold_records(records) if r["set"] in gold_names]
    gold_rows, verdict = gold.summarize_gold(against_gold), gold.verdict(against_gold)
    sets = full_sets
    names = {s.name for s in sets}
    rows = summary.summarize([r for r in records if r["set"] in names])
    skips = [f"{key} on {name} skipped: {reason}" for (name, key), reason in evaluate.skipped(records).items()
             if name in names]
    skips += [f"{r['variant']} on {r['set']} skipped: {r['reason']}" for r in against_gold if r["kind"] == "skipped"]
    for line in skips:
        say(f"kvchat: {spell(line)}", console=err)
    if report is not None:
        from kvchat.eval import report as eval_report

        ran = eval_report.settings(config, base, model=lm.spec, offloads=_names(offload),
                                   precisions=_names(cache_precision), retrieve=retrieve, weights=lm.weights)
    if report is not None and gold_rows:
        report.parent.mkdir(parents=True, exist_ok=True)
        target = report if not sets else report.with_suffix(".gold.md")
        gold_settings = {**ran, "methods": ", ".join(config.methods),
                         "baselines": f"rag (the top chunks of at most {config.chunk_tokens} tokens of raw turns, "
                                      "ranked by the sentence encoder, by their words, or by both fused) and recent "
                                      "(sink + the last entries) at each budget"}
        target.write_text(gold.gold_markdown(against_gold, title=f"kvchat eval against gold ({lm.spec})",
                                             notes=[s.describe(config.questions) for s in gold_sets],
                                             settings=gold_settings))  # fmt: skip
    if report is not None and sets:
        eval_report.write(report, rows, title=f"kvchat eval ({lm.spec})", sets=names, synthetic=not data,
                          settings=ran, notes=[s.describe(config.questions) for s in sets] + [spell(s) for s in skips])
    columns: Sequence[tuple[str, str, str]] = EVAL_COLUMNS
    if per_conversation:
        rows = summary.summarize_per_conversation([r for r in records if r["set"] in names])
        columns = [("conversation", "conversation", "{}"), *EVAL_COLUMNS]
    if as_json:
        emit_json(documents.eval_rows(rows, gold_rows, verdict))
        return
    if rows:
        headers = [header for _, header, _ in columns]
        table(headers, [[eval_cell(row, key, fmt) for key, _, fmt in columns] for row in rows],
              title=f"kvchat eval: {', '.join(sorted(names))}", right=headers[2 if per_conversation else 1:])
    if gold_rows:
        headers = [header for _, header, _ in gold.COLUMNS]
        table(headers, [[eval_cell(row, key, fmt) for key, _, fmt in gold.COLUMNS] for row in gold_rows],
              title=f"kvchat eval against gold: {', '.join(sorted(gold_names))}", right=headers[1:])
        for line in verdict:
            say(f"kvchat: {line}", console=beside_table())


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated option's names, blanks dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())
