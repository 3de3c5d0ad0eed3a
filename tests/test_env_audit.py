"""jaxpe where users run it: under an ASCII locale (every text file UTF-8 whatever the locale, printed tables with
backslash escapes where the terminal's encoding has no character, a corpus whose file names are not ASCII), a
workdir path the checkpoint library cannot take, a printed TensorBoard command for a path with spaces, and extras that
install on every Python the package supports."""
from __future__ import annotations

import io
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from tiny_config import ROOT, cli_command, cli_env

from jaxpe.train import cli
from jaxpe.train.tables import show

# Python's locale without PEP 538's coercion and PEP 540's UTF-8 mode: open() and the file system in ASCII
ASCII = {"PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C"}
UTF8 = {**ASCII, "PYTHONUTF8": "1"}  # the reference: the same, in UTF-8 mode
PRESET = {
    "_about": "tiny runs for tests — sizes × steps ≤ a few seconds ± compile time · naïve",
    "model": {"d_model": 16, "num_layers": 1, "num_heads": 2, "max_len": 64},
    "optim": {"batch_size": 8, "warmup_steps": 1, "learning_rate": 3e-3},
    "run": {"steps": 2, "log_every": 1, "eval_every": 0, "checkpoint_every": 2, "eval_batch_size": 16,
            "progress": False, "num_devices": 1, "tensorboard": False},
    "tasks": {"lm": {"seq_len": 16, "eval_bytes": 256}, "flipflop": {"seq_len": 16, "n_eval": 24}},
}
# Every command in one process: --show-config (its comments hold "·" and "−"), an lm run on a corpus with non-ASCII
# file names and text, jaxpe-eval on it, a comparison of two seeds, and its learning curves (curves.md holds "±").
DRIVER = """
import sys
from jaxpe.train import cli, curves
preset, corpus = sys.argv[1:]
commands = [
    (cli.train_main, ["--show-config", "--preset", preset, "--task", "lm", "--pe", "cope"]),
    (cli.train_main, ["--preset", preset, "--task", "lm", "--pe", "rope", "--workdir", "lm", f"task.source={corpus}"]),
    (cli.eval_main, ["--workdir", "lm"]),
    (cli.compare_main, ["--preset", preset, "--task", "flipflop", "--pe", "rope", "--seeds", "0,1",
                        "--workdir", "cmp"]),
    (curves.main, ["cmp", "--out", "curves"]),
]
for main, argv in commands:
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    sys.stdout.flush()
    if status:
        sys.exit(f"{main.__module__}.{main.__name__} {argv}: exit status {status}")
"""
OUTPUTS = ("lm/config.json", "lm/corpus.json", "lm/result.md", "lm/eval.json", "lm/eval.md", "cmp/compare.md",
           "curves/curves.md")


def test_the_clis_under_an_ascii_locale_write_what_they_write_under_utf8(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, name in enumerate(("café", "naïve", "Straße")):
        (corpus / f"{name} {i}.txt").write_text(f"{name}: ünïcödé — × ≤ ± · {i}\n" * 40, encoding="utf-8")
    preset = tmp_path / "tiny.json"
    preset.write_text(json.dumps(PRESET, ensure_ascii=False), encoding="utf-8")
    processes = {}
    for name, env in (("utf8", UTF8), ("ascii", ASCII)):
        (tmp_path / name).mkdir()
        processes[name] = subprocess.Popen([sys.executable, "-c", DRIVER, str(preset), str(corpus)],
                                           cwd=tmp_path / name, env=cli_env(**env), stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE)
    out = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, f"{name}: {stderr.decode(errors='replace')[-3000:]}"
        out[name] = stdout.decode("ascii" if name == "ascii" else "utf-8")
    for output in OUTPUTS:
        assert ((tmp_path / "ascii" / output).read_text(encoding="utf-8")
                == (tmp_path / "utf8" / output).read_text(encoding="utf-8")), output
    assert "±" in (tmp_path / "utf8/curves/curves.md").read_text(encoding="utf-8")
    assert "·" in out["utf8"] and "\\xb7" in out["ascii"]
    assert out["ascii"] == out["utf8"].encode("ascii", "backslashreplace").decode("ascii")


def test_show_escapes_what_the_stream_cannot_encode():
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    show("a — b ± c\n", stream)
    stream.flush()
    assert raw.getvalue() == b"a \\u2014 b \\xb1 c\n"
    utf8 = io.StringIO()
    show("a — b\n", utf8)
    assert utf8.getvalue() == "a — b\n"


def test_a_checkpoint_path_tensorstore_cannot_take_fails_before_training(tmp_path):
    """Under an ASCII locale a non-ASCII workdir is a str with surrogates, which orbax's TensorStore refuses: one line
    saying what to do, exit 2, before a step is trained (not a traceback once the first save ends)."""
    workdir = os.fsencode(tmp_path) + "/runs/é x".encode()
    command = [os.fsencode(part) for part in cli_command(pathlib.Path("w"), "run.steps=2", "run.checkpoint_every=1")]
    command[command.index(b"w")] = workdir
    result = subprocess.run(command, env=cli_env(**ASCII), capture_output=True, timeout=600)
    err = result.stderr.decode("ascii", "replace")
    assert result.returncode == 2, err
    assert "jaxpe-train: error: checkpoint directory" in err and "PYTHONUTF8=1" in err and "Traceback" not in err
    assert not (pathlib.Path(os.fsdecode(workdir)) / "metrics.jsonl").exists()


def test_the_tensorboard_command_printed_quotes_a_path_with_spaces(tmp_path, capsys):
    workdir = tmp_path / "runs" / "é x"
    (workdir / "tb").mkdir(parents=True)
    cli._print_outputs(workdir, ("tb/",))
    line = capsys.readouterr().err.strip()
    command = line[line.index("(tensorboard ") + 1: -1]
    assert shlex.split(command) == ["tensorboard", "--logdir", str(workdir)]


def test_every_extra_that_pins_jax_admits_the_lowest_jax_of_the_package():
    """The package supports jax from its lowest release, the line Python 3.11 gets (jax >= 0.11 needs Python >= 3.12):
    an extra pinning jax above it (`pip install 'jaxpe[gpu]'`) would find no jax to install on Python 3.11."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (jax,) = [req for req in map(Requirement, project["dependencies"]) if req.name == "jax"]
    (lowest,) = [spec.version for spec in jax.specifier if spec.operator == ">="]
    pins = {f"{extra}: {req}": req.specifier for extra, reqs in project["optional-dependencies"].items()
            for req in map(Requirement, reqs) if req.name == "jax"}
    assert pins, "no extra pins jax"
    assert not [pin for pin, specifier in pins.items() if lowest not in specifier], f"jax {lowest}: {pins}"
