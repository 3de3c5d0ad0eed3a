"""Selective copying (Gu & Dao 2023, the Mamba paper).

`n_tokens` symbols are scattered at random positions among `n_blanks` blanks;
after a separator the model writes the symbols in order:

    s3 _ _ s0 _ s3 _ _ | s3 s0 s3        (n_tokens = 3, n_blanks = 5)

A sequence has T = 2·n_tokens + n_blanks + 1 tokens, so inputs and targets
(the sequence shifted by one) have L = 2·n_tokens + n_blanks. Loss and metric
(`token_error`) count only the copied symbols. Evaluation: `valid` with the
training blank count, `ood_dense` with fewer blanks, `ood_sparse` with more
(so its sequences are longer than the training ones). All sequences of a split have one length and are scored
to their end: no padding, so run.pad_to changes nothing here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxpe.train.tasks.base import (Batch, Split, WordVocab, check_ints, check_step, derive_seed, make_batch,
                                   seeded_splits)

BLANK, SEP = "_", "|"


@dataclasses.dataclass(frozen=True)
class SelectiveCopyConfig:
    """Options of the selective copy task (`make_task("selective_copy", **options)`)."""

    seed: int = 0  # seeds training batches and evaluation splits
    n_tokens: int = 128  # symbols to copy per sequence
    n_symbols: int = 16  # size of the symbol alphabet the copied tokens are drawn from
    n_blanks: int = 128  # blanks among the symbols in training and in `valid`
    n_blanks_dense: int = 64  # blanks in the `ood_dense` split
    n_blanks_sparse: int = 256  # blanks in the `ood_sparse` split
    n_eval: int = 1_000  # sequences in each evaluation split

    def __post_init__(self) -> None:
        check_ints(seed=(self.seed, 0), n_tokens=(self.n_tokens, 1), n_symbols=(self.n_symbols, 2),
                   n_blanks=(self.n_blanks, 0), n_blanks_dense=(self.n_blanks_dense, 0),
                   n_blanks_sparse=(self.n_blanks_sparse, 0), n_eval=(self.n_eval, 1))


def make_vocab(n_symbols: int) -> WordVocab:
    """Blank, separator, then symbols s0 .. s{n_symbols-1}."""
    return WordVocab([BLANK, SEP, *(f"s{k}" for k in range(n_symbols))], specials=())


def generate(rng: np.random.Generator, n: int, *, n_tokens: int, n_blanks: int,
             n_symbols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n` sequences as (inputs, targets, weights), each [n, 2·n_tokens + n_blanks]."""
    body = n_tokens + n_blanks
    symbols = 2 + rng.integers(0, n_symbols, size=(n, n_tokens))  # [n, n_tokens] ids after blank and sep
    where = np.sort(rng.random((n, body)).argsort(axis=1)[:, :n_tokens], axis=1)  # [n, n_tokens] positions
    tokens = np.zeros((n, 2 * n_tokens + n_blanks + 1), np.int32)  # blank everywhere
    np.put_along_axis(tokens, where, symbols, axis=1)
    tokens[:, body] = 1  # separator
    tokens[:, body + 1:] = symbols
    weights = np.zeros((n, tokens.shape[1] - 1), np.float32)
    weights[:, body:] = 1.0  # targets[:, body:] are the copies
    return tokens[:, :-1], tokens[:, 1:], weights


class SelectiveCopyTask:
    """Selective copy: after `|`, write the non-blank symbols in order."""

    name = "selective_copy"
    metric = "token_error"

    def __init__(self, config: SelectiveCopyConfig):
        self.config = config
        self.vocab = make_vocab(config.n_symbols)
        self.vocab_size = len(self.vocab)
        self.seq_len = 2 * config.n_tokens + config.n_blanks

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """Fresh sequences with `n_blanks` blanks, from a generator seeded by (seed, step); each [B, L]."""
        check_step(step, batch_size)
        cfg = self.config
        rng = np.random.default_rng(derive_seed(cfg.seed, "selective_copy", "train", step))
        return make_batch(*generate(rng, batch_size, n_tokens=cfg.n_tokens, n_blanks=cfg.n_blanks,
                                    n_symbols=cfg.n_symbols))

    @functools.cached_property
    def _eval_splits(self) -> dict[str, Split]:
        cfg = self.config

        def make(rng: np.random.Generator, n_blanks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return generate(rng, cfg.n_eval, n_tokens=cfg.n_tokens, n_blanks=n_blanks, n_symbols=cfg.n_symbols)

        return seeded_splits(cfg.seed, "selective_copy", make, {"valid": cfg.n_blanks, "ood_dense": cfg.n_blanks_dense,
                                                                 "ood_sparse": cfg.n_blanks_sparse})

    def eval_splits(self) -> dict[str, Split]:
        """`valid`, `ood_dense` and `ood_sparse`, each [n_eval, 2·n_tokens + blanks of that split]."""
        return dict(self._eval_splits)

    def decode(self, ids: Sequence[int]) -> str:
        """Symbols, `_` for a blank and `|` for the separator."""
        return self.vocab.decode(ids)
