"""An ingest announces its work up front (blocks, episodes, tokens), so progress can give an overall ETA."""

from __future__ import annotations

import pytest

from kvchat.cli.progress import BlockTally
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.eval.qa import planted_sets
from kvchat.ingest.pipeline import IngestProgress, ingest
from kvchat.store import Store

QA = planted_sets(1, topics=3, turns_per_topic=16)[0]


class Recorder(IngestProgress):
    def __init__(self) -> None:
        self.planned_blocks, self.blocks, self.tally = None, 0, BlockTally()

    def planned(self, blocks: int, episodes: int, tokens: int) -> None:
        self.planned_blocks, self.episodes, self.tokens = blocks, episodes, tokens
        self.tally = BlockTally(blocks)

    def history(self, done: int, total: int) -> None:
        self.tally.step(done)

    def episode(self, index: int, total: int) -> None:
        self.tally.new_pass()

    def block(self, done: int, total: int) -> None:
        self.tally.step(done)


@pytest.mark.parametrize("method, prefill", [("epicache", "block"), ("routed", "block"), ("epicache", "full")])
def test_the_planned_blocks_are_the_blocks_run(method, prefill, tiny_lm, encoder, tmp_path):
    config = IngestConfig(cache=CacheConfig(method=method, budget=64, block_size=32, prefill=prefill),
                          episodes=EpisodeConfig(episodes=3, patched_prompt_tokens=48))  # fmt: skip
    seen = Recorder()
    report = ingest(QA.turns, name="c", config=config, store=Store(tmp_path), lm=tiny_lm, encoder=encoder,
                    progress=seen)  # fmt: skip
    assert seen.planned_blocks and seen.tally.done == seen.planned_blocks == seen.tally.total
    assert seen.episodes == report.episodes == 3 and seen.tokens == report.history_tokens


def test_the_tally_counts_each_pass_once_and_estimates_what_is_left():
    tally = BlockTally(6)
    assert tally.eta(0.0) == ""
    for done in (1, 2, 2, 3):  # a repeated count adds nothing
        tally.step(done)
    tally.new_pass()
    tally.step(1)
    assert tally.done == 4 and "ETA" in tally.eta(0.0)
