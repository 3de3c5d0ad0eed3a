"""Byte-level language modelling.

Tokens are bytes (vocab 256). Sources (`source` option):
- `"stdlib"` (default, no download): the running interpreter's standard-library
  `.py` files (site-packages, test directories and caches left out);
- local files or directories (a path or a tuple of paths; directories are
  walked for files ending in one of `suffixes`, `()` for every file, links to
  directories followed, hidden files and directories (".name": an editor's
  swap file, .git/) skipped);
- `"hf:<name>[:<config>]"`: a Hugging Face dataset (`pip install datasets`),
  either a directory written by `save_to_disk` or a hub name; its `text_field`
  column holds the documents (one a row).

A file (or a dataset row) is a document. The corpus is capped at `max_bytes`:
documents are taken in a fixed pseudo-random order (a hash of the name) while
they fit. `fingerprint` hashes the names and contents of the documents read (tasks.base.content_fingerprint, blake2b:
an edit that keeps a file's size changes it); `corpus` (option, source, fingerprint, bytes) is saved with a run
(jaxpe.train.workdir) so that a run is not resumed on another corpus. `names_fingerprint`, the sha256 of the document
names and sizes, is what runs saved before fingerprints hashed the content, and checks those.
Splits (`split_by`), a dataset's own validation/test splits used when it has them:
- `"document"`: each document goes wholly to train, valid or test by a hash of
  its name, so its split never depends on which other documents are present;
- `"bytes"`: the documents, in corpus order (files by name, dataset rows in
  order), are read as one run of bytes, cut
  into three contiguous ranges: the first 1 − valid_fraction − test_fraction of
  the bytes train, the next valid_fraction valid, the rest test (a document at
  a cut is shared, each piece named `name[start:end]`); one file is enough;
- `"auto"` (default): "document" for the standard library (split by file, as it
  always was) and for a corpus of at least 100 documents
  (MIN_DOCUMENTS_TO_SPLIT_BY_DOCUMENT), else "bytes".

Documents are kept apart (`documents="separate"`, default): every window
starts inside one document and holds only its bytes, the rest of a window that
runs past the document's end being padding (weight 0), so attention and every
position (CoPE's counts included) start afresh with each document and no byte
is predicted from another document. `documents="joined"` reads each split as
one run of bytes (windows cross documents, padding only at the split's end: for
corpora of very short documents, e.g. a dataset of one line a row).

Training batches are windows at random starts (seeded by (seed, step)), every
byte of a document but its last equally likely; evaluation splits are
consecutive windows, document after document, over the first eval_bytes of the
held-out data: `valid` and `test` at the training length L and `len_x2`, `len_x4` (test
data) at 2·L and 4·L. Metric: bits per byte over every byte predicted from its
own document (weights 1), padding left out (weights 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxpe.train.tasks.base import (CONTENT_HASH, Batch, Split, absolute_path, check_int, check_probability, check_step,
                                   content_fingerprint, derive_seed, make_batch, name_bytes)

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
SPLIT_BY = ("auto", "document", "bytes")
DOCUMENTS = ("separate", "joined")
MIN_DOCUMENTS_TO_SPLIT_BY_DOCUMENT = 100  # split_by="auto" cuts a corpus of fewer documents by byte ranges
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
Document = tuple[str, bytes]  # (name, content)
Documents = dict[str, list[Document]]  # split -> documents


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Options of the byte-level language-modelling task (`make_task("lm", **options)`)."""

    seed: int = 0  # seeds the training windows
    source: str | tuple[str, ...] = "stdlib"  # "stdlib", local paths, or "hf:<name>[:<config>]"
    seq_len: int = 512  # training length L in bytes
    max_bytes: int = 4_000_000  # cap on the corpus size (per split of a Hugging Face dataset)
    valid_fraction: float = 0.05  # share of the corpus held out for `valid` (of its documents or of its bytes)
    test_fraction: float = 0.05  # share held out for `test` and the longer splits
    eval_multiples: tuple[int, ...] = (2, 4)  # longer test splits `len_x{m}` at m·L
    eval_bytes: int = 65_536  # each evaluation split is eval_bytes // its length windows (at least one)
    suffixes: tuple[str, ...] = (".py", ".txt", ".md", ".rst")  # endings taken from a walked directory; [] every file
    text_field: str = "text"  # the text column of a Hugging Face dataset
    split_by: str = "auto"  # "document" (by name hash), "bytes" (byte ranges), "auto" (see the module docstring)
    documents: str = "separate"  # "separate": no window crosses a document; "joined": each split one run of bytes

    def __post_init__(self) -> None:
        for field in ("source", "eval_multiples", "suffixes"):  # lists (from JSON or a command line) as tuples
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))
        if isinstance(self.suffixes, str):  # task.suffixes=.bin,.dat on a command line
            object.__setattr__(self, "suffixes", tuple(s for s in self.suffixes.split(",") if s))
        for field, example in (("eval_multiples", "[2,4]"), ("suffixes", '[".txt",".md"]')):
            if not isinstance(getattr(self, field), tuple):
                raise TypeError(f"{field}={getattr(self, field)!r} must be a list, e.g. {field}={example}")
        if not (isinstance(self.source, (str, os.PathLike)) or
                (isinstance(self.source, tuple) and self.source and
                 all(isinstance(s, (str, os.PathLike)) for s in self.source))):
            raise TypeError(f"source={self.source!r} must be 'stdlib', 'hf:<name>', a path or a tuple of paths")
        if any(not str(path).strip() for path in (self.source if isinstance(self.source, tuple) else (self.source,))):
            raise ValueError(f"source={self.source!r} names no file (an empty path would be the current directory)")
        if self.source != "stdlib" and not _is_hf(self):  # absolute: a run reads its files from any directory
            paths = tuple(absolute_path(path) for path in (self.source if isinstance(self.source, tuple)
                                                           else (self.source,)))
            object.__setattr__(self, "source", paths if isinstance(self.source, tuple) else paths[0])
        if not all(isinstance(s, str) for s in self.suffixes):
            raise TypeError(f"suffixes={self.suffixes!r} must be file endings such as '.txt' (strings)")
        check_int("seed", self.seed, 0)
        check_int("seq_len", self.seq_len, 1)
        check_int("max_bytes", self.max_bytes, 1)
        check_probability("valid_fraction", self.valid_fraction)
        check_probability("test_fraction", self.test_fraction)
        if self.valid_fraction + self.test_fraction >= 1:
            raise ValueError(f"valid_fraction={self.valid_fraction} + test_fraction={self.test_fraction} = "
                             f"{self.valid_fraction + self.test_fraction} must be < 1")
        for index, m in enumerate(self.eval_multiples):
            check_int(f"eval_multiples[{index}]", m, 2)
        check_int("eval_bytes", self.eval_bytes, 1)
        if self.split_by not in SPLIT_BY:
            raise ValueError(f"split_by={self.split_by!r} must be one of {', '.join(SPLIT_BY)}")
        if self.documents not in DOCUMENTS:
            raise ValueError(f"documents={self.documents!r} must be one of {', '.join(DOCUMENTS)}")

    def fraction(self, split: str) -> float:
        """The share of the corpus that `split` ("train", "valid" or "test") holds."""
        return {"train": 1 - self.valid_fraction - self.test_fraction, "valid": self.valid_fraction,
                "test": self.test_fraction}[split]


def _hash_fraction(salt: str, name: str) -> float:
    """A number in [0, 1) fixed by (salt, name) (its `name_bytes`: the same under a UTF-8 locale and an ASCII one)."""
    return int.from_bytes(hashlib.sha256(name_bytes(f"{salt}/{name}")).digest()[:8], "little") / 2.0**64


def split_of(name: str, valid_fraction: float, test_fraction: float) -> str:
    """"train", "valid" or "test" for the document called `name`, by a hash of the name."""
    u = _hash_fraction("split", name)
    return "valid" if u < valid_fraction else "test" if u < valid_fraction + test_fraction else "train"


def split_corpus(documents: Sequence[Document], config: LMConfig) -> tuple[Documents, str]:
    """The documents (in corpus order) by split as config.split_by says, and the rule used ("document", "bytes")."""
    split_by = config.split_by
    if split_by == "auto":
        many = config.source == "stdlib" or len(documents) >= MIN_DOCUMENTS_TO_SPLIT_BY_DOCUMENT
        split_by = "document" if many else "bytes"
    docs: Documents = {split: [] for split in SPLITS}
    if split_by == "document":
        for name, content in documents:
            docs[split_of(name, config.valid_fraction, config.test_fraction)].append((name, content))
        return docs, split_by
    total = sum(len(content) for _, content in documents)
    cuts = np.round(np.cumsum([0.0, *(config.fraction(s) for s in SPLITS)]) * total).astype(int)  # [4]
    cuts[-1] = total
    offset = 0
    for name, content in documents:
        end = offset + len(content)
        for split, lo, hi in zip(SPLITS, cuts[:-1], cuts[1:]):
            a, b = max(int(lo), offset), min(int(hi), end)
            if a < b:
                piece = name if (a, b) == (offset, end) else f"{name}[{a - offset}:{b - offset}]"
                docs[split].append((piece, content[a - offset:b - offset]))
        offset = end
    return docs, split_by


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library's root and its `.py` files (posix paths relative to it, sorted)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, _walk(root, (".py",))


def _walk(root: Path, suffixes: Sequence[str], *, follow_links: bool = False) -> list[str]:
    """The files under `root` ending in one of `suffixes` (every file for ()), relative posix paths, sorted; hidden
    files and directories (".name") and SKIPPED_DIRS left out.
    follow_links: descend into links to directories too, but not into one that leads back to a directory on the path
    walked to it (a loop)."""
    names, above = [], {str(root): {root.resolve()}}  # directory walked -> the real directories on the path to it
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_links):
        real = {d: (Path(dirpath) / d).resolve() for d in dirnames}
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith(".")
                             and real[d] not in above[dirpath])
        above |= {os.path.join(dirpath, d): above[dirpath] | {real[d]} for d in dirnames}
        rel = Path(dirpath).relative_to(root)
        names += [(rel / f).as_posix() for f in filenames
                  if not f.startswith(".") and (not suffixes or f.endswith(tuple(suffixes)))]
    return sorted(names)


def _local_files(config: LMConfig) -> dict[str, Path]:
    """{document name: path} of the local paths in config.source (directories walked for config.suffixes)."""
    single = isinstance(config.source, (str, os.PathLike))
    paths = (config.source,) if single else config.source
    files: dict[str, Path] = {}
    for index, path in enumerate(map(Path, paths)):
        setting = f"source={str(path)!r}" if single else f"source[{index}]={str(path)!r}"  # the option and its value
        if path.is_dir():
            found = {f"{path.name}/{rel}": path / rel for rel in _walk(path, config.suffixes, follow_links=True)}
            if not found:
                raise ValueError(_no_suffix_match(setting, path, config.suffixes))
        elif path.exists():
            found = {path.name: path}  # a file (one that is no regular file is refused below)
        else:
            raise ValueError(f"{setting} does not exist")
        if clash := sorted(found.keys() & files.keys()):
            raise ValueError(f"source={config.source!r} holds two files named {clash[0]!r}; pass their common parent "
                             "instead")
        files.update(found)
    if broken := sorted(str(path) for path in files.values() if not path.exists()):
        raise ValueError(f"source={config.source!r} holds {len(broken)} link(s) to no file, e.g. {broken[0]!r}: mend "
                         "or remove them")
    if odd := sorted(str(path) for path in files.values() if not path.is_file()):  # reading a pipe waits for a writer
        raise ValueError(f"source={config.source!r} holds {len(odd)} path(s) that are no regular file (a pipe, a "
                         f"socket or a device), e.g. {odd[0]!r}: a run reads its corpus again to resume; save the text "
                         "to a file")
    seen: dict[Path, str] = {}
    for name, path in files.items():  # a file and a directory holding it: one text twice, perhaps in two splits
        if (other := seen.setdefault(path.resolve(), name)) != name:
            raise ValueError(f"source={config.source!r} names the file {str(path)!r} twice (as {other!r} and "
                             f"{name!r}); give it once")
    return files


def _no_suffix_match(setting: str, directory: Path, suffixes: Sequence[str]) -> str:
    """Why the walked directory that `setting` ("source=..." or "source[i]=...") names gave no document, and the
    setting that takes its files."""
    others = _walk(directory, (), follow_links=True)
    if not others:
        return (f"{setting} holds no files (hidden files and folders, and folders {', '.join(sorted(SKIPPED_DIRS))}, "
                "skipped)")
    endings = sorted({Path(name).suffix for name in others})
    suffix_setting = f"task.suffixes={','.join(endings)}" if all(endings) else "task.suffixes=[] (every file)"
    return (f"{setting} holds no file ending in {', '.join(suffixes)} (task.suffixes) but {len(others)} other "
            f"file(s), e.g. {others[0]!r}; set {suffix_setting} to take them")


def _file_documents(config: LMConfig) -> list[Document]:
    """The documents of a file source (stdlib or local paths) in name order, each file read up to its size when the
    corpus was chosen (so never past max_bytes in all)."""
    if config.source == "stdlib":
        root, names = stdlib_files()
        files = {name: root / name for name in names}
    else:
        files = _local_files(config)
    with _read_errors(config):
        sizes = {name: path.stat().st_size for name, path in files.items()}
    chosen, total = [], 0
    for name in sorted(files, key=lambda n: _hash_fraction("order", n)):
        if total + sizes[name] <= config.max_bytes:
            chosen.append(name)
            total += sizes[name]
    if not chosen:
        smallest = min(sizes, key=sizes.__getitem__)
        raise ValueError(f"source={config.source!r}: every file is larger than max_bytes={config.max_bytes} (the "
                         f"smallest, {smallest!r}, has {sizes[smallest]} bytes); raise task.max_bytes")
    if total == 0:
        raise ValueError(f"source={config.source!r} holds no bytes: its {len(chosen)} file(s) are empty")
    if config.source != "stdlib" and len(chosen) < len(files):  # the standard library is a sample by design
        _warn_left_out(config, f"{sum(sizes.values())} bytes in {len(files)} files", total,
                       f"{len(chosen)} whole files")
    with _read_errors(config):
        return [(name, _read(files[name], sizes[name])) for name in sorted(chosen)]


@contextlib.contextmanager
def _read_errors(config: LMConfig) -> Iterator[None]:
    """An OSError of the block (a file that may not be read, or that went away) as a ValueError naming the source
    and the file."""
    try:
        yield
    except OSError as error:
        where = f" for {error.filename!r}" if error.filename else ""  # a failed read() names no file
        raise ValueError(f"source={config.source!r}: {error.strerror or error}{where}; a run reads its corpus again "
                         "to resume, so each of its files must stay readable") from error


def _warn_left_out(config: LMConfig, held: str, taken_bytes: int, taken: str) -> None:
    """Warns that config.source holds more than task.max_bytes takes: `held` says what it holds ("1500 bytes in 3
    files", "20 rows in its train split"), `taken` which of its documents the corpus takes, `taken_bytes` in all."""
    log.warning("task lm: task.source=%r holds %s, more than task.max_bytes=%d: the corpus takes %d bytes, %s; raise "
                "task.max_bytes to take them all", config.source, held, config.max_bytes, taken_bytes, taken)


def _read(path: Path, size: int) -> bytes:
    """The first `size` bytes of the file at `path`."""
    with open(path, "rb") as file:
        return file.read(size)


def _hf_documents(config: LMConfig) -> Documents | list[Document]:
    """A Hugging Face dataset's documents by split when it has its own validation and test splits, else all of
    them in row order."""
    name, _, subset = config.source.removeprefix("hf:").partition(":")
    if not name:
        raise ValueError(f"source={config.source!r} must be 'hf:<name>' or 'hf:<name>:<config>'")
    try:
        import datasets  # an optional extra (jaxpe[hf]), needed only for hf: sources
    except ImportError:
        raise ImportError(f"source={config.source!r} needs the Hugging Face `datasets` package: "
                          "pip install 'jaxpe[hf]' (or pip install datasets)") from None
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
            raise ValueError(f"text_field={config.text_field!r} is not a column of source={config.source!r} "
                             f"(columns: {dataset.column_names})")
        total, row = 0, 0
        for batch in dataset.iter(batch_size=1024):
            for text in batch[config.text_field]:
                if not isinstance(text, str):
                    raise ValueError(f"source={config.source!r} ({part} split), row {row}: "
                                     f"text_field={config.text_field!r} holds {type(text).__name__}, not a string")
                content = text.encode("utf-8")
                if total + len(content) > config.max_bytes:
                    break
                total += len(content)
                docs[renamed[part] if own_splits else "train"].append((f"{part}/{row}", content))
                row += 1
            else:
                continue
            _warn_left_out(config, f"{len(dataset)} rows in its {part} split", total, f"its first {row} rows")
            break
    return docs if own_splits else docs["train"]


def fingerprints(config: LMConfig, loaded: Documents | list[Document]) -> tuple[str, str]:
    """(content fingerprint, names fingerprint) of the documents a source gave: `loaded` as _file_documents or
    _hf_documents return it. The first is tasks.base.content_fingerprint over the documents in order (a dataset's
    salted with its source); the second the sha256 of their names and sizes, what runs saved before."""
    ordered = sorted(loaded) if isinstance(loaded, list) else [doc for split in SPLITS for doc in sorted(loaded[split])]
    salt = f"{config.source}\n" if _is_hf(config) else ""
    listing = "".join(f"{name}\t{len(content)}\n" for name, content in ordered)
    return content_fingerprint(ordered, salt=salt), hashlib.sha256(name_bytes(f"{salt}{listing}")).hexdigest()


def _is_hf(config: LMConfig) -> bool:
    """Whether config.source names a Hugging Face dataset ("hf:...")."""
    return isinstance(config.source, str) and config.source.startswith("hf:")


def cut_windows(stream: np.ndarray, starts: np.ndarray, ends: np.ndarray, length: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, weights) [N, length] of the windows of `length` + 1 bytes at `starts` [N], each inside its
    document, which ends at `ends` [N]: bytes past the end are padding (0), weight 1 where the target is a byte of
    the document."""
    positions = starts[:, None] + np.arange(length + 1)  # [N, length + 1]
    inside = positions < ends[:, None]  # [N, length + 1]
    tokens = np.where(inside, stream[np.minimum(positions, stream.size - 1)], 0)
    return tokens[:, :-1], tokens[:, 1:], inside[:, 1:].astype(np.float32)


class LMTask:
    """Byte-level language modelling with evaluation at L, 2·L and 4·L.

    streams[split]: uint8 [S], the split's documents end to end; bounds[split]: int64 [D + 1], where each of its D
    documents starts, and the end (documents="joined": one document, [0, S]).
    """

    name = "lm"
    metric = "bits_per_byte"
    vocab_size = 256

    def __init__(self, config: LMConfig):
        self.config = config
        self.seq_len = config.seq_len
        loaded = _hf_documents(config) if _is_hf(config) else _file_documents(config)
        self.fingerprint, self.names_fingerprint = fingerprints(config, loaded)
        if isinstance(loaded, dict):
            docs, self.split_by = loaded, "own"
        else:
            docs, self.split_by = split_corpus(loaded, config)
        self.split_documents = {split: tuple(name for name, _ in docs[split]) for split in SPLITS}
        self.streams = {split: np.frombuffer(b"".join(c for _, c in docs[split]), np.uint8) for split in SPLITS}
        self.bounds = {}
        for split in SPLITS:
            sizes = [len(c) for _, c in docs[split]] if config.documents == "separate" else [self.streams[split].size]
            self.bounds[split] = np.cumsum([0, *sizes], dtype=np.int64)
            if not (np.diff(self.bounds[split]) >= 2).any():  # no byte to predict from one before it
                raise ValueError(self._too_short(split, len(docs[split])))
        if config.eval_multiples and np.diff(self.bounds["test"]).max() <= self.seq_len + 1:  # no target past L
            longer = ", ".join(f"len_x{m}" for m in config.eval_multiples)
            log.warning("task lm: no test document is longer than task.seq_len=%d bytes: %s scores the bytes and "
                        "positions that test scores, nothing past %d; give longer documents, or "
                        "task.documents=joined", self.seq_len, longer, self.seq_len)

    @property
    def corpus(self) -> dict[str, object]:
        """What identifies the corpus: {"option", "source", "fingerprint", "hash", "bytes"} (JSON values; bytes over
        every split; tasks.base.Task), and for the standard library "python", the version whose library it is."""
        source = self.config.source
        return {"option": "task.source",
                "source": str(source) if isinstance(source, (str, os.PathLike)) else [str(s) for s in source],
                "fingerprint": self.fingerprint, "hash": CONTENT_HASH,
                "bytes": sum(int(s.size) for s in self.streams.values()),
                **({"python": platform.python_version()} if source == "stdlib" else {})}

    def _too_short(self, split: str, count: int) -> str:
        """Why `split` holds nothing to predict, and the settings that fix it."""
        c = self.config
        what = (f"the {split} split of source={c.source!r} has {self.streams[split].size} bytes in {count} "
                "document(s): no byte to predict (that takes a document of 2 bytes or more)")
        fraction = ("lower task.valid_fraction, task.test_fraction" if split == "train"
                    else f"raise task.{split}_fraction")
        if self.split_by == "document":
            return (f"{what}; split_by=document sends each document wholly to one split, by a hash of its name; set "
                    f"task.split_by=bytes to cut the corpus into byte ranges, or {fraction}")
        if self.split_by == "own":
            return f"{what} (the dataset's own {split} split); raise task.max_bytes"
        total = sum(s.size for s in self.streams.values())
        return (f"{what} (its {c.fraction(split):g} of the corpus' {total} bytes); {fraction}, or give a larger "
                "corpus (task.source, task.max_bytes)")

    @functools.cached_property
    def _train_starts(self) -> tuple[np.ndarray, np.ndarray]:
        """(first start, number of starts) [D] per training document: every byte but its last (a window starting
        there has a byte to predict; past the document's end it is padding), none for a document under 2 bytes."""
        bounds = self.bounds["train"]
        sizes = np.diff(bounds)  # [D]
        return bounds[:-1], np.maximum(sizes - 1, 0)

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """Windows at random starts inside the training documents, every start with a byte to predict equally
        likely (so every byte is scored equally often, but for a document's first L), seeded by (seed, step);
        each [B, L]. A window that runs past its document's end is padded there (weight 0)."""
        check_step(step, batch_size)
        firsts, counts = self._train_starts
        ends = np.cumsum(counts)  # [D]
        rng = np.random.default_rng(derive_seed(self.config.seed, "lm", "train", step))
        draws = rng.integers(0, ends[-1], size=batch_size)  # [B]
        doc = np.searchsorted(ends, draws, side="right")  # [B]
        starts = firsts[doc] + draws - (ends[doc] - counts[doc])
        return make_batch(*cut_windows(self.streams["train"], starts, self.bounds["train"][doc + 1], self.seq_len))

    def _windows(self, name: str, split: str, length: int) -> Split:
        """The first eval_bytes // length (at least one) consecutive windows of `length` + 1 bytes (stride
        `length`), document after document, of `split`; a document's last window may be partly padding."""
        bounds = self.bounds[split]
        sizes = np.diff(bounds)  # [D]
        per_doc = np.where(sizes >= 2, -(-(sizes - 1) // length), 0)  # [D] windows that hold a target
        doc = np.repeat(np.arange(sizes.size), per_doc)  # [W]
        index = np.arange(doc.size) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)  # [W] window within doc
        n = max(self.config.eval_bytes // length, 1)
        starts, ends = bounds[doc[:n]] + index[:n] * length, bounds[doc[:n] + 1]
        return Split(name, *cut_windows(self.streams[split], starts, ends, length))

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
