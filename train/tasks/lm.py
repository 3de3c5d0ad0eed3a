"""Byte-level language modelling.

Tokens are bytes (vocab 256); documents are concatenated as they are, with no
separator. Sources (`source` option):
- `"stdlib"` (default, no download): the running interpreter's standard-library
  `.py` files (site-packages, test directories and caches left out);
- local text files or directories (a path or a tuple of paths; directories are
  walked for files ending in one of `suffixes`);
- `"hf:<name>[:<config>]"`: a Hugging Face dataset (`pip install datasets`),
  either a directory written by `save_to_disk` or a hub name; its `text_field`
  column holds the documents.

Documents are split into train/valid/test by a hash of their name (the file's
relative path), so the split of a file never depends on which other files are
present; a dataset's own validation/test splits are used when it has them.
The corpus is capped at `max_bytes`: documents are taken in a fixed
pseudo-random order (another hash of the name) while they fit. `fingerprint`
is the sha256 of the sorted document names and sizes.

Training batches are windows at random offsets of the training stream
(seeded by (seed, step)); evaluation splits are consecutive windows of the
held-out streams: `valid` and `test` at the training length L and `len_x2`,
`len_x4` (test data) at 2·L and 4·L. Metric: bits per byte over every byte.
Windows are fixed-length and every byte is scored: no padding, so run.pad_to changes nothing here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxpe.train.tasks.base import (Batch, Split, check_int, check_probability, check_step, derive_seed,
                              make_batch)

SPLITS = ("train", "valid", "test")
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
Documents = dict[str, list[tuple[str, bytes]]]  # split -> [(document name, content)]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Options of the byte-level language-modelling task (`make_task("lm", **options)`)."""

    seed: int = 0  # seeds the training windows
    source: str | tuple[str, ...] = "stdlib"  # "stdlib", local paths, or "hf:<name>[:<config>]"
    seq_len: int = 512  # training length L in bytes
    max_bytes: int = 4_000_000  # cap on the corpus size (per split of a Hugging Face dataset)
    valid_fraction: float = 0.05  # share of documents (by name hash) held out for `valid`
    test_fraction: float = 0.05  # share of documents held out for `test` and the longer splits
    eval_multiples: tuple[int, ...] = (2, 4)  # longer test splits `len_x{m}` at m·L
    eval_bytes: int = 65_536  # bytes scored in each evaluation split (fewer if the held-out data is shorter)
    suffixes: tuple[str, ...] = (".py", ".txt", ".md", ".rst")  # file endings taken from a walked directory
    text_field: str = "text"  # the text column of a Hugging Face dataset

    def __post_init__(self) -> None:
        for field in ("source", "eval_multiples", "suffixes"):  # lists (from JSON or a command line) as tuples
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))
        if not (isinstance(self.source, (str, os.PathLike)) or
                (isinstance(self.source, tuple) and self.source and
                 all(isinstance(s, (str, os.PathLike)) for s in self.source))):
            raise TypeError(f"source={self.source!r} must be 'stdlib', 'hf:<name>', a path or a tuple of paths")
        check_int("seed", self.seed, 0)
        check_int("seq_len", self.seq_len, 1)
        check_int("max_bytes", self.max_bytes, 1)
        check_probability("valid_fraction", self.valid_fraction)
        check_probability("test_fraction", self.test_fraction)
        if self.valid_fraction + self.test_fraction >= 1:
            raise ValueError(f"valid_fraction + test_fraction = {self.valid_fraction + self.test_fraction} "
                             "must be < 1")
        for m in self.eval_multiples:
            check_int("eval_multiples entry", m, 2)
        check_int("eval_bytes", self.eval_bytes, 1)


def _hash_fraction(salt: str, name: str) -> float:
    """A number in [0, 1) fixed by (salt, name)."""
    return int.from_bytes(hashlib.sha256(f"{salt}/{name}".encode()).digest()[:8], "little") / 2.0**64


def split_of(name: str, valid_fraction: float, test_fraction: float) -> str:
    """"train", "valid" or "test" for the document called `name`, by a hash of the name."""
    u = _hash_fraction("split", name)
    return "valid" if u < valid_fraction else "test" if u < valid_fraction + test_fraction else "train"


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library's root and its `.py` files (posix paths relative to it, sorted)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, _walk(root, (".py",))


def _walk(root: Path, suffixes: Sequence[str]) -> list[str]:
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        names += [(rel / f).as_posix() for f in filenames if f.endswith(tuple(suffixes))]
    return sorted(names)


def _file_documents(config: LMConfig) -> tuple[Documents, str]:
    """Documents of files (stdlib or local paths) by split, and the fingerprint."""
    if config.source == "stdlib":
        root, names = stdlib_files()
        files = {name: root / name for name in names}
    else:
        paths = (config.source,) if isinstance(config.source, (str, os.PathLike)) else config.source
        files = {}
        for path in map(Path, paths):
            if path.is_dir():
                found = {f"{path.name}/{rel}": path / rel for rel in _walk(path, config.suffixes)}
            elif path.is_file():
                found = {path.name: path}
            else:
                raise ValueError(f"source path {str(path)!r} does not exist")
            if clash := sorted(found.keys() & files.keys()):
                raise ValueError(f"two source files have the same name {clash[0]!r}; pass their common parent instead")
            files.update(found)
    sizes = {name: path.stat().st_size for name, path in files.items()}
    chosen, total = [], 0
    for name in sorted(files, key=lambda n: _hash_fraction("order", n)):
        if total + sizes[name] <= config.max_bytes:
            chosen.append(name)
            total += sizes[name]
    if not chosen:
        raise ValueError(f"source={config.source!r} holds no file of at most max_bytes={config.max_bytes} bytes")
    chosen.sort()
    docs: Documents = {split: [] for split in SPLITS}
    for name in chosen:
        docs[split_of(name, config.valid_fraction, config.test_fraction)].append((name, files[name].read_bytes()))
    listing = "".join(f"{name}\t{sizes[name]}\n" for name in chosen)
    return docs, hashlib.sha256(listing.encode()).hexdigest()


def _hf_documents(config: LMConfig) -> tuple[Documents, str]:
    """Documents of a Hugging Face dataset by split, and the fingerprint."""
    try:
        import datasets  # an optional extra (jaxpe[hf]), needed only for hf: sources
    except ImportError:
        raise ImportError(f"source={config.source!r} needs the Hugging Face `datasets` package: "
                          "pip install 'jaxpe[hf]' (or pip install datasets)") from None
    name, _, subset = config.source.removeprefix("hf:").partition(":")
    if not name:
        raise ValueError(f"source={config.source!r} must be 'hf:<name>' or 'hf:<name>:<config>'")
    if Path(name).is_dir():
        loaded = datasets.load_from_disk(name)
    else:
        loaded = datasets.load_dataset(name, subset or None)
    parts = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    renamed = {"train": "train", "validation": "valid", "valid": "valid", "test": "test"}
    docs: Documents = {split: [] for split in SPLITS}
    own_splits = {renamed[k] for k in parts if k in renamed} >= {"valid", "test"}
    for part, dataset in parts.items():
        if part not in renamed:
            continue
        if config.text_field not in dataset.column_names:
            raise ValueError(f"text_field={config.text_field!r} is not a column of {config.source!r} "
                             f"(columns: {dataset.column_names})")
        total, row = 0, 0
        for batch in dataset.iter(batch_size=1024):
            for text in batch[config.text_field]:
                if not isinstance(text, str):
                    raise ValueError(f"{config.source} ({part} split), row {row}: text_field={config.text_field!r} "
                                     f"holds {type(text).__name__}, not a string")
                content = text.encode("utf-8")
                if total + len(content) > config.max_bytes:
                    break
                total += len(content)
                doc = f"{part}/{row}"
                split = renamed[part] if own_splits else split_of(doc, config.valid_fraction, config.test_fraction)
                docs[split].append((doc, content))
                row += 1
            else:
                continue
            break
    listing = "".join(f"{doc}\t{len(content)}\n" for split in SPLITS for doc, content in sorted(docs[split]))
    return docs, hashlib.sha256(f"{config.source}\n{listing}".encode()).hexdigest()


class LMTask:
    """Byte-level language modelling with evaluation at L, 2·L and 4·L."""

    name = "lm"
    metric = "bits_per_byte"
    vocab_size = 256

    def __init__(self, config: LMConfig):
        self.config = config
        self.seq_len = config.seq_len
        is_hf = isinstance(config.source, str) and config.source.startswith("hf:")
        docs, self.fingerprint = _hf_documents(config) if is_hf else _file_documents(config)
        self.split_documents = {split: tuple(name for name, _ in docs[split]) for split in SPLITS}
        self.streams = {split: np.frombuffer(b"".join(c for _, c in docs[split]), np.uint8) for split in SPLITS}
        for split in SPLITS:  # every split must hold at least one window at L
            if self.streams[split].size < self.seq_len + 1:
                raise ValueError(f"the {split} split of source={config.source!r} has {self.streams[split].size} "
                                 f"bytes, fewer than seq_len + 1 = {self.seq_len + 1}; raise max_bytes or the "
                                 "split's fraction, or lower seq_len")

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """Windows at random offsets of the training bytes, seeded by (seed, step); each [B, L]."""
        check_step(step, batch_size)
        stream = self.streams["train"]
        rng = np.random.default_rng(derive_seed(self.config.seed, "lm", "train", step))
        starts = rng.integers(0, stream.size - self.seq_len, size=batch_size)  # [B]
        window = stream[starts[:, None] + np.arange(self.seq_len + 1)]  # [B, L + 1]
        return make_batch(window[:, :-1], window[:, 1:], np.ones((batch_size, self.seq_len), np.float32))

    def _windows(self, name: str, split: str, length: int) -> Split:
        """Consecutive windows of `length` + 1 bytes (stride `length`) over the first eval_bytes of `split`."""
        stream = self.streams[split]
        n = min(self.config.eval_bytes, stream.size - 1) // length
        if n < 1:
            raise ValueError(f"the {split} split ({stream.size} bytes) is too short for one window of "
                             f"{length} bytes (split {name!r}); raise max_bytes or test_fraction")
        window = stream[np.arange(n)[:, None] * length + np.arange(length + 1)]  # [n, length + 1]
        return Split(name, window[:, :-1], window[:, 1:], np.ones((n, length), np.float32))

    @functools.cached_property
    def _eval_splits(self) -> dict[str, Split]:
        splits = {"valid": self._windows("valid", "valid", self.seq_len),
                  "test": self._windows("test", "test", self.seq_len)}
        for m in self.config.eval_multiples:
            splits[f"len_x{m}"] = self._windows(f"len_x{m}", "test", m * self.seq_len)
        return splits

    def eval_splits(self) -> dict[str, Split]:
        """`valid`, `test` at L and `len_x{m}` (test bytes) at m·L for m in eval_multiples."""
        return dict(self._eval_splits)

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes as UTF-8 text (invalid sequences replaced)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
