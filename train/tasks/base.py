"""The task interface and the pieces the tasks share.

A task hands the training loop fixed-length token batches and fixed evaluation
splits. Every array is `[B, L]` (B sequences, L positions):
`inputs[b, t]` is the token the model reads at position t, `targets[b, t]` the
token it must predict there, and `weights[b, t]` is 1 where the loss and the
metric count (answer tokens, read bits, copied tokens, every byte) and 0
elsewhere (padding, context).

Tasks pad on the right to their full length L; the trainer then cuts each batch to the length it needs
(`scored_lengths`, rounded up by `bucket_length` as run.pad_to says, `trim_batch`), so that only a few shapes
compile. Counting has sequences shorter than their split's L, and so has lm where a document is shorter than a
window; flip-flop and selective copy are cut to L itself, a no-op.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")  # where Linux mounts the control groups
OWN_CGROUPS = pathlib.Path("/proc/self/cgroup")  # this process's control group in each hierarchy

Batch = dict[str, np.ndarray]
"""{"inputs": int32 [B, L], "targets": int32 [B, L], "weights": float32 [B, L]}."""

@dataclasses.dataclass(frozen=True)
class Split:
    """A fixed evaluation set; all arrays are [N, L] (N sequences of length L)."""

    name: str  # "valid", "test", "ood_sparse", "len_x2", ...
    inputs: np.ndarray  # int32 [N, L]
    targets: np.ndarray  # int32 [N, L]
    weights: np.ndarray  # float32 [N, L]

    def __post_init__(self) -> None:
        for field, dtype in (("inputs", np.int32), ("targets", np.int32), ("weights", np.float32)):
            object.__setattr__(self, field, np.array(getattr(self, field), dtype))  # a private copy
        if self.inputs.ndim != 2 or self.inputs.shape[0] == 0:
            raise ValueError(f"split {self.name!r}: inputs.shape={self.inputs.shape} must be [N, L] with N >= 1")
        for field in ("targets", "weights"):
            shape = getattr(self, field).shape
            if shape != self.inputs.shape:
                raise ValueError(f"split {self.name!r}: {field}.shape={shape} != inputs.shape={self.inputs.shape}")
        for array in (self.inputs, self.targets, self.weights):
            array.flags.writeable = False

    @property
    def seq_len(self) -> int:
        """L, the length of this split's sequences."""
        return self.inputs.shape[1]


@runtime_checkable
class Task(Protocol):
    """What the training loop needs from a task. A task whose data is read from outside (lm's corpus, counting's
    data_dir) may also have `corpus`, a JSON dict with the "option" that names the data (e.g. "task.source"), its
    "source", the "fingerprint" of the data (content_fingerprint, "hash": CONTENT_HASH) and its "bytes", and for data
    that comes with the interpreter (lm's standard library) the "python" version: a run saves it and refuses to go on
    when the fingerprint changed (jaxpe.train.workdir.check_same_corpus). A task that saved
    fingerprints of another kind before has `names_fingerprint` too, that older kind, to check such a run by."""

    name: str
    vocab_size: int
    seq_len: int  # training length L
    metric: str  # "seq_error", "token_error" or "bits_per_byte"

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """The batch for `step`: a pure function of (task seed, step, batch_size)."""
        ...

    def eval_splits(self) -> dict[str, Split]:
        """In-distribution and OOD/longer evaluation splits, deterministic."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as text."""
        ...


@runtime_checkable
class FixedTrainSet(Protocol):
    """A task whose training batches are rows of one fixed set (counting's programs): the trainer can keep the set on
    the device and gather each batch there (jaxpe.train.feed). train_batch(step, B) must equal the rows
    train_rows(step, B) of train_set()."""

    def train_set(self) -> Batch:
        """The whole training set, each array [N, L]."""
        ...

    def train_rows(self, step: int, batch_size: int) -> np.ndarray:
        """int [B]: the rows of train_set() that form batch `step`."""
        ...


def host_memory_bytes() -> int:
    """The host memory this process may take, in bytes: the physical memory, or less where a control group limits it
    (a container's, a batch job's: cgroup_limits)."""
    return min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), *cgroup_limits())


def cgroup_limits() -> list[int]:
    """The memory limits in bytes of this process's control groups and those above them, as OWN_CGROUPS names them
    under CGROUP_ROOT: cgroup v2's memory.max, v1's memory.limit_in_bytes ("max" and absent files are no limit; none
    at all outside Linux)."""
    try:
        lines = OWN_CGROUPS.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, group = line.split(":", 2)  # "0::/path" (v2), "4:memory:/path" (v1)
        if controllers and "memory" not in controllers.split(","):
            continue
        base, name = (CGROUP_ROOT, "memory.max") if not controllers else (CGROUP_ROOT / "memory",
                                                                          "memory.limit_in_bytes")
        for directory in (group, *map(str, pathlib.PurePosixPath(group).parents)):
            try:
                text = (base / directory.lstrip("/") / name).read_text(encoding="utf-8").strip()
            except OSError:
                continue
            if text.isdigit():
                limits.append(int(text))
    return limits


def make_batch(inputs: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> Batch:
    """A Batch with the contract's dtypes (int32, int32, float32)."""
    return {"inputs": np.asarray(inputs, np.int32), "targets": np.asarray(targets, np.int32),
            "weights": np.asarray(weights, np.float32)}


PAD_TO = ("multiple", "pow2", "block")  # how long a batch is made: see bucket_length


def scored_lengths(weights: np.ndarray) -> np.ndarray:
    """int64 [B] from weights [B, L]: per row, 1 + the position of its last weighted token (0 for a row with none).

    That prefix is all the loss and the metrics read, and under causal attention the positions after it cannot
    change the ones before, so a batch cut to its longest prefix scores exactly as the whole batch. For counting it
    is the sequence's unpadded length of input/target pairs (the answer ends the sequence, padding follows it), for
    lm the length of the window's document part; flip-flop and selective copy score their last position, so theirs
    is always the full length L.
    """
    weights = np.asarray(weights)
    used = weights > 0  # [B, L]
    last = weights.shape[1] - np.argmax(used[:, ::-1], axis=1)  # [B] 1 + last weighted position
    return np.where(used.any(axis=1), last, 0).astype(np.int64)


def bucket_length(longest: int, full: int, *, pad_to: str, multiple: int) -> int:
    """The length a batch is padded to when its longest sequence (scored prefix) is `longest` and its arrays are
    `full` long: `longest` rounded up to a multiple of `multiple` ("multiple"), or to `multiple` times a power of two
    ("pow2"), or `full` ("block"); never above `full`, never below 1. Few lengths occur, so few shapes compile: at
    most full / multiple for "multiple", log2(full / multiple) + 2 for "pow2"."""
    if pad_to not in PAD_TO:
        raise ValueError(f"{pad_to=} must be one of {PAD_TO}")
    check_int("multiple", multiple, 1)
    if pad_to == "block":
        return full
    units = max(-(-int(longest) // multiple), 1)  # ceil(longest / multiple), at least 1
    if pad_to == "pow2":
        units = 1 << (units - 1).bit_length()  # the next power of two
    return min(units * multiple, full)


PLAN_SHARE = 8  # a padded length gets a program of its own where at least 1/PLAN_SHARE of the batches need it


def planned_lengths(own: Sequence[int] | np.ndarray) -> np.ndarray:
    """int [N]: the lengths that N batches, whose own padded lengths are `own` [N] (bucket_length's), run at when all
    are known ahead (a fixed training set, the evaluation splits): a length that at least 1/PLAN_SHARE of them need
    runs as it is, any other at the shortest longer one that does, the longest at its own. Each length is one
    compilation, which costs far more than the padding a rare length would save."""
    own = np.asarray(own, np.int64)
    values, counts = np.unique(own, return_counts=True)
    kept = values[(counts * PLAN_SHARE >= own.size) | (values == values.max(initial=0))]
    return kept[np.searchsorted(kept, own)]


def trim_batch(batch: Batch, length: int) -> Batch:
    """The first `length` positions of every [B, L] array of `batch`."""
    return {name: np.ascontiguousarray(array[:, :length]) for name, array in batch.items()}


CONTENT_HASH = "blake2b"  # corpus["hash"] of content_fingerprint (a corpus.json without one: names and sizes)


def name_bytes(name: str) -> bytes:
    """`name` (a document's, a file's) in UTF-8, with the bytes that a file name's surrogate escapes stand for (what
    the file system's encoding could not decode: any non-ASCII byte under an ASCII locale) as those bytes: a file's
    name gives the same bytes under a UTF-8 locale and an ASCII one."""
    return name.encode("utf-8", "surrogateescape")


def content_fingerprint(documents: Iterable[tuple[str, bytes]], salt: str = "") -> str:
    """The blake2b digest (32 bytes, 64 hex digits) of `salt` and each (name, content) of `documents` in order, every
    name and content preceded by its length: an edit that keeps a document's size changes it, and so does a rename,
    a reordering, or bytes moved from one document to the next. Names and salt are hashed as `name_bytes`."""
    digest = hashlib.blake2b(name_bytes(salt), digest_size=32)
    for name, content in documents:
        for part in (name_bytes(name), content):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def derive_seed(seed: int, *parts: object) -> int:
    """A 64-bit seed from `seed` and labels (split name, step...), stable across runs and platforms."""
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def seeded_splits(seed: int, task: str, make: Callable[[np.random.Generator, Any], tuple[np.ndarray, ...]],
                  settings: Mapping[str, Any]) -> dict[str, Split]:
    """One Split per `name: setting`, its (inputs, targets, weights) [N, L] made by `make(rng, setting)` from a
    generator seeded by (seed, task, name): each split fixed by the seed and apart from the others."""
    return {name: Split(name, *make(np.random.default_rng(derive_seed(seed, task, name)), setting))
            for name, setting in settings.items()}


def check_step(step: int, batch_size: int) -> None:
    """Shared argument check of `Task.train_batch`."""
    if not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"{step=} must be an int >= 0")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"{batch_size=} must be an int >= 1")


def epoch_indices(n: int, *, seed: int, step: int, batch_size: int) -> np.ndarray:
    """Indices into a fixed set of `n` examples for the batch of `step`.

    The examples are read as an endless stream of epochs, each a permutation
    seeded by (seed, epoch); batch `step` is items [step·B, (step+1)·B) of that
    stream. A pure function of its arguments, so a resumed run sees the same data.
    """
    check_step(step, batch_size)
    first = step * batch_size
    positions = np.arange(first, first + batch_size)
    epochs, offsets = np.divmod(positions, n)
    out = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng(derive_seed(seed, "epoch", int(epoch))).permutation(n)
        sel = epochs == epoch
        out[sel] = perm[offsets[sel]]
    return out


def pad_and_shift(sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]],
                  seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Next-token arrays [N, seq_len] from variable-length token sequences.

    Each sequence is cut to its last `seq_len + 1` tokens (trimmed from the left,
    so that the question and answer at the end survive, as the official CoPE
    collator does), right-padded with `pad_id`, then shifted:
    inputs = tokens[:-1], targets = tokens[1:], weights = loss_mask[1:] (0 on padding).
    `loss_masks[i][t]` marks the tokens of sequence i that are scored.
    """
    if seq_len < 1:
        raise ValueError(f"{seq_len=} must be >= 1")
    n = len(sequences)
    tokens = np.full((n, seq_len + 1), pad_id, np.int32)
    mask = np.zeros((n, seq_len + 1), np.float32)
    for i, (seq, m) in enumerate(zip(sequences, loss_masks, strict=True)):
        if len(seq) != len(m):
            raise ValueError(f"sequence {i}: {len(seq)=} tokens but {len(m)=} mask entries")
        seq, m = seq[-(seq_len + 1):], m[-(seq_len + 1):]
        tokens[i, :len(seq)] = seq
        mask[i, :len(m)] = m
    return tokens[:, :-1], tokens[:, 1:], mask[:, 1:]


class WordVocab:
    """A word-level vocabulary: specials first, then words in a fixed order."""

    def __init__(self, words: Iterable[str], specials: Sequence[str] = ("<pad>",)):
        self.words: list[str] = []
        self.ids: dict[str, int] = {}
        for word in (*specials, *words):
            self.add(word)
        self.num_specials = len(specials)

    def add(self, word: str) -> int:
        """The id of `word`, appending it if new."""
        if word not in self.ids:
            self.ids[word] = len(self.words)
            self.words.append(word)
        return self.ids[word]

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, words: Sequence[str]) -> list[int]:
        """Ids of `words`; an unknown word is a ValueError."""
        try:
            return [self.ids[w] for w in words]
        except KeyError as err:
            raise ValueError(f"word {err.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int], skip_specials: bool = True) -> str:
        """Space-joined words of `ids` (specials such as padding left out unless asked)."""
        for i in ids:
            if not 0 <= int(i) < len(self.words):
                raise ValueError(f"token id {int(i)} is outside the vocabulary of {len(self.words)} words")
        return " ".join(self.words[int(i)] for i in ids if not (skip_specials and int(i) < self.num_specials))


def config_from_options(config_cls: type, task_name: str, options: Mapping[str, Any]) -> Any:
    """`config_cls(**options)`, with an unknown option a ValueError naming the key."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    for key in options:
        if key not in known:
            raise ValueError(f"unknown option {key!r} for task {task_name!r}; known options: {sorted(known)}")
    return config_cls(**options)


def absolute_path(path: str | os.PathLike) -> str:
    """`path` made absolute as a task saves its data's path: a leading `~` expanded (a shell leaves it as it is in
    `task.source=~/texts`, a word that is no variable assignment), a relative path taken from the current directory."""
    return os.path.abspath(os.path.expanduser(path))


def json_object(text: str, where: str) -> dict[str, Any]:
    """The JSON object `text` holds; a ValueError starting with `where` when it is not valid JSON or not an object."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(data).__name__}")
    return data


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    """A ValueError/TypeError naming the field unless minimum <= value (<= maximum)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}={value!r} must be {bound}")


def check_ints(**checks: tuple[object, int] | tuple[object, int, int]) -> None:
    """check_int(name, value, minimum[, maximum]) for every name=(value, minimum[, maximum]), in order."""
    for name, check in checks.items():
        check_int(name, *check)


def check_probability(name: str, value: object) -> None:
    """A ValueError/TypeError naming the field unless 0 <= value < 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a float")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} must be in [0, 1)")
