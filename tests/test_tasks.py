"""Tests of jaxpe.train.tasks: each generator checked against an independent restatement of its rules."""

import json
import re
import sysconfig

import numpy as np
import pytest

from jaxpe.train.tasks import TASK_NAMES, Split, Task, make_task, read_jsonl, task_config_class, write_jsonl
from jaxpe.train.tasks.base import epoch_indices, pad_and_shift
from jaxpe.train.tasks.counting import generate_samples

STATEMENT = re.compile(r"([a-z]) = 0 ;|pass;|([a-z]) \+\+;")


def replay(context: str) -> tuple[list[str], dict[str, int], int]:
    """An independent interpreter of a counting program: (statement kinds, final values, max value seen)."""
    kinds, values, highest = [], {}, 0
    rest = context
    while rest:
        m = STATEMENT.match(rest)
        assert m, f"unparsable statement at {rest[:30]!r}"
        if m.group(1):
            kinds.append("set")
            values[m.group(1)] = 0
        elif m.group(2):
            kinds.append("inc")
            assert m.group(2) in values, "increment of a variable never set"
            values[m.group(2)] += 1
            highest = max(highest, values[m.group(2)])
        else:
            kinds.append("pass")
        rest = rest[m.end():].lstrip(" ")
    return kinds, values, highest


# ---------------------------------------------------------------- shared pieces

def test_pad_and_shift_hand_example():
    inputs, targets, weights = pad_and_shift([[5, 6, 7], [1, 2, 3, 4, 5]],
                                             [[0, 0, 1], [0, 0, 0, 1, 1]], seq_len=3, pad_id=0)
    np.testing.assert_array_equal(inputs, [[5, 6, 7], [2, 3, 4]])  # the long one keeps its last 4 tokens
    np.testing.assert_array_equal(targets, [[6, 7, 0], [3, 4, 5]])
    np.testing.assert_array_equal(weights, [[0, 1, 0], [0, 1, 1]])


def test_epoch_indices_cover_each_epoch_once():
    seen = np.concatenate([epoch_indices(12, seed=3, step=s, batch_size=4) for s in range(6)])
    assert sorted(seen[:12]) == list(range(12)) and sorted(seen[12:]) == list(range(12))
    assert not np.array_equal(seen[:12], seen[12:])  # a fresh permutation per epoch
    # a batch that straddles two epochs is the same stream, read with another batch size
    np.testing.assert_array_equal(epoch_indices(12, seed=3, step=1, batch_size=8), seen[8:16])


# ---------------------------------------------------------------- counting

def test_counting_programs_replay_to_their_answers():
    samples = generate_samples(300, nvars=3, min_steps=3, max_steps=80, seed=1)
    lengths = []
    for s in samples:
        kinds, values, highest = replay(s["context"])
        lengths.append(len(kinds))
        var = s["question"].removeprefix("print ")
        assert re.fullmatch(r"print [abc]", s["question"]) and var in values
        assert s["answer"] == str(values[var])
        assert highest <= 10
    assert 3 <= min(lengths) and max(lengths) <= 80 and max(lengths) > 60


def test_counting_value_cap_binds_but_is_never_exceeded():
    highest = [replay(s["context"])[2] for s in generate_samples(100, nvars=1, min_steps=300, max_steps=300, seed=2)]
    assert max(highest) == 10  # with one variable the cap is reached often...
    uncapped = [replay(s["context"])[2]
                for s in generate_samples(100, nvars=1, min_steps=300, max_steps=300, max_value=10**6, seed=2)]
    assert max(uncapped) > 10  # ...and without it values go higher


def test_counting_statement_weights_are_1_50_7():
    counts = {"set": 0, "pass": 0, "inc": 0}
    for s in generate_samples(200, nvars=2, min_steps=300, max_steps=300, max_value=10**6, seed=3):
        kinds = replay(s["context"])[0]
        for kind in kinds[kinds.index("set") + 1:]:  # after the first set every draw is valid: i.i.d. 1:50:7
            counts[kind] += 1
    total = sum(counts.values())
    for kind, weight in (("set", 1), ("pass", 50), ("inc", 7)):
        p = weight / 58
        assert abs(counts[kind] / total - p) < 5 * np.sqrt(p * (1 - p) / total), (kind, counts)


def test_counting_batches_score_only_the_answer():
    task = make_task("counting", n_train=40, n_valid=8, n_test=8, max_steps=20, seq_len=64, seed=5)
    batch = task.train_batch(0, 8)
    assert {k: v.shape for k, v in batch.items()} == {k: (8, 64) for k in ("inputs", "targets", "weights")}
    np.testing.assert_array_equal(batch["weights"].sum(axis=1), 1)  # one answer word per program
    by_text = {" ".join([s["context"], s["question"]]): s["answer"] for s in task.samples["train"]}
    for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
        t = int(np.argmax(weights))
        prompt = task.decode(inputs[:t + 1])
        assert by_text[prompt] == task.decode([targets[t]])  # the answer follows "context question"
        assert (inputs[t + 2:] == 0).all()  # right padding
    splits = task.eval_splits()
    assert set(splits) == {"valid", "test", "len_x2"} and splits["len_x2"].seq_len == 128


def test_counting_trims_long_programs_from_the_left():
    task = make_task("counting", n_train=10, n_valid=2, n_test=2, max_steps=200, seq_len=16)
    split = task.eval_splits()["test"]
    np.testing.assert_array_equal(split.weights[:, -1], 1)  # the answer is the last target of a full block
    assert task.decode(split.inputs[0, -2:]) == task.samples["test"][0]["question"]


def test_counting_train_batch_is_a_pure_function_of_seed_and_step():
    a = make_task("counting", n_train=30, n_valid=4, n_test=4, max_steps=30, seq_len=96, seed=7)
    b = make_task("counting", n_train=30, n_valid=4, n_test=4, max_steps=30, seq_len=96, seed=7)
    for step in (0, 5):
        for key in ("inputs", "targets", "weights"):
            np.testing.assert_array_equal(a.train_batch(step, 4)[key], b.train_batch(step, 4)[key])
    assert not np.array_equal(a.train_batch(0, 4)["inputs"], a.train_batch(1, 4)["inputs"])
    other = make_task("counting", n_train=30, n_valid=4, n_test=4, max_steps=30, seq_len=96, seed=8)
    assert other.samples["train"] != a.samples["train"]


def test_jsonl_round_trip_and_official_lines(tmp_path):
    samples = generate_samples(20, nvars=2, min_steps=3, max_steps=12, seed=0)
    write_jsonl(tmp_path / "out" / "train.jsonl", samples)
    assert read_jsonl(tmp_path / "out" / "train.jsonl") == samples
    first = json.loads((tmp_path / "out" / "train.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"context", "question", "answer"}

    # lines as the paper's count_data_gen.py writes them, typed in by hand
    official = ['{"context": "b = 0 ; pass; b ++; pass; b ++;", "question": "print b", "answer": "2"}',
                '{"context": "a = 0 ; a ++; a = 0 ;", "question": "print a", "answer": "0"}']
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(official) + "\n", encoding="utf-8")
    task = make_task("counting", data_dir=str(tmp_path), seq_len=16)
    batch = task.train_batch(0, 2)
    answers = sorted(task.decode(t[w > 0]) for t, w in zip(batch["targets"], batch["weights"]))
    assert answers == ["0", "2"]
    assert set(task.eval_splits()) == {"valid", "test"}


def test_data_dir_trains_like_the_generated_data(tmp_path):
    generated = make_task("counting", n_train=16, n_valid=4, n_test=4, max_steps=10, seq_len=48, seed=2)
    for split, samples in generated.samples.items():
        write_jsonl(tmp_path / f"{split}.jsonl", samples)
    loaded = make_task("counting", data_dir=str(tmp_path), seq_len=48, seed=2)
    assert loaded.vocab_size == generated.vocab_size
    for key in ("inputs", "targets", "weights"):
        np.testing.assert_array_equal(loaded.train_batch(3, 8)[key], generated.train_batch(3, 8)[key])
    assert set(loaded.eval_splits()) == {"valid", "test", "len_x2"}


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"context": "a = 0 ;", "question": "print a", "answer": "0"})
    path.write_text(f"{good}\n{good}\n{{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:3"):
        read_jsonl(path)
    path.write_text(f"{good}\n" + json.dumps({"context": "a = 0 ;", "question": "print a"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r":2: key 'answer'"):
        read_jsonl(path)


# ---------------------------------------------------------------- flip-flop

def check_flipflop(task: Task, inputs: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Replays each sequence: first w, last r, reads repeat the last write, weights on read bits.
    Returns the counts of w, r, i over the inner pairs."""
    counts = np.zeros(3)
    for x, y, w in zip(inputs, targets, weights):
        words = task.decode(np.append(x, y[-1])).split()
        assert len(words) == task.seq_len
        instrs, bits = words[0::2], words[1::2]
        assert instrs[0] == "w" and instrs[-1] == "r" and set(bits) <= {"0", "1"}
        last = None
        for k, (instr, bit) in enumerate(zip(instrs, bits)):
            if instr == "w":
                last = bit
            elif instr == "r":
                assert bit == last
            if 0 < k < len(instrs) - 1:
                counts["wri".index(instr)] += 1
        read_bit_targets = [2 * k + 1 for k, instr in enumerate(instrs) if instr == "r"]  # target t = token t + 1
        np.testing.assert_array_equal(np.flatnonzero(w), read_bit_targets)
    return counts / counts.sum()


def test_flipflop_reads_repeat_the_last_write():
    task = make_task("flipflop", seq_len=64, n_eval=100, seed=1)
    batch = task.train_batch(4, 100)
    freq = check_flipflop(task, batch["inputs"], batch["targets"], batch["weights"])
    np.testing.assert_allclose(freq, [0.1, 0.1, 0.8], atol=0.02)
    splits = task.eval_splits()
    for name, p_ignore in (("valid", 0.8), ("ood_sparse", 0.98), ("ood_dense", 0.1)):
        s = splits[name]
        freq = check_flipflop(task, s.inputs, s.targets, s.weights)
        np.testing.assert_allclose(freq, [(1 - p_ignore) / 2] * 2 + [p_ignore], atol=0.02)


def test_flipflop_batches_and_splits_are_fixed_by_the_seed():
    a, b = make_task("flipflop", seq_len=32, seed=3), make_task("flipflop", seq_len=32, seed=3)
    np.testing.assert_array_equal(a.train_batch(9, 5)["inputs"], b.train_batch(9, 5)["inputs"])
    assert not np.array_equal(a.train_batch(9, 5)["inputs"], a.train_batch(10, 5)["inputs"])
    other = make_task("flipflop", seq_len=32, seed=4, p_ignore_sparse=0.8)  # its ood_sparse p(i) is valid's
    for name, split in a.eval_splits().items():
        np.testing.assert_array_equal(split.inputs, b.eval_splits()[name].inputs)
        assert not np.array_equal(split.inputs, other.eval_splits()[name].inputs)
    # one seed per split: equal settings still draw different sequences
    assert not np.array_equal(other.eval_splits()["valid"].inputs, other.eval_splits()["ood_sparse"].inputs)


# ---------------------------------------------------------------- selective copy

def test_selective_copy_targets_are_the_symbols_in_order():
    task = make_task("selective_copy", n_tokens=6, n_blanks=10, n_blanks_dense=3, n_blanks_sparse=25,
                     n_symbols=5, n_eval=20)
    batch = task.train_batch(0, 50)
    splits = task.eval_splits()
    cases = [(10, batch["inputs"], batch["targets"], batch["weights"])]
    cases += [(b, splits[n].inputs, splits[n].targets, splits[n].weights)
              for n, b in (("valid", 10), ("ood_dense", 3), ("ood_sparse", 25))]
    for n_blanks, inputs, targets, weights in cases:
        assert inputs.shape[1] == 2 * 6 + n_blanks
        for x, y, w in zip(inputs, targets, weights):
            words = task.decode(np.append(x, y[-1])).split()
            body, sep, copy = words[:6 + n_blanks], words[6 + n_blanks], words[7 + n_blanks:]
            symbols = [t for t in body if t != "_"]
            assert len(symbols) == 6 and sep == "|" and set(symbols) <= {f"s{k}" for k in range(5)}
            assert task.decode(y[w > 0]).split() == symbols == copy
    assert task.seq_len == 22


# ---------------------------------------------------------------- language modelling

@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for k in range(40):
        (root / f"d{k % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"d{k % 3}" / f"f{k:02d}.txt").write_text(f"<file {k}> " + "abcdefgh" * (5 + k % 7) + "\n",
                                                          encoding="utf-8")
    (root / "skip.bin").write_bytes(b"\x00" * 100)  # not a text suffix
    return root


def lm_options(root, **extra):
    return dict(source=str(root), seq_len=16, valid_fraction=0.25, test_fraction=0.25, eval_bytes=200,
                split_by="document") | extra


def test_lm_splits_by_file(corpus):
    task = make_task("lm", **lm_options(corpus, documents="joined"))
    docs = task.split_documents
    names = {f"corpus/{p.relative_to(corpus).as_posix()}" for p in corpus.rglob("*.txt")}
    assert set(docs["train"]) | set(docs["valid"]) | set(docs["test"]) == names
    assert sum(len(v) for v in docs.values()) == len(names)  # disjoint
    assert all(docs.values())
    for split in ("train", "valid", "test"):  # each stream is its files' bytes, in name order
        expected = b"".join((corpus.parent / n).read_bytes() for n in sorted(docs[split]))
        assert task.streams[split].tobytes() == expected
    valid = task.streams["valid"].tobytes()
    s = task.eval_splits()["valid"]
    assert bytes(s.inputs[1].astype(np.uint8)) == valid[16:32] and bytes(s.targets[1].astype(np.uint8)) == valid[17:33]
    np.testing.assert_array_equal(s.weights, 1)
    # a file's split depends on its name only, not on the other files
    (corpus / "d0" / "f00.txt").unlink()
    smaller = make_task("lm", **lm_options(corpus, documents="joined"))
    for split in ("train", "valid", "test"):
        assert set(smaller.split_documents[split]) == set(docs[split]) - {"corpus/d0/f00.txt"}


def test_lm_fingerprint_and_eval_lengths(corpus):
    a, b = make_task("lm", **lm_options(corpus, documents="joined")), make_task("lm", **lm_options(corpus, seed=4))
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    splits = a.eval_splits()
    assert {k: v.seq_len for k, v in splits.items()} == {"valid": 16, "test": 16, "len_x2": 32, "len_x4": 64}
    test = a.streams["test"].tobytes()
    assert bytes(splits["len_x4"].inputs[0].astype(np.uint8)) == test[:64]
    (corpus / "d1" / "f01.txt").write_text("changed size\n", encoding="utf-8")
    assert make_task("lm", **lm_options(corpus)).fingerprint != a.fingerprint


def test_lm_train_windows_come_from_the_train_stream(corpus):
    task = make_task("lm", **lm_options(corpus, seed=1))
    train = task.streams["train"].tobytes()
    batch = task.train_batch(2, 6)
    for x, y, w in zip(batch["inputs"], batch["targets"], batch["weights"]):
        n = int(w.sum())  # the scored prefix: bytes of one training document
        assert n >= 1 and bytes(np.append(x[:n], y[n - 1]).astype(np.uint8)) in train
        np.testing.assert_array_equal(x[1:], y[:-1])
    again = make_task("lm", **lm_options(corpus, seed=1)).train_batch(2, 6)
    np.testing.assert_array_equal(batch["inputs"], again["inputs"])


def test_lm_default_corpus_is_the_stdlib():
    task = make_task("lm", max_bytes=200_000, seq_len=64)
    names = [n for docs in task.split_documents.values() for n in docs]
    assert names and all(n.endswith(".py") for n in names)
    assert not any(part in {"test", "tests", "site-packages"} for n in names for part in n.split("/"))
    assert sum(s.size for s in task.streams.values()) <= 200_000
    assert make_task("lm", max_bytes=200_000, seq_len=64).fingerprint == task.fingerprint
    first = sysconfig.get_paths()["stdlib"] + "/" + task.split_documents["train"][0]
    assert task.decode(task.streams["train"][:200]) == open(first, encoding="utf-8").read()[:200]


def test_lm_hugging_face_dataset(tmp_path):
    try:
        import datasets
    except ImportError:
        with pytest.raises(ImportError, match="datasets"):
            make_task("lm", source="hf:anything")
        return
    texts = {part: [f"{part} line {k} " * 3 for k in range(20)] for part in ("train", "validation", "test")}
    datasets.DatasetDict({p: datasets.Dataset.from_dict({"text": t}) for p, t in texts.items()}).save_to_disk(
        str(tmp_path / "ds"))
    task = make_task("lm", source=f"hf:{tmp_path / 'ds'}", seq_len=8, eval_bytes=64)
    for split, part in (("train", "train"), ("valid", "validation"), ("test", "test")):
        assert task.streams[split].tobytes() == "".join(texts[part]).encode()
    assert task.eval_splits()["len_x4"].seq_len == 32


# ---------------------------------------------------------------- registry and options

@pytest.mark.parametrize("name, options", [
    ("counting", dict(n_train=8, n_valid=2, n_test=2, max_steps=8, seq_len=32)),
    ("flipflop", dict(seq_len=16, n_eval=4)),
    ("selective_copy", dict(n_tokens=3, n_blanks=4, n_blanks_dense=2, n_blanks_sparse=8, n_eval=4)),
])
def test_every_task_meets_the_interface(name, options):
    task = make_task(name, **options)
    assert isinstance(task, Task) and task.name == name and name in TASK_NAMES
    batch = task.train_batch(0, 3)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "inputs": ((3, task.seq_len), np.int32), "targets": ((3, task.seq_len), np.int32),
        "weights": ((3, task.seq_len), np.float32)}
    assert batch["inputs"].max() < task.vocab_size and batch["weights"].sum() > 0
    for split in task.eval_splits().values():
        assert isinstance(split, Split) and split.weights.sum(axis=1).min() > 0
    assert set(TASK_NAMES) == {"counting", "flipflop", "selective_copy", "lm"}


def test_bad_options_name_the_key():
    with pytest.raises(ValueError, match="'n_trian'"):
        make_task("counting", n_trian=5)
    with pytest.raises(ValueError, match="'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="nvars=0"):
        make_task("counting", nvars=0)
    with pytest.raises(TypeError, match="nvars='3'"):
        make_task("counting", nvars="3")
    with pytest.raises(ValueError, match="seq_len=15"):
        make_task("flipflop", seq_len=15)
    with pytest.raises(ValueError, match="p_ignore_sparse=1.0"):
        make_task("flipflop", p_ignore_sparse=1.0)
    with pytest.raises(ValueError, match="does not exist"):
        make_task("lm", source="/no/such/path")
    with pytest.raises(ValueError, match="step=-1"):
        make_task("flipflop").train_batch(-1, 2)
    assert "max_steps" in {f for f in task_config_class("counting").__dataclass_fields__}
