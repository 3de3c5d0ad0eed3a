"""Flip-flop language modelling (Liu et al. 2023, "Exposing Attention Glitches").

A sequence is `seq_len` tokens: `seq_len / 2` instruction/bit pairs over
{w, r, i} × {0, 1}, e.g. `w 1 i 0 r 1 w 0 i 1 r 0`. The first instruction is
`w`, the last is `r` (so every sequence has a read); the others are drawn with
p(i) = p_ignore and p(w) = p(r) = (1 − p_ignore)/2. Bits after `w` and `i` are
fair coins; the bit after `r` is the last written bit. A `<bos>` token starts the
sequence, so inputs and targets are exactly the `seq_len` flip-flop tokens
shifted by one; loss and metric (`token_error`) count only the bits after `r`.

Training uses p_ignore = 0.8; evaluation has in-distribution (`valid`), sparse
(`ood_sparse`, p(i) = 0.98) and dense (`ood_dense`, p(i) = 0.1) splits.
Every sequence is exactly `seq_len` long and scored at its end: no padding, so run.pad_to changes nothing here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxpe.train.tasks.base import (Batch, Split, WordVocab, check_int, check_probability, check_step, derive_seed,
                                   make_batch, seeded_splits)

VOCAB = WordVocab(["w", "r", "i", "0", "1"], specials=("<bos>",))
W, R, I, ZERO = (VOCAB.ids[t] for t in ("w", "r", "i", "0"))


@dataclasses.dataclass(frozen=True)
class FlipFlopConfig:
    """Options of the flip-flop task (`make_task("flipflop", **options)`)."""

    seed: int = 0  # seeds training batches and evaluation splits
    seq_len: int = 512  # flip-flop tokens per sequence (instruction/bit pairs, so even)
    p_ignore_train: float = 0.8  # p(i) in training and in the `valid` split
    p_ignore_sparse: float = 0.98  # p(i) of the `ood_sparse` split (few writes and reads)
    p_ignore_dense: float = 0.1  # p(i) of the `ood_dense` split (many writes and reads)
    n_eval: int = 1_000  # sequences in each evaluation split

    def __post_init__(self) -> None:
        check_int("seed", self.seed, 0)
        check_int("seq_len", self.seq_len, 4)
        if self.seq_len % 2:
            raise ValueError(f"seq_len={self.seq_len} must be even (instruction/bit pairs)")
        for name in ("p_ignore_train", "p_ignore_sparse", "p_ignore_dense"):
            check_probability(name, getattr(self, name))
        check_int("n_eval", self.n_eval, 1)


def generate(rng: np.random.Generator, n: int, seq_len: int, p_ignore: float) -> np.ndarray:
    """`n` flip-flop sequences, int32 [n, seq_len + 1] token ids starting with `<bos>`."""
    pairs = seq_len // 2
    p_rw = (1.0 - p_ignore) / 2
    instr = rng.choice(np.array([W, R, I]), size=(n, pairs), p=[p_rw, p_rw, p_ignore])  # [n, pairs]
    instr[:, 0], instr[:, -1] = W, R
    bits = rng.integers(0, 2, size=(n, pairs))  # [n, pairs]
    # index of the latest write at or before each pair; pair 0 is always a write
    last_write = np.maximum.accumulate(np.where(instr == W, np.arange(pairs), 0), axis=1)
    bits = np.where(instr == R, np.take_along_axis(bits, last_write, axis=1), bits)
    tokens = np.empty((n, seq_len + 1), np.int32)
    tokens[:, 0] = VOCAB.ids["<bos>"]
    tokens[:, 1::2] = instr
    tokens[:, 2::2] = ZERO + bits
    return tokens


def to_arrays(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, weights), each [N, seq_len]: weight 1 on the bit that follows an `r`."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return inputs, targets, (inputs == R).astype(np.float32)


class FlipFlopTask:
    """Flip-flop: after `r`, repeat the bit of the last `w`."""

    name = "flipflop"
    metric = "token_error"
    vocab_size = len(VOCAB)

    def __init__(self, config: FlipFlopConfig):
        self.config = config
        self.seq_len = config.seq_len

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """Fresh sequences with p(i) = p_ignore_train, drawn from a generator seeded by (seed, step)."""
        check_step(step, batch_size)
        rng = np.random.default_rng(derive_seed(self.config.seed, "flipflop", "train", step))
        return make_batch(*to_arrays(generate(rng, batch_size, self.seq_len, self.config.p_ignore_train)))

    @functools.cached_property
    def _eval_splits(self) -> dict[str, Split]:
        cfg = self.config

        def make(rng: np.random.Generator, p_ignore: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return to_arrays(generate(rng, cfg.n_eval, self.seq_len, p_ignore))

        return seeded_splits(cfg.seed, "flipflop", make, {"valid": cfg.p_ignore_train,
                                                          "ood_sparse": cfg.p_ignore_sparse,
                                                          "ood_dense": cfg.p_ignore_dense})

    def eval_splits(self) -> dict[str, Split]:
        """`valid` (p(i) = p_ignore_train), `ood_sparse` and `ood_dense`, each [n_eval, seq_len]."""
        return dict(self._eval_splits)

    def decode(self, ids: Sequence[int]) -> str:
        """Instruction and bit tokens, `<bos>` left out."""
        return VOCAB.decode(ids)
