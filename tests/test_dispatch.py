"""impl="auto": the fused kernels where they compile, otherwise blockwise with one warning that says why."""
from __future__ import annotations

import json
import types
from pathlib import Path
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpe
from jaxpe import dispatch
from jaxpe.kernels._common import MAX_HEAD_DIM, pallas_unsupported
from jaxpe.kernels.cope_pallas import cope_attention_pallas
from jaxpe.kernels.corope_pallas import corope_attention_pallas

BENCH = Path(__file__).resolve().parent.parent / "results" / "bench" / "auto_dispatch_cpu.json"


@pytest.mark.parametrize("backend, capability, head_dim, words", [
    ("tpu", None, 64, "'tpu'"),
    ("gpu", "gfx90a", 64, "not an NVIDIA"),
    ("gpu", "7.5", 64, "below 8.0"),
    ("gpu", "9.0", MAX_HEAD_DIM + 32, f"D={MAX_HEAD_DIM + 32}"),
])
def test_pallas_unsupported_says_why(backend, capability, head_dim, words):
    assert words in pallas_unsupported(head_dim, backend=backend, compute_capability=capability)


@pytest.mark.parametrize("capability", ["8.0", "9.0", "10.0"])
def test_pallas_supported_on_ampere_and_later(capability):
    assert pallas_unsupported(MAX_HEAD_DIM, backend="gpu", compute_capability=capability) is None


def fake_backend(monkeypatch, backend: str, capability: str | None) -> None:
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(dispatch.jax, "devices", lambda: [types.SimpleNamespace(compute_capability=capability)])
    dispatch._warn_once.cache_clear()


def test_auto_on_cuda_is_pallas(monkeypatch):
    fake_backend(monkeypatch, "gpu", "9.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.resolve_impl("auto", 4096, 128, encoding="cope", batch_heads=8) == "pallas"


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_on_cpu_is_silent_and_picks_by_length(monkeypatch, encoding):
    fake_backend(monkeypatch, "cpu", None)
    threshold = dispatch.BLOCKWISE_MIN_LENGTH[encoding]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if threshold > 1:
            assert dispatch.resolve_impl("auto", threshold - 1, 64, encoding=encoding, batch_heads=8) == "reference"
        assert dispatch.resolve_impl("auto", threshold, 64, encoding=encoding, batch_heads=8) == "blockwise"


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_on_cpu_keeps_dense_within_its_memory_budget(monkeypatch, encoding):
    fake_backend(monkeypatch, "cpu", None)
    length = dispatch.BLOCKWISE_MIN_LENGTH[encoding] - 1
    most = dispatch.DENSE_MAX_ENTRIES // length**2
    if most >= 1:
        assert dispatch.resolve_impl("auto", length, 64, encoding=encoding, batch_heads=most) == "reference"
    assert dispatch.resolve_impl("auto", length, 64, encoding=encoding, batch_heads=most + 1) == "blockwise"


def test_cpu_thresholds_are_the_committed_measurement():
    """The lengths auto switches at are the crossovers benchmarks/auto_dispatch.py measured and committed: from
    there on blockwise's forward+backward was no slower (within its tie margin) at every longer measured length,
    just below it dense was faster."""
    report = json.loads(BENCH.read_text())
    assert report["device"]["backend"] == "cpu"
    for encoding in dispatch.ENCODINGS:
        rows = sorted((row["length"], row["ratio_fwd+bwd"]) for row in report["rows"] if row["op"] == encoding)
        assert rows, encoding
        want = dispatch.BLOCKWISE_MIN_LENGTH[encoding]
        assert report["crossover"][encoding] == want
        assert all(ratio <= report["tie"] for length, ratio in rows if length >= want), (encoding, rows)
        below = [ratio for length, ratio in rows if length < want]
        assert not below or below[-1] > report["tie"], (encoding, rows)


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
@pytest.mark.parametrize("backend, capability", [("cpu", None), ("gpu", "9.0")])
def test_auto_with_a_symbolic_length_is_blockwise(monkeypatch, encoding, backend, capability):
    fake_backend(monkeypatch, backend, capability)
    (length,) = jax.export.symbolic_shape("l")
    assert dispatch.resolve_impl("auto", length, 64, encoding=encoding, batch_heads=8) == "blockwise"


def test_unknown_encoding_is_named():
    with pytest.raises(ValueError, match="encoding='rope'"):
        dispatch.resolve_impl("auto", 128, 64, encoding="rope", batch_heads=8)


@pytest.mark.parametrize("backend, capability", [("tpu", None), ("gpu", "gfx942"), ("gpu", "7.0")])
def test_auto_elsewhere_falls_back_to_blockwise_with_one_warning(monkeypatch, backend, capability):
    fake_backend(monkeypatch, backend, capability)
    with pytest.warns(RuntimeWarning, match="'blockwise' path instead of the fused 'pallas'") as record:
        for _ in range(3):
            assert dispatch.resolve_impl("auto", 128, 64, encoding="corope", batch_heads=8) == "blockwise"
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1


def test_explicit_impl_is_kept(monkeypatch):
    fake_backend(monkeypatch, "tpu", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.resolve_impl("reference", 128, 64, encoding="cope", batch_heads=8) == "reference"
        assert dispatch.resolve_impl("pallas", 128, 64, encoding="corope", batch_heads=8) == "pallas"


def test_auto_fallback_computes_the_same_attention(monkeypatch):
    """On a (pretend) TPU, impl="auto" runs blockwise and still matches the dense reference."""
    kq, kk, kv, ke = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(kq, (1, 40, 4, 16))
    k = jax.random.normal(kk, (1, 40, 2, 16))
    v = jax.random.normal(kv, (1, 40, 2, 16))
    pos_emb = jax.random.normal(ke, (9, 16))
    want_cope = jaxpe.cope_attention(q, k, v, pos_emb, impl="reference")
    want_corope = jaxpe.corope_attention(q, k, v, impl="reference")
    fake_backend(monkeypatch, "tpu", None)
    with pytest.warns(RuntimeWarning, match="'tpu'"):
        got_cope = jaxpe.cope_attention(q, k, v, pos_emb, impl="auto")
        got_corope = jaxpe.corope_attention(q, k, v, impl="auto")
    np.testing.assert_allclose(got_cope, want_cope, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got_corope, want_corope, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernel", ["cope", "corope"])
def test_fused_kernels_share_the_head_dim_limit(kernel):
    d = MAX_HEAD_DIM + 2
    q = jnp.zeros((1, 16, 2, d))
    with pytest.raises(ValueError, match=f"head dim D={d} must be in \\[1, {MAX_HEAD_DIM}\\]"):
        if kernel == "cope":
            cope_attention_pallas(q, q, q, jnp.zeros((4, d)), sm_scale=1.0)
        else:
            corope_attention_pallas(q, q, q, theta=10000.0, sm_scale=1.0)
