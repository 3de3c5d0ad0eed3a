"""The CoPE paper's counting task (Golovneva et al. 2024, Table 3).

A sample is a tiny program over the first `nvars` letters, then a question:

    context:  "a = 0 ; pass; pass; a ++; b = 0 ; pass; a ++; ..."
    question: "print a"
    answer:   "2"

Statements are drawn with weights `x = 0 ;` 1, `pass;` 50, `x ++;` 7, as in
facebookresearch/RAM `projects/cope/scripts/count_data_gen.py`, whose logic this
module restates:
- `x = 0 ;` picks any of the `nvars` letters; `x ++;` and `print x` pick a
  letter that was already set (a draw with none set is redrawn);
- an increment past `max_value` (10) is redrawn, so values never exceed it;
- `nsteps ~ U[3, max_steps]` statements; a program that ends with no variable
  set cannot ask a question and is redrawn whole (which tilts nsteps upwards).
Note the official spacing: `pass;` and `++;` are single words.

Tokens are whitespace words, lower-cased (the official tokenizer also splits
off ".", "," and "?"). The sequence is context + question + answer; the loss
and the metric (`seq_error`) count only the answer. Sequences longer than the
block keep their last `seq_len + 1` tokens (the official collator trims from
the left); shorter ones are padded on the right with weight 0. The trainer cuts each batch to its longest
sequence rounded up to a bucket (run.pad_to, run.pad_multiple), as the official collator pads to the batch's longest.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import random
import string
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from jaxpe.train.tasks.base import (CONTENT_HASH, Batch, Split, WordVocab, absolute_path, check_ints,
                                   content_fingerprint, derive_seed, epoch_indices, host_memory_bytes, json_object,
                                   make_batch, pad_and_shift)

Sample = dict[str, str]  # {"context": ..., "question": ..., "answer": ...}

VARIABLE_NAMES = string.ascii_lowercase
OP_WEIGHTS = {"set": 1, "pass": 50, "increment": 7}  # `x = 0 ;`, `pass;`, `x ++;`
SAMPLE_KEYS = ("context", "question", "answer")
STATEMENT_BYTES = 5  # the shortest statement, "pass;"


@dataclasses.dataclass(frozen=True)
class CountingConfig:
    """Options of the counting task (`make_task("counting", **options)`)."""

    seed: int = 0  # seeds generation of every split and the training order
    nvars: int = 3  # number of variables (the paper: 1, 3, 5), letters a, b, c, ...
    max_steps: int = 512  # nsteps ~ U[3, max_steps] statements per program
    max_value: int = 10  # cap on a variable's value; an increment past it is redrawn
    n_train: int = 10_000  # training programs (the paper: 10k)
    n_valid: int = 1_000  # validation programs (the paper: 1k)
    n_test: int = 1_000  # test programs, and programs in the longer `len_x2` split
    seq_len: int = 512  # block size L (the paper: 512); longer programs are trimmed from the left
    data_dir: str | None = None  # a directory of official train/valid/test .jsonl files; None: generate

    def __post_init__(self) -> None:
        check_ints(seed=(self.seed, 0), nvars=(self.nvars, 1, len(VARIABLE_NAMES)), max_steps=(self.max_steps, 3),
                   max_value=(self.max_value, 1), n_train=(self.n_train, 1), n_valid=(self.n_valid, 1),
                   n_test=(self.n_test, 1), seq_len=(self.seq_len, 2))
        if self.data_dir is not None and not isinstance(self.data_dir, (str, os.PathLike)):
            raise TypeError(f"data_dir={self.data_dir!r} must be a path or None")
        if self.data_dir is not None and not str(self.data_dir).strip():
            raise ValueError(f"data_dir={self.data_dir!r} names no directory (an empty path would be the current one)")
        if self.data_dir is not None:  # absolute: a run reads its data from any directory
            object.__setattr__(self, "data_dir", absolute_path(self.data_dir))


def generate_samples(n: int, *, nvars: int, min_steps: int, max_steps: int, max_value: int = 10,
                     seed: int = 0) -> list[Sample]:
    """`n` counting programs in the official format, deterministic in `seed`."""
    check_ints(n=(n, 0), nvars=(nvars, 1, len(VARIABLE_NAMES)), min_steps=(min_steps, 1),
               max_steps=(max_steps, min_steps), max_value=(max_value, 1))
    rng = random.Random(seed)
    samples = []
    while len(samples) < n:
        sample = _try_sample(rng, VARIABLE_NAMES[:nvars], rng.randint(min_steps, max_steps), max_value)
        if sample is not None:
            samples.append(sample)
    return samples


def _try_sample(rng: random.Random, names: str, nsteps: int, max_value: int) -> Sample | None:
    """One program of `nsteps` statements, or None when no variable was ever set."""
    total = sum(OP_WEIGHTS.values())
    set_below, pass_below = OP_WEIGHTS["set"], OP_WEIGHTS["set"] + OP_WEIGHTS["pass"]
    values: dict[str, int] = {}
    statements = []
    for _ in range(nsteps):
        while True:  # redraw until the statement is valid, as the official generator does
            r = rng.random() * total
            if r < set_below:
                var = rng.choice(names)
                values[var] = 0
                statements.append(f"{var} = 0 ;")
                break
            if r < pass_below:
                statements.append("pass;")
                break
            if not values:
                continue
            var = rng.choice(list(values))
            if values[var] + 1 > max_value:
                continue
            values[var] += 1
            statements.append(f"{var} ++;")
            break
    if not values:
        return None
    var = rng.choice(list(values))
    return {"context": " ".join(statements), "question": f"print {var}", "answer": str(values[var])}


def tokenize(text: str) -> list[str]:
    """Lower-cased whitespace words, with ".", "," and "?" split off (the official tokenizer)."""
    text = text.strip().lower().replace(".", " .").replace(",", " ,").replace("?", " ?")
    return text.split()


def read_jsonl(path: str | os.PathLike) -> list[Sample]:
    """Samples from an official counting .jsonl file (one JSON object per line).

    A line that is not a JSON object with non-empty string `context`, `question`
    and `answer` is a ValueError naming the file and the line number. A list
    `context` is joined with spaces, as the official loader does; blank lines
    are skipped.
    """
    return _parse_jsonl(Path(path).read_bytes(), path)


def _parse_jsonl(data: bytes, path: str | os.PathLike) -> list[Sample]:
    """The samples of `data`, the bytes of the .jsonl file at `path` (read_jsonl)."""
    try:
        text = data.decode("utf-8-sig")  # a byte order mark (Windows editors write one) is no part of the text
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error})") from None
    samples = []
    for lineno, line in enumerate(io.StringIO(text, newline=None), start=1):  # lines as open() reads them
        if not line.strip():
            continue
        obj = json_object(line, f"{path}:{lineno}: the line")
        if isinstance(obj.get("context"), list):
            obj["context"] = " ".join(obj["context"])
        for key in SAMPLE_KEYS:
            if not isinstance(obj.get(key), str):
                raise ValueError(f"{path}:{lineno}: key {key!r} missing or not a string")
            if not tokenize(obj[key]):  # an empty answer would be scored on no token: 0 % error
                raise ValueError(f"{path}:{lineno}: key {key!r} is empty")
        samples.append({key: obj[key] for key in SAMPLE_KEYS})
    return samples


def write_jsonl(path: str | os.PathLike, samples: Iterable[Sample]) -> None:
    """Write samples in the official format: one `{"context", "question", "answer"}` object per line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps({key: sample[key] for key in SAMPLE_KEYS}) + "\n")


def base_vocab(max_value: int) -> WordVocab:
    """Every word the generator can write, in a fixed order (independent of nvars)."""
    words = [*VARIABLE_NAMES, "=", ";", "pass;", "++;", "print", *(str(v) for v in range(max_value + 1))]
    return WordVocab(words, specials=("<pad>",))


class CountingTask:
    """Counting: answer `print x` after a program of sets, passes and increments."""

    name = "counting"
    metric = "seq_error"

    def __init__(self, config: CountingConfig):
        self.config = config
        self.seq_len = config.seq_len
        self.fingerprint: str | None = None  # of data_dir's files (content_fingerprint); None for generated data
        self.data_bytes = 0  # the size of data_dir's .jsonl files
        self.samples = self._load_or_generate()  # split name -> samples
        self.vocab = base_vocab(config.max_value)
        for split in self.samples.values():  # words of loaded data that the generator never writes
            for sample in split:
                for key in SAMPLE_KEYS:
                    for word in tokenize(sample[key]):
                        self.vocab.add(word)
        self.vocab_size = len(self.vocab)

    def _load_or_generate(self) -> dict[str, list[Sample]]:
        cfg = self.config
        if cfg.data_dir is not None:
            samples, files = _load_dir(Path(cfg.data_dir))
            self.fingerprint, self.data_bytes = content_fingerprint(files), sum(len(data) for _, data in files)
            return samples
        sizes = {"train": (cfg.n_train, 3, cfg.max_steps), "valid": (cfg.n_valid, 3, cfg.max_steps),
                 "test": (cfg.n_test, 3, cfg.max_steps), "len_x2": (cfg.n_test, cfg.max_steps + 1, 2 * cfg.max_steps)}
        # At least STATEMENT_BYTES of text per statement, U[lo, hi] statements a program: past the host's memory the
        # generation would run for hours before failing.
        text, memory = sum(n * (lo + hi) // 2 * STATEMENT_BYTES for n, lo, hi in sizes.values()), host_memory_bytes()
        if text > memory:
            raise ValueError(f"task.n_train={cfg.n_train}, task.n_valid={cfg.n_valid}, task.n_test={cfg.n_test} "
                             f"programs of up to task.max_steps={cfg.max_steps} statements are at least "
                             f"{text / 2**30:.3g} GiB of text, more than this host's memory "
                             f"({memory / 2**30:.3g} GiB): lower them")
        return {split: generate_samples(n, nvars=cfg.nvars, min_steps=lo, max_steps=hi, max_value=cfg.max_value,
                                        seed=derive_seed(cfg.seed, "counting", split))
                for split, (n, lo, hi) in sizes.items()}

    @property
    def corpus(self) -> dict[str, object] | None:
        """What identifies the data read from data_dir: {"option", "source", "fingerprint", "hash", "bytes"}
        (tasks.base.Task); None for generated data, which the options fix."""
        if self.fingerprint is None:
            return None
        return {"option": "task.data_dir", "source": str(self.config.data_dir), "fingerprint": self.fingerprint,
                "hash": CONTENT_HASH, "bytes": self.data_bytes}

    def encode(self, samples: Sequence[Sample], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, weights), each [N, seq_len]; weights mark the answer tokens."""
        sequences, masks = [], []
        for sample in samples:
            ids, mask = [], []
            for key in SAMPLE_KEYS:
                words = self.vocab.encode(tokenize(sample[key]))
                ids += words
                mask += [key == "answer"] * len(words)
            sequences.append(ids)
            masks.append(mask)
        return pad_and_shift(sequences, masks, seq_len, pad_id=self.vocab.ids["<pad>"])

    @functools.cached_property
    def _train_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.encode(self.samples["train"], self.seq_len)

    def train_set(self) -> Batch:
        """The encoded training programs, each array [N, L] (tasks.base.FixedTrainSet)."""
        return make_batch(*self._train_arrays)

    def train_rows(self, step: int, batch_size: int) -> np.ndarray:
        """int [B]: the rows of train_set() in batch `step`, items of the epoch stream over the training set."""
        return epoch_indices(len(self.samples["train"]), seed=self.config.seed, step=step, batch_size=batch_size)

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """Batch `step` of the epoch stream over the fixed training set; each array [B, L]."""
        idx = self.train_rows(step, batch_size)
        inputs, targets, weights = self._train_arrays
        return make_batch(inputs[idx], targets[idx], weights[idx])

    @functools.cached_property
    def _eval_splits(self) -> dict[str, Split]:
        splits = {}
        for name, samples in self.samples.items():
            if name != "train":
                seq_len = self.seq_len if name in ("valid", "test") else _longer_len(self, samples)
                splits[name] = Split(name, *self.encode(samples, seq_len))
        return splits

    def eval_splits(self) -> dict[str, Split]:
        """valid and test at the block size L; the longer `len_x2` (up to 2·max_steps statements) at 2·L."""
        return dict(self._eval_splits)

    def decode(self, ids: Sequence[int]) -> str:
        """Words of `ids`, padding left out."""
        return self.vocab.decode(ids)


def _longer_len(task: CountingTask, samples: Sequence[Sample]) -> int:
    """Block size of a split other than valid/test: 2·L for the generated `len_x2`; for an
    extra file, the smallest multiple of L that holds its longest sample."""
    if task.config.data_dir is None:
        return 2 * task.seq_len
    longest = max(sum(len(tokenize(s[key])) for key in SAMPLE_KEYS) for s in samples)
    return task.seq_len * max(1, -(-(longest - 1) // task.seq_len))


def _load_dir(data_dir: Path) -> tuple[dict[str, list[Sample]], list[tuple[str, bytes]]]:
    """train.jsonl and valid.jsonl (required), plus every other <name>.jsonl as a split <name>; and the files read,
    (name, bytes) in the order read."""
    if not data_dir.is_dir():
        raise ValueError(f"data_dir={str(data_dir)!r} is not a directory")
    for required in ("train", "valid"):
        if not (data_dir / f"{required}.jsonl").is_file():
            raise ValueError(f"data_dir={str(data_dir)!r} has no {required}.jsonl")
    samples, files = {}, []
    for path in sorted(data_dir.glob("*.jsonl"), key=lambda p: (p.stem not in ("train", "valid", "test"), p.stem)):
        files.append((path.name, path.read_bytes()))
        samples[path.stem] = _parse_jsonl(files[-1][1], path)
        if not samples[path.stem]:
            raise ValueError(f"{path} holds no samples")
    return samples, files
