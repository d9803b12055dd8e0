"""`kvchat train-indexer`: IndexMem's indexer and latent memory distilled from the frozen model.

`pipeline` runs the stages; `chunks` makes the data, `teacher` says what the model attends to, `indexer_stage`
and `memory_stage` hold each stage's loss and held-out figures, `checkpoints` makes a run resumable.
"""

from kvchat.training.pipeline import TrainProgress, TrainReport, default_out, train

__all__ = ["TrainProgress", "TrainReport", "default_out", "train"]
