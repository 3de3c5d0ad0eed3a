"""The README and docs/ (the user guides, and the lab reports in docs/reports/) as a reader uses them: the set-up
commands open the README, the README and its results at a glance stay short, every relative link resolves, the
README's Layout names every module, and every Python block runs as written.

A page's Python blocks run in order in one namespace, as a reader pastes them; a block right after a
`<!-- signatures ... -->` comment lists call signatures instead, and each of its keywords and defaults is checked
against the function it names; one right after `<!-- needs a trained run ... -->` reads a jaxpe-train workdir and runs
where a test trains one (the comment names that test).
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 250
MAX_GLANCE_LINES = 15  # "Results at a glance": the headline results; the lab notes live in docs/reports/
SIGNATURES = "<!-- signatures"
NEEDS_RUN = "<!-- needs a trained run"
# The packages whose module files the README's Layout names, and the folders it lists.
PACKAGES = ("jaxpe", "kernels", "train")
FOLDERS = ("jaxpe", "kernels", "train", "benchmarks", "tools", "tests", "notebooks", "results", "docs")
# What a page's blocks assume without defining it: docs/decoding.md continues from a model the reader already has.
PRELUDES = {
    "decoding.md": """
import jax, jaxpe, jaxpe.nnx
from flax import nnx
config = jaxpe.ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2, pe="rope", max_len=16, dropout=0.0)
model = jaxpe.TransformerLM(config)
prompt = jax.random.randint(jax.random.key(0), (2, 4), 3, 32)
params = model.init(jax.random.key(1), prompt)["params"]
nnx_model = jaxpe.nnx.TransformerLM(config, rngs=nnx.Rngs(0))
""",
}


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def code_blocks(text: str) -> list[tuple[str, str, str, str]]:
    """(language, code, the `## ` section it is in, the last non-blank line before it) of every fenced block."""
    blocks, section, before = [], "", ""
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("```"):
            body = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                body.append(inner)
            blocks.append((line[3:].strip(), "\n".join(body) + "\n", section, before))
            before = ""
        elif line.startswith("## "):
            section, before = line[3:].strip(), ""
        elif line.strip():
            before = line.strip()
    return blocks


def without_code(text: str) -> str:
    """The page with its fenced blocks removed (their brackets are code, not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def run_page(path: pathlib.Path) -> dict[str, dict]:
    """Runs a page's Python blocks in order in one namespace; returns the namespace as each `## ` section left it."""
    scope: dict = {}
    exec(compile(PRELUDES.get(path.name, ""), f"{path.name} prelude", "exec"), scope)
    sections: dict[str, dict] = {}
    for language, code, section, before in code_blocks(path.read_text(encoding="utf-8")):
        if language == "python" and not before.startswith((SIGNATURES, NEEDS_RUN)):
            exec(compile(code, _rel(path), "exec"), scope)
            sections[section] = dict(scope)
    return sections


def test_setup_commands_open_the_readme():
    """The first thing a newcomer reads: `make demo` (the main job) and `make test` (what .ci/run calls)."""
    text = README.read_text(encoding="utf-8")
    language, code, section, _ = code_blocks(text)[0]
    assert language == "bash" and section == "", "the README's first block must be the set-up commands"
    assert [line.split("#")[0].strip() for line in code.splitlines()] == ["make demo", "make test"]


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= MAX_README_LINES


def test_results_at_a_glance_is_short():
    """The section's lines between its heading and the next, surrounding blank lines not counted."""
    text = README.read_text(encoding="utf-8").split("\n## Results at a glance\n", 1)[1].split("\n## ", 1)[0]
    assert len(text.strip("\n").splitlines()) <= MAX_GLANCE_LINES


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", without_code(path.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: pathlib.Path):
    """Every relative link points to a file that exists, and every #anchor to a heading of that file."""
    targets = re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text(encoding="utf-8")))
    for target in targets:
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{_rel(page)} links to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(linked), f"{_rel(page)} links to {target}: no such heading"


def _layout() -> str:
    """The tree in the README's Layout section."""
    trees = [code for _, code, section, _ in code_blocks(README.read_text(encoding="utf-8")) if section == "Layout"]
    assert len(trees) == 1, "the README's Layout section holds one tree"
    return trees[0]


def test_layout_names_every_module_and_folder():
    """Layout names every module file of jaxpe/, kernels/ and train/ (and train's subfolders), every top-level folder
    that exists, and no module that does not."""
    layout = _layout()
    named = set(re.findall(r"\b(\w+\.py)\b", layout))
    modules = {p.name for package in PACKAGES for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"}
    assert not modules - named, f"Layout does not name {sorted(modules - named)}"
    existing = {p.name for folder in (*PACKAGES, "tools", "benchmarks") for p in (ROOT / folder).glob("*.py")}
    assert not named - existing, f"Layout names modules that do not exist: {sorted(named - existing)}"
    subfolders = [p.name for p in (ROOT / "train").iterdir() if p.is_dir() and not p.name.startswith("__")]
    folders = [f for f in FOLDERS if (ROOT / f).is_dir()]
    for folder in [*folders, *subfolders]:
        assert re.search(rf"^\s*{folder}/", layout, re.M), f"Layout does not list {folder}/"


def _signature_calls(code: str) -> list[tuple[str, list[str]]]:
    """(dotted name, its argument items) of every `jaxpe.name(...)` in a signature listing, comments dropped."""
    code = "\n".join(line.split("#")[0] for line in code.splitlines())
    calls = []
    for match in re.finditer(r"\bjaxpe\.([\w.]+)\(", code):
        depth, start, items, i = 1, match.end(), [], match.end()
        while depth:
            char = code[i]
            if char in "([{":
                depth += 1
            elif char in ")]}":
                depth -= 1
            if (char == "," and depth == 1) or depth == 0:
                items.append(code[start:i].strip())
                start = i + 1
            i += 1
        calls.append((match.group(1), [item for item in items if item and item != "*"]))
    return calls


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_signature_listings_match_the_functions(page: pathlib.Path):
    """Each argument of a listed signature is a parameter of that function, with the default the listing shows."""
    for language, code, _, before in code_blocks(page.read_text(encoding="utf-8")):
        if language != "python" or not before.startswith(SIGNATURES):
            continue
        calls = _signature_calls(code)
        assert calls, f"{_rel(page)}: a signature listing without a jaxpe call"
        for name, items in calls:
            obj = jaxpe
            for part in name.split("."):
                obj = getattr(obj, part)
            parameters = inspect.signature(obj).parameters
            for item in items:
                arg, _, default = (s.strip() for s in item.partition("="))
                assert arg in parameters, f"{_rel(page)}: jaxpe.{name} has no parameter {arg}"
                if default:
                    assert parameters[arg].default == ast.literal_eval(default), f"jaxpe.{name}({item})"


def check_readme(sections: dict[str, dict]) -> None:
    """The quick starts: the layer keeps the shape and owns CoPE's table, the fused/auto path equals the dense one,
    RoPE is a rotation, and each example is short."""
    layer = sections["Quick start: a layer in your own Flax model"]
    x, y = layer["x"], layer["y"]
    assert y.shape == (2, 32, 64) and y.dtype == jnp.float32 and not np.allclose(x, y)
    assert "pos_emb" in layer["params"]["params"]["Attention_0"]["pe"]
    pure = sections["Quick start: the pure functions"]
    q = pure["q"]
    assert pure["out"].shape == pure["dq"].shape == q.shape == (2, 128, 4, 32)
    np.testing.assert_allclose(pure["out"], pure["dense"], atol=1e-5)
    assert np.isfinite(pure["dq"]).all()
    # A rotation keeps each head's norm, and position 0 does not turn.
    np.testing.assert_allclose(jnp.linalg.norm(pure["rotated"], axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(pure["rotated"][:, 0], q[:, 0], atol=1e-6)
    for language, code, section, _ in code_blocks(README.read_text(encoding="utf-8")):
        if language == "python":
            assert len(code.strip().splitlines()) <= 16, f"README's {section!r} example is longer than a quick start"


def check_layers(sections: dict[str, dict]) -> None:
    """The LM decodes after its prompt, NNX trains and decodes, a left-padded row computes what it computes alone, and
    an encoder layer's first output reads its last token."""
    lm = sections["A Transformer LM and cached decoding"]
    assert lm["logits"].shape == (2, 24, 256) and lm["logits"].dtype == jnp.float32
    assert lm["out"].shape == (2, 24)
    np.testing.assert_array_equal(lm["out"][:, :8], lm["tokens"][:, :8])
    nnx_ = sections["Flax NNX"]
    assert nnx_["y"].shape == (2, 32, 64)
    assert np.isfinite(nnx_["loss"]) and nnx_["model"].deterministic
    assert nnx_["out"].shape == (8, 16)
    np.testing.assert_array_equal(nnx_["out"][:, :8], nnx_["tokens"][:, :8])
    real = sections["Layers for real models"]
    packed, padded, out = real["packed"], real["padded"], real["out"]
    assert packed.shape == padded.shape == (2, 12, 32) and np.isfinite(packed).all()
    assert out.shape == (2, 13)
    alone = real["model"].apply({"params": real["params"]}, real["tokens"][1:, :9])[0]
    np.testing.assert_allclose(padded[1, :9], alone, atol=2e-5)
    assert real["o"].shape == (1, 256, 4, 32)
    assert real["rope"].scaling and real["phi2_like"].rotary_dim == 32
    assert real["x_cope"].talking_heads and real["corope"].rotary_dim == 16
    assert real["sharded"]["embed"]["embedding"].shape == (32, 64)
    encoder = sections["Encoder layers, rematerialisation, dense-path warnings"]
    assert encoder["y"].shape == encoder["y_drop"].shape == (2, 10, 64)
    moved = encoder["encoder"].apply(encoder["enc_params"], encoder["x"].at[:, 9].add(1.0))[:, 0] - encoder["y"][:, 0]
    assert np.abs(moved).max() > 1e-4  # bidirectional: position 0 sees position 9
    assert encoder["long_config"].remat == "dots" and not encoder["long_config"].causal


def check_decoding(sections: dict[str, dict]) -> None:
    """generate keeps the prompt and returns per-row lengths; the jitted sampler runs with a traced temperature."""
    first = sections[""]
    lengths = first["lengths"]
    assert first["tokens"].shape == (2, 4 + 64) and lengths.shape == (2,) and ((lengths >= 1) & (lengths <= 64)).all()
    np.testing.assert_array_equal(first["tokens"][:, :4], first["prompt"])
    jitted = sections["jit"]
    out = jitted["sample"](jitted["params"], jitted["prompt"], 0.7, jax.random.key(3))
    assert out.shape == (2, 4 + 32)


# What a page's blocks must have computed, beyond running.
CHECKS = {"README.md": check_readme, "layers.md": check_layers, "decoding.md": check_decoding}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_blocks_run_and_compute_what_they_say(page: pathlib.Path):
    """Every Python block of the page runs in order (one run per page, also under xdist); then its checks."""
    sections = run_page(page)
    if page.name in CHECKS:
        CHECKS[page.name](sections)
