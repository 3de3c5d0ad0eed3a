"""The lm task on a user's own corpus: one file or a handful split by byte ranges, documents kept apart in every
window, errors that name their cause and the setting that fixes it, and runs that do not go on on a changed corpus."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import re
import shutil
import struct
import sys
import types
from collections.abc import Iterator

import numpy as np
import pytest

from jaxpe.train import cli
from jaxpe.train.config import build_config, build_task
from jaxpe.train.experiments import compare_encodings, evaluate_checkpoint, restore_run, train_and_evaluate
from jaxpe.train.tasks import lm, make_task
from jaxpe.train.tasks.counting import write_jsonl
from jaxpe.train.workdir import check_same_corpus, write_corpus

SMALL = dict(seq_len=16, eval_bytes=64, valid_fraction=0.1, test_fraction=0.1)


def document(letter: str, size: int) -> bytes:
    """`size` bytes of one letter: a window's bytes say which document they came from."""
    return letter.encode() * size


class FakeDataset:
    """What the lm task reads of a `datasets.Dataset`: its column names, its number of rows, its rows in batches."""

    def __init__(self, rows: list[dict[str, object]]):
        self.rows, self.column_names = rows, list(rows[0])

    def __len__(self) -> int:
        return len(self.rows)

    def iter(self, batch_size: int) -> Iterator[dict[str, list[object]]]:
        for start in range(0, len(self.rows), batch_size):
            yield {column: [row[column] for row in self.rows[start:start + batch_size]] for column in self.column_names}


class FakeDatasetDict(dict):
    """A `datasets.DatasetDict`: FakeDatasets by split name."""


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeDatasetDict]:
    """The hub, not reachable from tests: a `datasets` module whose load_dataset(name, config) gives hub[name]."""
    hub: dict[str, FakeDatasetDict] = {}
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(
        DatasetDict=FakeDatasetDict, load_dataset=lambda name, subset: hub[name]))
    return hub


def test_one_file_is_cut_into_contiguous_byte_ranges(tmp_path):
    text = bytes(range(32, 127)) * 40  # 3800 bytes
    (tmp_path / "book.txt").write_bytes(text)
    task = make_task("lm", source=str(tmp_path / "book.txt"), **SMALL)
    assert task.split_by == "bytes"
    # 90 % / 10 % / 10 % of 3800 bytes: [0, 3040), [3040, 3420), [3420, 3800)
    assert task.split_documents == {"train": ("book.txt[0:3040]",), "valid": ("book.txt[3040:3420]",),
                                    "test": ("book.txt[3420:3800]",)}
    for split, (lo, hi) in {"train": (0, 3040), "valid": (3040, 3420), "test": (3420, 3800)}.items():
        assert task.streams[split].tobytes() == text[lo:hi]
    valid = task.eval_splits()["valid"]  # 64 // 16 = 4 consecutive windows of the valid range
    assert valid.inputs.shape == (4, 16)
    assert bytes(valid.inputs[1].astype(np.uint8)) == text[3056:3072]
    assert bytes(valid.targets[1].astype(np.uint8)) == text[3057:3073]
    batch = task.train_batch(0, 8)
    for x, y, w in zip(batch["inputs"], batch["targets"], batch["weights"]):
        n = int(w.sum())  # the scored prefix: the window's bytes of the train range
        assert n >= 1 and bytes(np.append(x[:n], y[n - 1]).astype(np.uint8)) in text[:3040]
    assert make_task("lm", source=str(tmp_path / "book.txt"), **SMALL).fingerprint == task.fingerprint


def test_five_files_split_by_bytes_in_name_order(tmp_path):
    sizes = {"a.txt": 500, "b.md": 300, "c.py": 700, "d.rst": 200, "e.txt": 300}  # 2000 bytes
    for (name, size), letter in zip(sizes.items(), "abcde"):
        (tmp_path / name).write_bytes(document(letter, size))
    task = make_task("lm", source=str(tmp_path), **SMALL)
    name = tmp_path.name
    # 80 % / 10 % / 10 %: cuts at 1600 (inside d.rst, bytes 1500..1700) and 1800 (inside e.txt, 1700..2000)
    assert task.split_documents == {
        "train": (f"{name}/a.txt", f"{name}/b.md", f"{name}/c.py", f"{name}/d.rst[0:100]"),
        "valid": (f"{name}/d.rst[100:200]", f"{name}/e.txt[0:100]"), "test": (f"{name}/e.txt[100:300]",)}
    np.testing.assert_array_equal(task.bounds["train"], [0, 500, 800, 1500, 1600])
    np.testing.assert_array_equal(task.bounds["valid"], [0, 100, 200])
    assert task.streams["test"].tobytes() == document("e", 200)
    # split_by=document sends each file wholly to one split: with 5 files some split is empty, and the error says so
    with pytest.raises(ValueError, match=r"split_by=document .* set task\.split_by=bytes"):
        make_task("lm", source=str(tmp_path), split_by="document", **SMALL)


def test_windows_never_cross_documents(tmp_path):
    sizes = {"a.txt": 40, "b.txt": 5, "c.txt": 1, "d.txt": 60}  # b shorter than a window, c has nothing to predict
    for (name, size), letter in zip(sizes.items(), "abcd"):
        (tmp_path / name).write_bytes(document(letter, size))
    task = make_task("lm", source=str(tmp_path), split_by="bytes", valid_fraction=0.05, test_fraction=0.05,
                     seq_len=16, eval_bytes=1000)
    # train holds a, b, c and d[0:49] (90 % of 106 bytes = 95.4, rounded to 95)
    np.testing.assert_array_equal(task.bounds["train"], [0, 40, 45, 46, 95])
    batch = task.train_batch(3, 256)
    seen = set()
    for x, y, w in zip(batch["inputs"], batch["targets"], batch["weights"]):
        scored = w > 0
        letters = set(bytes(x[scored].astype(np.uint8))) | set(bytes(y[scored].astype(np.uint8)))
        assert len(letters) == 1  # one document per window
        seen |= letters
        np.testing.assert_array_equal(scored, np.arange(16) < scored.sum())  # padding only after the document
        np.testing.assert_array_equal(x[~scored][1:], 0)
        if letters == {ord("b")}:  # 5 bytes: a window starting at its k-th byte makes 4 - k predictions
            assert 1 <= scored.sum() <= 4
    assert seen == {ord("a"), ord("b"), ord("d")}
    # evaluation: consecutive windows inside each document; test is d[55:60]: one window, 4 predictions
    test = task.eval_splits()["test"]
    assert test.inputs.shape == (1, 16) and test.weights.sum() == 4
    # joined (the documents as one run of bytes): windows cross from a to b
    joined = make_task("lm", source=str(tmp_path), split_by="bytes", valid_fraction=0.05, test_fraction=0.05,
                       seq_len=16, eval_bytes=1000, documents="joined")
    np.testing.assert_array_equal(joined.bounds["train"], [0, 95])
    rows = joined.train_batch(3, 256)
    assert any(len(set(y[w > 0].tolist())) > 1 for y, w in zip(rows["targets"], rows["weights"]))


def test_binary_files_and_the_suffix_filter(tmp_path):
    for k in range(3):
        (tmp_path / f"part{k}.bin").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"no file ending in \.py, \.txt, \.md, \.rst \(task\.suffixes\) but 3 "
                                         r"other file\(s\), e\.g\. 'part0\.bin'; set task\.suffixes=\.bin"):
        make_task("lm", source=str(tmp_path), **SMALL)
    task = make_task("lm", source=str(tmp_path), suffixes=".bin", **SMALL)  # as task.suffixes=.bin parses
    assert task.config.suffixes == (".bin",)
    assert sum(s.size for s in task.streams.values()) == 3 * 1024
    assert make_task("lm", source=str(tmp_path), suffixes=[], **SMALL).fingerprint == task.fingerprint  # every file
    (tmp_path / "README").write_text("no ending", encoding="utf-8")
    with pytest.raises(ValueError, match=r"set task\.suffixes=\[\] \(every file\)"):
        make_task("lm", source=str(tmp_path), suffixes=".txt", **SMALL)
    with pytest.raises(ValueError, match=r"every file is larger than max_bytes=5 \(the smallest, '\S*README', has 9 "
                                         r"bytes\); raise task\.max_bytes"):
        make_task("lm", source=str(tmp_path), suffixes=[], max_bytes=5, **SMALL)


def test_files_left_out_by_max_bytes_are_warned_about(tmp_path, caplog):
    """A corpus of more bytes than task.max_bytes takes whole files while they fit, and says how much it left out
    (the standard library, a sample by design, says nothing)."""
    for letter, size in (("a", 600), ("b", 500), ("c", 400)):
        (tmp_path / f"{letter}.txt").write_bytes(document(letter, size))
    task = make_task("lm", source=str(tmp_path), max_bytes=1000, **SMALL)
    taken = sum(task.streams[split].size for split in ("train", "valid", "test"))
    assert taken in (900, 1000)  # two of the three files, whichever the pseudo-random order takes
    assert (f"task.source={str(tmp_path)!r} holds 1500 bytes in 3 files, more than task.max_bytes=1000: the corpus "
            f"takes {taken} bytes, 2 whole files; raise task.max_bytes") in caplog.text
    caplog.clear()
    make_task("lm", source=str(tmp_path), max_bytes=1500, **SMALL)
    make_task("lm", source="stdlib", max_bytes=400_000, **SMALL)
    assert "more than task.max_bytes" not in caplog.text


def test_hidden_files_of_a_directory_are_skipped_as_hidden_directories_are(tmp_path):
    """An editor's swap file and a .DS_Store beside the texts, or a hidden file of a taken ending, were read as
    documents while hidden directories were skipped; a hidden file named as task.source itself is read."""
    corpus = tmp_path / "corpus"
    (corpus / ".git").mkdir(parents=True)
    (corpus / "a.txt").write_bytes(document("a", 400))
    (corpus / "b.txt").write_bytes(document("b", 400))
    for hidden in (".a.txt.swp", ".DS_Store", ".notes.txt", ".git/HEAD.txt"):
        (corpus / hidden).write_bytes(document("h", 400))
    files = {"corpus/a.txt": corpus / "a.txt", "corpus/b.txt": corpus / "b.txt"}
    for suffixes in ((".txt",), ()):
        task = make_task("lm", source=str(corpus), suffixes=suffixes, **SMALL)
        assert task.fingerprint == blake2b_of(files)
        assert b"h" not in b"".join(task.streams[split].tobytes() for split in ("train", "valid", "test"))
    assert make_task("lm", source=str(corpus / ".notes.txt"), **SMALL).fingerprint == blake2b_of(
        {".notes.txt": corpus / ".notes.txt"})
    for name in ("a.txt", "b.txt"):
        (corpus / name).unlink()
    with pytest.raises(ValueError, match=re.escape(f"source={str(corpus)!r} holds no files (hidden files and folders")):
        make_task("lm", source=str(corpus), suffixes=(), **SMALL)

def test_a_hub_dataset_cut_by_max_bytes_is_warned_about_as_a_directory_is(fake_hub, caplog):
    """A dataset of more bytes than task.max_bytes in a split was cut without a word, where a directory warns; each
    split cut now says how many rows it holds and how many the corpus takes."""
    rows = [f"row {k:02d} ".encode() * 10 for k in range(30)]  # 70 bytes each
    fake_hub["wiki"] = FakeDatasetDict(train=FakeDataset([{"text": row.decode()} for row in rows]),
                                       validation=FakeDataset([{"text": row.decode()} for row in rows[:3]]),
                                       test=FakeDataset([{"text": row.decode()} for row in rows[3:6]]))
    task = make_task("lm", source="hf:wiki", max_bytes=1000, seq_len=16, eval_bytes=64)
    assert task.streams["train"].tobytes() == b"".join(rows[:14])  # 14 · 70 = 980 bytes fit in 1000
    assert task.streams["test"].tobytes() == b"".join(rows[3:6])
    warned = [record.getMessage() for record in caplog.records if "more than task.max_bytes" in record.getMessage()]
    assert warned == ["task lm: task.source='hf:wiki' holds 30 rows in its train split, more than task.max_bytes=1000: "
                      "the corpus takes 980 bytes, its first 14 rows; raise task.max_bytes to take them all"]
    caplog.clear()
    make_task("lm", source="hf:wiki", max_bytes=2100, seq_len=16, eval_bytes=64)  # 30 · 70 bytes: every row fits
    assert "more than task.max_bytes" not in caplog.text

def test_links_to_directories_are_followed_once(tmp_path):
    """A directory linked into the corpus (corpus/books -> library/) gives its files as the corpus' own; a link back
    up the walked path (to the corpus or to itself) is not walked again; two links to one directory name its files
    twice, an error."""
    library, corpus = tmp_path / "library", tmp_path / "corpus"
    (library / "shelf").mkdir(parents=True)
    (library / "a.txt").write_bytes(document("a", 300))
    (library / "shelf" / "b.txt").write_bytes(document("b", 300))
    corpus.mkdir()
    (corpus / "readme.txt").write_bytes(document("r", 300))
    (corpus / "books").symlink_to(library, target_is_directory=True)
    (library / "shelf" / "up").symlink_to(corpus, target_is_directory=True)
    (corpus / "here").symlink_to(".", target_is_directory=True)
    task = make_task("lm", source=str(corpus), **SMALL)
    files = {"corpus/readme.txt": corpus / "readme.txt", "corpus/books/a.txt": library / "a.txt",
             "corpus/books/shelf/b.txt": library / "shelf" / "b.txt"}
    assert task.fingerprint == blake2b_of(files)
    assert b"".join(task.streams[split].tobytes() for split in ("train", "valid", "test")) == b"".join(
        files[name].read_bytes() for name in sorted(files))  # split by bytes, files in name order
    (corpus / "again").symlink_to(library, target_is_directory=True)
    with pytest.raises(ValueError, match=r"source='\S*corpus' names the file .*a\.txt' twice \(as "
                                         r"'corpus/again/a\.txt' and 'corpus/books/a\.txt'\); give it once"):
        make_task("lm", source=str(corpus), **SMALL)


def test_empty_files(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds no bytes: its 1 file\(s\) are empty"):
        make_task("lm", source=str(tmp_path / "empty.txt"), **SMALL)
    (tmp_path / "text.txt").write_bytes(document("t", 400))
    task = make_task("lm", source=str(tmp_path), **SMALL)  # an empty file beside others changes nothing
    assert task.streams["train"].tobytes() == document("t", 320)
    with pytest.raises(ValueError, match=r"the test split .* has 0 bytes .*; raise task\.test_fraction"):
        make_task("lm", source=str(tmp_path), seq_len=16, valid_fraction=0.1, test_fraction=0.001)



def test_a_pipe_is_refused_not_read(tmp_path):
    """A named pipe as task.source (what a shell's <(zcat corpus.gz) passes) or inside a walked directory is refused
    as no regular file: reading it would wait for a writer, and a resumed run could not read it again."""
    (tmp_path / "text.txt").write_bytes(document("t", 400))
    os.mkfifo(tmp_path / "pipe.txt")
    refused = (r"source='\S*' holds 1 path\(s\) that are no regular file \(a pipe, a socket or a device\), "
               r"e\.g\. '\S*pipe\.txt': a run reads its corpus again to resume; save the text to a file")
    with pytest.raises(ValueError, match=refused):
        make_task("lm", source=str(tmp_path / "pipe.txt"), **SMALL)
    with pytest.raises(ValueError, match=refused):
        make_task("lm", source=str(tmp_path), **SMALL)


def test_a_file_that_cannot_be_read_is_refused_naming_the_source_and_the_file(tmp_path, monkeypatch):
    """A corpus file that may not be read (its permissions, a network mount gone) raised a bare PermissionError,
    naming the file but not the setting that chose it; it is now a ValueError naming task.source and the file, as
    every corpus error does (root, which this runs as, may read any file: the error is raised by a stand-in open)."""
    (tmp_path / "a.txt").write_bytes(document("a", 400))
    (tmp_path / "b.txt").write_bytes(document("b", 400))

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(lm, "open", refuse, raising=False)  # the module's open, ahead of the builtin
    with pytest.raises(ValueError, match=rf"task\.source='{re.escape(str(tmp_path))}': Permission denied for "
                                         rf"'{re.escape(str(tmp_path))}/[ab]\.txt'; a run reads its corpus again"):
        build_task(build_config(task="lm", pe="rope", overrides=[f"task.source={tmp_path}", "task.seq_len=16"]))
def test_every_corpus_error_names_its_config_key_and_value(tmp_path, fake_hub, monkeypatch):
    """Each refusal of a corpus names the key a user sets and its value, as every config error does: task.source='...'
    (task.source[i]='...' for one path of several) where it said "source path ...", "source directory ..." or "source
    holds ...", and the key of a missing package too."""
    for name in ("empty", "binary", "texts", "other", "links"):
        (tmp_path / name).mkdir()
    (tmp_path / "binary" / "a.bin").write_bytes(document("b", 100))
    (tmp_path / "texts" / "a.txt").write_bytes(document("a", 300))
    (tmp_path / "other" / "a.txt").write_bytes(document("o", 300))
    (tmp_path / "links" / "b.txt").symlink_to(tmp_path / "gone.txt")
    os.mkfifo(tmp_path / "pipe.txt")
    fake_hub["wiki"] = FakeDatasetDict(train=FakeDataset([{"text": "a row of text"}, {"text": 5}]))
    path = {name: str(tmp_path / name) for name in ("missing", "empty", "binary", "texts", "links", "pipe.txt")}
    a, other_a = str(tmp_path / "texts" / "a.txt"), str(tmp_path / "other" / "a.txt")
    cases = [
        ([f"task.source={path['missing']}"], f"task.source={path['missing']!r} does not exist"),
        ([f'task.source=["{a}","{path["missing"]}"]'], f"task.source[1]={path['missing']!r} does not exist"),
        ([f"task.source={path['empty']}"], f"task.source={path['empty']!r} holds no files"),
        ([f"task.source={path['binary']}"], f"task.source={path['binary']!r} holds no file ending in .py"),
        ([f'task.source=["{a}","{other_a}"]'], f"task.source={(a, other_a)!r} holds two files named 'a.txt'"),
        ([f"task.source={path['links']}"], f"task.source={path['links']!r} holds 1 link(s) to no file"),
        ([f"task.source={path['pipe.txt']}"], f"task.source={path['pipe.txt']!r} holds 1 path(s) that are no regular"),
        ([f'task.source=["{path["texts"]}","{a}"]'], f"task.source={(path['texts'], a)!r} names the file {a!r} twice"),
        (["task.source=hf:wiki", "task.text_field=body"], "task.text_field='body' is not a column of "
                                                          "task.source='hf:wiki' (columns: ['text'])"),
        (["task.source=hf:wiki"], "task.source='hf:wiki' (train split), row 1: task.text_field='text' holds int, "
                                  "not a string"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            build_task(build_config(task="lm", overrides=overrides))
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: its import raises ImportError
    with pytest.raises(ImportError, match="^" + re.escape("task.source='hf:wiki' needs the Hugging Face `datasets`")):
        build_task(build_config(task="lm", overrides=["task.source=hf:wiki"]))

def test_a_data_path_from_the_home_directory(tmp_path, monkeypatch):
    """`task.source=~/texts` and `task.data_dir=~/data`, words a shell leaves as they are (no variable assignment),
    are read from the home directory and saved as its absolute path, not taken as a folder named ~ here."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    (home / "texts").mkdir(parents=True)
    (home / "texts" / "book.txt").write_bytes(document("b", 400))
    for split in ("train", "valid"):
        write_jsonl(home / "data" / f"{split}.jsonl", [{"context": "a = 0 ;", "question": "print a", "answer": "0"}])
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    for source, saved in (("~/texts", str(home / "texts")), ('["~/texts/book.txt"]', [str(home / "texts/book.txt")])):
        options = build_config(task="lm", overrides=[f"task.source={source}"]).task.options
        task = make_task("lm", **{**options, **SMALL})
        assert task.corpus["source"] == saved and task.streams["train"].tobytes() == document("b", 320)
    options = build_config(task="counting", overrides=["task.data_dir=~/data"]).task.options
    assert make_task("counting", **options).corpus["source"] == str(home / "data")
    assert list(elsewhere.iterdir()) == []

def blake2b_of(files: dict[str, pathlib.Path]) -> str:
    """The fingerprint worked out here: blake2b-256 over each document's name and bytes, each led by its length as 8
    little-endian bytes, in name order."""
    digest = hashlib.blake2b(digest_size=32)
    for name in sorted(files):
        for part in (name.encode(), files[name].read_bytes()):
            digest.update(struct.pack("<Q", len(part)) + part)
    return digest.hexdigest()


def test_an_edit_that_keeps_every_size_is_a_changed_corpus(tmp_path):
    """One byte of one file changed, sizes and names kept: another fingerprint, and a run saved on the first corpus
    is refused on the edited one (a corpus.json of names and sizes, saved before, cannot see such an edit and
    passes; a changed size it refuses, naming what its fingerprint hashes)."""
    corpus, workdir = tmp_path / "corpus", tmp_path / "run"
    corpus.mkdir()
    workdir.mkdir()
    (corpus / "a.txt").write_bytes(document("a", 300))
    (corpus / "b.txt").write_bytes(document("b", 300))
    task = make_task("lm", source=str(corpus), **SMALL)
    assert task.fingerprint == blake2b_of({"corpus/a.txt": corpus / "a.txt", "corpus/b.txt": corpus / "b.txt"})
    write_corpus(workdir, task)
    (corpus / "b.txt").write_bytes(document("b", 299) + b"c")
    edited = make_task("lm", source=str(corpus), **SMALL)
    assert edited.fingerprint != task.fingerprint and edited.names_fingerprint == task.names_fingerprint
    message = (f"task.source={str(corpus)!r} now gives fingerprint {edited.fingerprint[:12]} (600 bytes), the run "
               f"began on {task.fingerprint[:12]} (600 bytes; fingerprints hash the documents' names and contents")
    with pytest.raises(ValueError, match=re.escape(message)):
        check_same_corpus(workdir, edited)
    (workdir / "corpus.json").write_text(json.dumps({"source": str(corpus), "bytes": 600,
                                                     "fingerprint": task.names_fingerprint}), encoding="utf-8")
    check_same_corpus(workdir, edited)  # names and sizes: the same
    (corpus / "b.txt").write_bytes(document("b", 301))
    with pytest.raises(ValueError, match=r"hash the documents' names and sizes \(saved before they hashed"):
        check_same_corpus(workdir, make_task("lm", source=str(corpus), **SMALL))
    (workdir / "corpus.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{str(workdir / 'corpus.json')!r} is not valid JSON")):
        check_same_corpus(workdir, task)


def test_a_standard_library_run_under_another_python_says_so(tmp_path):
    """The default corpus is the running Python's standard library: a run begun under another Python (its corpus.json
    naming that version and another fingerprint) is refused naming both versions and what to do, not "restore that
    data"; the same version with other files says that its files changed."""
    task = make_task("lm", source="stdlib", max_bytes=400_000, **SMALL)
    write_corpus(tmp_path, task)
    saved = json.loads((tmp_path / "corpus.json").read_text(encoding="utf-8"))
    assert saved["python"] == platform.python_version()
    check_same_corpus(tmp_path, task)
    (tmp_path / "corpus.json").write_text(json.dumps({**saved, "python": "3.9.1", "fingerprint": "0" * 64}),
                                          encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(
            f"that data comes with the Python that runs the command, here {platform.python_version()}, and the run "
            "began under Python 3.9.1: resume it with that Python, or use a new workdir")):
        check_same_corpus(tmp_path, task)
    (tmp_path / "corpus.json").write_text(json.dumps({**saved, "fingerprint": "0" * 64}), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"comes with Python {platform.python_version()}, whose files "
                                                   "changed since the run began; use a new workdir")):
        check_same_corpus(tmp_path, task)


def _lm_config(source, steps: int):
    """A tiny lm run on `source`: 16-byte windows, one small layer, a checkpoint every 2 steps."""
    return build_config(task="lm", pe="rope", overrides=[
        f"task.source={source}", "task.seq_len=16", "task.eval_bytes=32", "task.eval_multiples=[2]",
        "task.valid_fraction=0.1", "task.test_fraction=0.1", "model.d_model=16", "model.num_layers=1",
        "model.num_heads=2", "optim.batch_size=8", "optim.warmup_steps=1", f"run.steps={steps}", "run.log_every=1",
        "run.eval_every=0", "run.checkpoint_every=2", "run.async_checkpoints=false", "run.eval_batch_size=8",
        "run.progress=false", "run.num_devices=1", "run.tensorboard=false"])


def test_a_run_resumes_on_its_corpus_and_refuses_a_changed_one(tmp_path, capsys):
    """The corpus' fingerprint (worked out here from the files' names and sizes) is saved with the run; the same
    corpus resumes and reads back, a changed one (a file 12 bytes longer) is refused by a resume, restore_run,
    jaxpe-eval, jaxpe-train and jaxpe-compare's reuse of the finished run, naming task.source and both fingerprints,
    before anything is written."""
    corpus, workdir = tmp_path / "corpus", tmp_path / "run"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(bytes(range(32, 127)) * 8)  # 760 bytes
    (corpus / "b.txt").write_bytes(b"hello world\n" * 20)  # 240 bytes
    first = train_and_evaluate(_lm_config(corpus, 2), workdir)
    saved = json.loads((workdir / "corpus.json").read_text(encoding="utf-8"))
    assert saved == {"option": "task.source", "source": str(corpus), "hash": "blake2b", "bytes": 1000,
                     "fingerprint": blake2b_of({"corpus/a.txt": corpus / "a.txt", "corpus/b.txt": corpus / "b.txt"})}
    assert first["resumed_from"] is None
    # a run saved when fingerprints hashed names and sizes: checked that way, resumed, its corpus.json rewritten
    listing = "corpus/a.txt\t760\ncorpus/b.txt\t240\n"
    (workdir / "corpus.json").write_text(json.dumps({"source": str(corpus), "bytes": 1000,
                                                     "fingerprint": hashlib.sha256(listing.encode()).hexdigest()}),
                                         encoding="utf-8")
    resumed = train_and_evaluate(_lm_config(corpus, 4), workdir)  # the same corpus: resumes
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    assert json.loads((workdir / "corpus.json").read_text(encoding="utf-8")) == saved
    assert int(restore_run(workdir).state.step) == 4  # the same corpus: read back

    (corpus / "b.txt").write_bytes(b"hello world\n" * 21)  # 252 bytes: another corpus
    changed = re.escape(f"the corpus of the run in {str(workdir)!r} changed: task.source={str(corpus)!r} now gives "
                        f"fingerprint ") + r"[0-9a-f]{12} \(1012 bytes\), the run began on " + re.escape(
                        f"{saved['fingerprint'][:12]} (1000 bytes;")
    before = {p.name: p.stat().st_mtime_ns for p in workdir.iterdir()}
    with pytest.raises(ValueError, match=changed):
        train_and_evaluate(_lm_config(corpus, 6), workdir)
    with pytest.raises(ValueError, match=changed):
        restore_run(workdir)  # a notebook's Run.task would be the changed corpus
    with pytest.raises(ValueError, match=changed):
        evaluate_checkpoint(workdir)
    assert {p.name: p.stat().st_mtime_ns for p in workdir.iterdir()} == before  # nothing written
    argv = ["--config", str(workdir / "config.json"), "--workdir", str(workdir), "run.steps=6"]
    capsys.readouterr()  # what the runs above logged
    assert cli.train_main(argv) == 2
    err = capsys.readouterr().err
    assert re.search("jaxpe-train: error: " + changed, err) and "Traceback" not in err
    # jaxpe-compare does not reuse the finished run on the changed corpus either
    shutil.copytree(workdir, tmp_path / "cmp" / "rope" / "seed0")
    with pytest.raises(ValueError, match="changed: task.source="):
        compare_encodings([_lm_config(corpus, 4)], [0], tmp_path / "cmp")
    (corpus / "b.txt").write_bytes(b"hello world\n" * 20)  # the corpus restored: reused as it is
    assert compare_encodings([_lm_config(corpus, 4)], [0], tmp_path / "cmp")["runs"][0]["resumed_from"] == 2
