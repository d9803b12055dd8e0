"""Progress of long commands on stderr: rich bars on a terminal, a line now and then in a log."""

from __future__ import annotations

import time
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kvchat.cli.render import counted, err, say
from kvchat.cli.terminal import clean
from kvchat.cli.words import spell
from kvchat.kv.methods import AUTO_METHOD, AUTO_METHODS


def progress_bars(*, hidden: bool = False, markup: bool = True) -> Progress:
    """The bars every long command draws on stderr: description, bar, n/total, elapsed, remaining; drawn only
    on a terminal (and not when `hidden`), gone when done."""
    return Progress(
        TextColumn("{task.description}", markup=markup), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=err, transient=True, disable=hidden or not err.is_terminal,
    )  # fmt: skip


class ConversionDisplay:
    """A first model conversion (kvchat.model.files.ConversionProgress) on stderr, once: what is converted, its size and
    an estimate, then its phase and the time elapsed on a terminal (a line when it starts and one when it ends in a
    log). A context: the display ends with it, whether or not the conversion finished."""

    def __init__(self) -> None:
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        self.what = ""

    def __enter__(self) -> ConversionDisplay:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def converting(self, gguf: Path, weights: int, estimate_s: float) -> None:
        size = gguf.stat().st_size / 2**20
        self.what = (f"converting the model {gguf.stem} ({size:.0f} MiB, {weights / 1e6:.0f}M weights) once, "
                     f"about {_duration(estimate_s)}")  # fmt: skip
        if not err.is_terminal:
            say(f"kvchat: {self.what}; later commands load the converted copy", console=err)
            return
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                            console=err, transient=True)  # fmt: skip
        self.task = self.bar.add_task(self.what, total=None)
        self.bar.start()

    def phase(self, what: str) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, description=f"{self.what}: {what}")

    def converted(self, seconds: float) -> None:
        self.__exit__()
        say(f"kvchat: model converted in {_duration(seconds)}; later commands load the converted copy", console=err)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


STORED = "stored"  # `asked` of an append: the conversation's own method


def method_line(asked: str, name: str, history_tokens: int, window: int) -> str:
    """The line that announces the method an ingest builds with: `asked` (`--method`, or STORED for an append)
    resolved to `name`, and why when `auto` chose it."""
    if asked == STORED:
        return f"kvchat: method {name} (the conversation's)"
    if asked != AUTO_METHOD:
        return f"kvchat: method {name}"
    relation = "exceed" if name == AUTO_METHODS[1] else "fit"
    return (f"kvchat: method {name} (auto: the history's {history_tokens:,} tokens with the system prompt "
            f"{relation} the model's {window:,}-token window)")


class LineIngestProgress:
    """Where stderr is not a terminal: a line per episode and, once the ingest has run a few seconds (a short one
    stays quiet), a line per planning step, per tenth of the segments embedded and per tenth of an episode's
    blocks, so a log shows a long ingest is alive. With `asked` (the method asked for) the method built with is
    announced before the first block."""

    quiet_s = 3.0

    def __init__(self, asked: str | None = None) -> None:
        self.asked = asked
        self.started = time.monotonic()
        self.said: tuple[str, int] | None = None
        self.blocks = BlockTally()
        self.blocks_started = self.started

    def method(self, name: str, history_tokens: int, window: int) -> None:
        if self.asked is not None:
            say(method_line(self.asked, name, history_tokens, window), console=err)

    def planned(self, blocks: int, episodes: int, tokens: int) -> None:
        self.blocks, self.blocks_started = BlockTally(blocks), time.monotonic()
        err.print(f"kvchat: history of {tokens} tokens: {blocks} blocks over {episodes} "
                  f"episode{'s' * (episodes != 1)}", markup=False, soft_wrap=True)  # fmt: skip

    def planning(self, step: str, done: int, total: int) -> None:
        self._tenths(step, done, total)

    def _tenths(self, what: str, done: int, total: int) -> None:
        """A line when `what` starts and at each tenth of it done, past the first `quiet_s` seconds."""
        tenth = done * 10 // max(total, 1)
        if self._seconds() < self.quiet_s or self.said == (what, tenth):
            return
        self.said = (what, tenth)
        counted = f" {done:,}/{total:,}" if total > 1 else ""
        err.print(f"kvchat: {what}{counted} ({self._elapsed()})", markup=False, soft_wrap=True)

    def _seconds(self) -> float:
        return time.monotonic() - self.started

    def history(self, done: int, total: int) -> None:
        self.blocks.step(done)
        if done == total:
            err.print(f"kvchat: history prefilled once ({total} blocks, {self._elapsed()}); selecting episodes",
                      markup=False, soft_wrap=True)  # fmt: skip

    def episode(self, index: int, total: int) -> None:
        self.blocks.new_pass()
        err.print(f"kvchat: episode {index + 1}/{total} ({self._elapsed()}{self.blocks.eta(self.blocks_started)})",
                  markup=False, soft_wrap=True)  # fmt: skip

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.1f} s elapsed"

    def block(self, done: int, total: int) -> None:
        self.blocks.step(done)
        if done < total:
            self._tenths("blocks", done, total)

    def recall_entries(self, done: int, total: int) -> None:
        self._tenths("recall entries: chunks", done, total)

    def resuming(self, done: str, blocks: int) -> None:
        self.blocks.resumed(blocks)
        err.print(f"kvchat: resuming: {done}", markup=False, soft_wrap=True)

    def note(self, text: str) -> None:
        err.print(f"kvchat: note: {spell(text)}", markup=False, soft_wrap=True)

    def checkpoint(self, index: int, blocks: int, total: int) -> None:
        pass

    def running(self, part: str, worker) -> None:
        pass


class BlockTally:
    """Blocks done of the ingest's planned total, from per-pass counts (each episode's prefill counts from 1)."""

    def __init__(self, total: int = 0) -> None:
        self.total, self.done, self._pass = total, 0, 0
        self.kept = 0  # blocks a resumed ingest had done before: counted done, not in its pace

    def resumed(self, blocks: int) -> None:
        self.done += blocks
        self.kept += blocks

    def new_pass(self) -> None:
        self._pass = 0

    def step(self, done_in_pass: int) -> int:
        """Count the pass's blocks up to `done_in_pass`; returns how many that adds."""
        added = max(0, done_in_pass - self._pass)
        self._pass = max(self._pass, done_in_pass)
        self.done += added
        return added

    def eta(self, started: float) -> str:
        """", ETA N s" once a block is done (the pace so far over the blocks left), else ""."""
        ran = self.done - self.kept
        if ran <= 0 or not self.total:
            return ""
        left = max(0, self.total - self.done)
        return f", ETA {(time.monotonic() - started) / ran * left:.0f} s"


class RichIngestProgress:
    """Per-episode and per-block bars on a TTY; with `asked`, the method announced above them."""

    def __init__(self, progress: Progress, asked: str | None = None) -> None:
        self.progress, self.asked = progress, asked
        self.overall = progress.add_task("ingest", total=None)
        self.episodes = progress.add_task("episodes", total=None)
        self.blocks = progress.add_task("blocks", total=None)
        self.tally = BlockTally()

    def method(self, name: str, history_tokens: int, window: int) -> None:
        if self.asked is not None:
            say(method_line(self.asked, name, history_tokens, window), console=err)

    def planned(self, blocks: int, episodes: int, tokens: int) -> None:
        self.tally = BlockTally(blocks)
        self.progress.reset(self.overall, total=blocks, description=f"ingest ({tokens} tokens, all blocks)")

    def planning(self, step: str, done: int, total: int) -> None:
        self.progress.update(self.blocks, completed=done, total=total if total > 1 else None, description=step)

    def history(self, done: int, total: int) -> None:
        self.progress.advance(self.overall, self.tally.step(done))
        self.progress.update(self.blocks, completed=done, total=total, description="history (full prefill)")

    def episode(self, index: int, total: int) -> None:
        self.tally.new_pass()
        self.progress.update(self.episodes, completed=index, total=total, description=f"episode {index + 1}")
        self.progress.update(self.blocks, description="blocks")

    def block(self, done: int, total: int) -> None:
        self.progress.advance(self.overall, self.tally.step(done))
        self.progress.update(self.blocks, completed=done, total=total)
        if done == total:
            self.progress.advance(self.episodes)

    def recall_entries(self, done: int, total: int) -> None:
        self.progress.update(self.blocks, completed=done, total=total, description="recall entries (chunks)")

    def resuming(self, done: str, blocks: int) -> None:
        self.tally.resumed(blocks)
        self.progress.update(self.overall, completed=blocks)
        self.progress.console.print(f"kvchat: resuming: {done}", markup=False, soft_wrap=True)

    def note(self, text: str) -> None:
        self.progress.console.print(f"kvchat: note: {spell(text)}", markup=False, soft_wrap=True)

    def checkpoint(self, index: int, blocks: int, total: int) -> None:
        pass

    def running(self, part: str, worker) -> None:
        pass


class LineBatchProgress:
    """Where stderr is not a terminal: a line per history done (with the tally and an ETA) or retried."""

    def __init__(self) -> None:
        self.started: float | None = None  # when the first history went to a worker: the ETA leaves out loading
        self.total = 0
        self.done = 0

    def start(self, total: int, workers: int) -> None:
        self.total = total
        say(f"kvchat: {total} histories on {workers} worker{'s' * (workers != 1)} (each loads the model once)",
            console=err)  # fmt: skip

    def running(self, name: str, attempt: int, worker) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def episode(self, name: str, done: int, total: int) -> None:
        pass

    def retrying(self, name: str, why: str) -> None:
        say(f"kvchat: retrying {name} on another worker: {spell(why)}", console=err)

    def finished(self, result) -> None:
        self.done += 1
        elapsed = time.monotonic() - (self.started or time.monotonic())
        eta = elapsed / self.done * (self.total - self.done)
        say(f"kvchat: [{self.done}/{self.total}] {result.status} {result.name}: {_batch_outcome(result)} "
            f"({elapsed:.0f} s elapsed, ETA {eta:.0f} s)", console=err)  # fmt: skip


class RichBatchProgress:
    """On a TTY: a bar over all histories (done, failed, running, ETA) and one per running history."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.overall = progress.add_task("histories", total=None)
        self.running_tasks: dict[str, TaskID] = {}
        self.tally = {"committed": 0, "skipped": 0, "failed": 0}

    def start(self, total: int, workers: int) -> None:
        self.progress.update(self.overall, total=total, description=f"starting {workers} workers")

    def running(self, name: str, attempt: int, worker) -> None:
        label = f"  {clean(name)}" + (f" (try {attempt})" if attempt > 1 else "")
        self.running_tasks[name] = self.progress.add_task(label, total=None)
        self._describe()

    def episode(self, name: str, done: int, total: int) -> None:
        if name in self.running_tasks:
            self.progress.update(self.running_tasks[name], completed=done, total=total)

    def retrying(self, name: str, why: str) -> None:
        self._stop(name)
        say(f"kvchat: retrying {name} on another worker: {spell(why)}", console=self.progress.console)

    def finished(self, result) -> None:
        self._stop(result.name)
        self.tally[result.status] += 1
        self.progress.advance(self.overall)
        self._describe()
        if result.status == "failed":
            say(f"kvchat: failed {result.name}: {spell(result.error or '')}", console=self.progress.console)

    def _stop(self, name: str) -> None:
        task = self.running_tasks.pop(name, None)
        if task is not None:
            self.progress.remove_task(task)

    def _describe(self) -> None:
        t = self.tally
        done = f"{t['committed']} done" + (f", {t['skipped']} skipped" if t["skipped"] else "")
        self.progress.update(self.overall, description=f"{done}, {t['failed']} failed, "
                                                       f"{len(self.running_tasks)} running")  # fmt: skip


def _batch_outcome(result) -> str:
    """What became of one history, in a few words."""
    if result.status == "committed":
        report = result.report
        return f"{counted(report.episodes, 'episode')}, {report.cache_bytes / 2**20:.1f} MiB, {result.seconds:.1f} s"
    if result.status == "skipped":
        return "stored with the same settings"
    return spell(result.error or "failed")


class RichTrainProgress:
    """Bars for `train-indexer`: the frozen model's pass over the chunks, then each stage's steps."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def prepare(self, done: int, total: int) -> None:
        self._update("chunks through the model", done, total)

    def step(self, stage: str, done: int, total: int, loss: float) -> None:
        self._update(f"{stage} (loss {loss:.4f})", done, total, key=stage)

    def _update(self, description: str, done: int, total: int, key: str | None = None) -> None:
        key = key or description
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(description, total=total)
        self.progress.update(self.tasks[key], completed=done, total=total, description=description)


class LineTrainProgress:
    """Where stderr is not a terminal: a line when the data is ready and every 25 steps, so a log shows it is alive."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def prepare(self, done: int, total: int) -> None:
        if done == total:
            self._say(f"{total} chunks through the model")

    def step(self, stage: str, done: int, total: int, loss: float) -> None:
        if done % 25 == 0 or done == total:
            self._say(f"{stage} step {done}/{total}, loss {loss:.4f}")

    def _say(self, text: str) -> None:
        err.print(f"kvchat: {text} ({time.monotonic() - self.started:.1f} s elapsed)", markup=False, soft_wrap=True)


class RichEvalProgress:
    """A bar per conversation x variant, with the ingest's blocks and the questions under it."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.variants = progress.add_task("variants", total=None)
        self.questions = progress.add_task("questions", total=None)
        self.ingest = RichIngestProgress(progress)

    def variant(self, qa_set: str, key: str, index: int, total: int) -> None:
        self.progress.update(self.variants, completed=index, total=total, description=f"{qa_set} {key}")
        self.progress.reset(self.questions)

    def question(self, done: int, total: int) -> None:
        self.progress.update(self.questions, completed=done, total=total)
