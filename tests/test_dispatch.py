"""impl="auto": the fused kernels where they compile, otherwise blockwise with one warning that says why; traced on
CPU with a CUDA plugin installed, the fused kernels for CUDA and the CPU choice elsewhere (`lax.platform_dependent`).
impl="triton": named by the extra it needs when it cannot run, refused where "pallas" is."""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

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


def fake_backend(monkeypatch, backend: str, capability: str | None, *, cuda_plugin: bool = False,
                 jax_triton: bool = False) -> None:
    """jax on `backend` (a device of that compute capability), with or without a CUDA plugin and with or without
    jax-triton compiling Triton kernels."""
    monkeypatch.setattr(dispatch, "triton_compiles", lambda: jax_triton)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(dispatch.jax, "devices", lambda: [types.SimpleNamespace(compute_capability=capability)])
    monkeypatch.setattr(dispatch, "_cuda_plugin_installed", lambda: cuda_plugin)
    dispatch._warn_once.cache_clear()


def same(impl: str) -> dispatch.Choice:
    return dispatch.Choice(impl, impl)


@pytest.mark.parametrize("cuda_plugin", [False, True])
@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_on_cuda_is_triton_with_jax_triton_else_pallas(monkeypatch, cuda_plugin, encoding):
    """On a GPU one impl for every platform, plugin or not: the native Triton kernels where jax-triton compiles
    them, else the Pallas ones; blockwise for inputs that path refuses, never the slower Pallas kernels where the
    native ones are installed; silently."""
    resolve = functools.partial(dispatch.resolve_impl, "auto", 4096, 128, encoding=encoding, batch_heads=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fake_backend(monkeypatch, "gpu", "9.0", cuda_plugin=cuda_plugin)
        assert resolve() == same("pallas")
        fake_backend(monkeypatch, "gpu", "9.0", cuda_plugin=cuda_plugin, jax_triton=True)
        assert resolve() == same("triton")
        assert resolve(kernel_refusal=lambda fused: "refused" if fused == "triton" else None) == same("blockwise")
        assert resolve(kernel_refusal=lambda fused: "refused") == same("blockwise")
        assert resolve(causal=False) == same("blockwise")
        fake_backend(monkeypatch, "gpu", "9.0", cuda_plugin=cuda_plugin)
        assert resolve(kernel_refusal=lambda fused: "refused" if fused == "pallas" else None) == same("blockwise")


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_asks_the_triton_kernels_what_they_refuse(monkeypatch, encoding):
    """On a GPU with jax-triton, "auto" asks the fused kernels whether they take the inputs (not float64 under
    x64: those run blockwise): the refusal is the one their entry points make, not a list kept here."""
    pytest.importorskip("triton")
    fake_backend(monkeypatch, "gpu", "9.0", jax_triton=True)
    asked = []

    def resolve(impl, *args, kernel_refusal=None, **kwargs):
        asked.append({fused: kernel_refusal(fused) for fused in ("triton", "pallas")} if kernel_refusal else {})
        return dispatch.Choice("reference", "reference")  # run nothing fused on this CPU

    monkeypatch.setattr(importlib.import_module(f"jaxpe.{encoding}"), "resolve_impl", resolve)
    with jax.enable_x64(True):
        q, k, v, e = (x.astype(jnp.float64) for x in inputs(16))
        attention(encoding)(q, k, v, e)
    for fused in ("triton", "pallas"):
        assert isinstance(asked[-1][fused], TypeError) and f"float64 is not supported by impl='{fused}'" in str(
            asked[-1][fused])


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_on_cpu_is_silent_and_picks_by_length(monkeypatch, encoding):
    fake_backend(monkeypatch, "cpu", None)
    threshold = dispatch.BLOCKWISE_MIN_LENGTH[encoding]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if threshold > 1:
            assert dispatch.resolve_impl("auto", threshold - 1, 64, encoding=encoding, batch_heads=8) == same(
                "reference")
        assert dispatch.resolve_impl("auto", threshold, 64, encoding=encoding, batch_heads=8) == same("blockwise")


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_on_cpu_keeps_dense_within_its_memory_budget(monkeypatch, encoding):
    fake_backend(monkeypatch, "cpu", None)
    length = dispatch.BLOCKWISE_MIN_LENGTH[encoding] - 1
    most = dispatch.DENSE_MAX_ENTRIES // length**2
    if most >= 1:
        assert dispatch.resolve_impl("auto", length, 64, encoding=encoding, batch_heads=most) == same("reference")
    assert dispatch.resolve_impl("auto", length, 64, encoding=encoding, batch_heads=most + 1) == same("blockwise")


def test_cpu_thresholds_are_the_committed_measurement():
    """The lengths auto switches at are the crossovers benchmarks/auto_dispatch.py measured and committed: from
    there on blockwise's forward+backward was no slower (within its tie margin) at every longer measured length,
    just below it dense was faster."""
    report = json.loads(BENCH.read_text(encoding="utf-8"))
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
@pytest.mark.parametrize("backend, capability, cuda_plugin", [("cpu", None, False), ("cpu", None, True),
                                                              ("gpu", "9.0", True)])
def test_auto_with_a_symbolic_length_is_blockwise(monkeypatch, encoding, backend, capability, cuda_plugin):
    fake_backend(monkeypatch, backend, capability, cuda_plugin=cuda_plugin)
    (length,) = jax.export.symbolic_shape("l")
    assert dispatch.resolve_impl("auto", length, 64, encoding=encoding, batch_heads=8) == same("blockwise")


def test_unknown_encoding_is_named():
    with pytest.raises(ValueError, match="encoding='rope'"):
        dispatch.resolve_impl("auto", 128, 64, encoding="rope", batch_heads=8)


@pytest.mark.parametrize("backend, capability", [("tpu", None), ("gpu", "gfx942"), ("gpu", "7.0")])
def test_auto_elsewhere_falls_back_to_blockwise_with_one_warning(monkeypatch, backend, capability):
    fake_backend(monkeypatch, backend, capability)
    with pytest.warns(RuntimeWarning, match="'blockwise' path instead of the fused 'pallas'") as record:
        for _ in range(3):
            assert dispatch.resolve_impl("auto", 128, 64, encoding="corope", batch_heads=8) == same("blockwise")
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1


def test_explicit_impl_is_kept(monkeypatch):
    fake_backend(monkeypatch, "tpu", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for impl in ("reference", "blockwise", "pallas", "triton"):
            assert dispatch.resolve_impl(impl, 128, 64, encoding="cope", batch_heads=8) == same(impl)


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


# --- "auto" traced on CPU with a CUDA plugin: the fused kernels for CUDA, the CPU choice elsewhere ------------------

PALLAS_CALL = "@__gpu$xla.gpu.triton("  # a Pallas kernel lowered to Triton, in StableHLO
B, L, HQ, HKV, D, NPOS = 2, 150, 4, 2, 8, 12  # L apart from every other size: a [.., L/3.., L] array is quadratic
SHARDED = (P("x"),) * 3 + (P(),)  # q, k, v (and their gradients) split over the batch, the table replicated


def quadratic_arrays(module: str, length: int) -> set[str]:
    """The tensor types in StableHLO text that are quadratic in `length`: one dim equal to it and another of at least a
    third of it (the dense path's causal query blocks)."""
    found = set()
    for shape in re.findall(r"tensor<((?:\d+x)+)[a-z]", module):
        dims = sorted(int(d) for d in shape.rstrip("x").split("x"))
        if length in dims and len(dims) > 1 and dims[-2] >= length // 3:
            found.add(shape)
    return found


def on_abstract_h100() -> jax.sharding.AbstractMesh:
    """An abstract mesh of one H100, to trace and lower for CUDA without a GPU: jax >= 0.12 reads the GPU generation
    from its device when no GPU is present (earlier versions do not ask)."""
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=h100)


def attention(encoding: str, impl: str = "auto") -> Callable:
    if encoding == "cope":
        return lambda q, k, v, e: jaxpe.cope_attention(q, k, v, e, impl=impl)
    return lambda q, k, v, e: jaxpe.corope_attention(q, k, v, impl=impl)


def grads(encoding: str, impl: str = "auto") -> Callable:
    return grads_of(attention(encoding, impl))


def grads_of(fn: Callable) -> Callable:
    return jax.grad(lambda q, k, v, e: jnp.sum(jnp.sin(fn(q, k, v, e))), argnums=(0, 1, 2, 3))


def inputs(length: int = L, lead: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
    kq, kk, kv, ke = jax.random.split(jax.random.PRNGKey(1), 4)
    return (jax.random.normal(kq, (*lead, B, length, HQ, D)), jax.random.normal(kk, (*lead, B, length, HKV, D)),
            jax.random.normal(kv, (*lead, B, length, HKV, D)), 0.3 * jax.random.normal(ke, (NPOS, D)))


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_on_cpu_with_a_cuda_plugin_stages_the_fused_kernels_for_cuda(monkeypatch, encoding):
    """Traced on CPU with a CUDA plugin (without jax-triton), "auto" is "pallas" for CUDA (an H100 is assumed) and
    the CPU choice for the other platforms; bidirectional calls, heads over the kernels' limit and inputs the kernel
    refuses run blockwise on CUDA. Silently: nothing here is a fallback on the machine itself."""
    fake_backend(monkeypatch, "cpu", None, cuda_plugin=True)
    short = dispatch.BLOCKWISE_MIN_LENGTH[encoding] - 1
    resolve = functools.partial(dispatch.resolve_impl, "auto", encoding=encoding, batch_heads=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(short, 64) == ("pallas", "reference")
        assert resolve(4096, 64) == ("pallas", "blockwise")
        assert resolve(4096, 64, causal=False) == same("blockwise")
        assert resolve(4096, MAX_HEAD_DIM + 32) == same("blockwise")
        assert resolve(4096, 64, kernel_refusal=lambda fused: "refused") == same("blockwise")
        assert resolve(short, 64, dense=True) == same("reference")


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_lowers_the_fused_kernels_for_cuda_and_the_cpu_choice_for_cpu(monkeypatch, encoding):
    """One trace of a training gradient, lowered for CUDA: the Pallas forward and its fused backward, no quadratic
    array (the dense CPU branch is rematerialised, so its residuals are not zero-filled outputs of the CUDA one);
    lowered for CPU: no kernel, and the values without a plugin."""
    args = inputs()
    want = jax.jit(grads(encoding))(*args)
    monkeypatch.setattr(dispatch, "_cuda_plugin_installed", lambda: True)
    with jax.sharding.use_abstract_mesh(on_abstract_h100()):
        traced = jax.jit(grads(encoding)).trace(*args)
        cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count(PALLAS_CALL) == 2
    assert not quadratic_arrays(cuda, L)
    cpu = traced.lower(lowering_platforms=("cpu",))
    assert PALLAS_CALL not in cpu.as_text()
    for got_g, want_g in zip(cpu.compile()(*args), want):
        np.testing.assert_allclose(got_g, want_g, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("jax_triton", [False, True])
@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_lowered_for_cuda_runs_float64_blockwise(monkeypatch, encoding, jax_triton):
    """float64 under x64, which every fused kernel refuses, lowered for CUDA: "auto" stages blockwise there, no kernel
    at all, with jax-triton (the native kernels first) or without (the Pallas ones; CoPE's once staged them)."""
    monkeypatch.setattr(dispatch, "_cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(dispatch, "triton_compiles", lambda: jax_triton)
    with jax.enable_x64(True), jax.sharding.use_abstract_mesh(on_abstract_h100()):
        args = tuple(x.astype(jnp.float64) for x in inputs(64))
        cuda = jax.jit(grads(encoding)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert PALLAS_CALL not in cuda and "f64" in cuda


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_auto_staged_for_cuda_runs_under_transformations(monkeypatch, encoding):
    """With the CUDA branch staged (`lax.platform_dependent`), the gradient under vmap and shard_map, lax.scan and
    jax.export for CPU run the CPU choice here: the values without a plugin."""
    q, k, v, e = inputs(16, lead=(2,))
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def run() -> tuple:
        grad = grads(encoding)
        transformed = jax.jit(lambda q, k, v, e: (
            jax.vmap(grad, in_axes=(0, 0, 0, None))(q, k, v, e),
            jax.lax.scan(lambda c, x: (c, attention(encoding)(*x, e)), 0.0, (q, k, v))[1],
            jax.shard_map(grad, mesh=mesh, in_specs=SHARDED, out_specs=SHARDED)(q[0], k[0], v[0], e)))
        exported = jax.export.export(jax.jit(attention(encoding)))(q[0], k[0], v[0], e)
        return transformed(q, k, v, e), exported.call(q[0], k[0], v[0], e)

    want = run()
    monkeypatch.setattr(dispatch, "_cuda_plugin_installed", lambda: True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6), run(), want)


def test_auto_staged_for_cuda_limits(monkeypatch):
    """Both branches are traced and transformed. Forward mode runs on CPU (the CUDA branch's tangent, which the fused
    kernels' custom VJP cannot give, is never lowered there); a second derivative fails while tracing the CUDA branch
    (as through "pallas"); one export for CPU and CUDA together fails, because jax lowers every branch of a
    `lax.platform_dependent` for each platform and pallas_call has no compiled CPU lowering."""
    q, k, v, e = inputs(24)
    tangents = tuple(jnp.ones_like(x) for x in (q, k, v, e))
    forward_mode = lambda: jax.jit(lambda *p: jax.jvp(attention("cope"), p, tangents))(q, k, v, e)  # noqa: E731
    want = forward_mode()
    monkeypatch.setattr(dispatch, "_cuda_plugin_installed", lambda: True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6), forward_mode(), want)
    second_order = jax.grad(lambda x: jnp.sum(grads("cope")(x, k, v, e)[0]))
    with pytest.raises(NotImplementedError, match="differentiable once"):
        jax.jit(second_order).trace(q)
    with pytest.raises(ValueError, match="interpret mode"):
        jax.export.export(jax.jit(attention("cope")), platforms=("cpu", "cuda"))(q, k, v, e)


# --- impl="triton" -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [*dispatch.ENCODINGS, "stickbreaking"])
def test_triton_without_triton_names_the_extra(monkeypatch, encoding):
    for name in ("triton", "jax_triton"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: find_spec gives None, import fails
    run = attention(encoding, "triton") if encoding in dispatch.ENCODINGS else \
        lambda q, k, v, e: jaxpe.stickbreaking_attention(q, k, v, impl="triton")
    with pytest.raises(ValueError, match=re.escape("pip install 'jaxpe[triton]'")):
        run(*inputs(16))


def test_jaxpe_imports_and_runs_without_triton(tmp_path):
    """jaxpe imports and runs without triton installed; impl="triton" names the extra, from a model config too."""
    code = """
import sys
sys.modules["triton"] = sys.modules["jax_triton"] = None
import jax, jax.numpy as jnp
import jaxpe
q = jnp.ones((1, 8, 2, 8))
jaxpe.corope_attention(q, q, q)
model = jaxpe.TransformerLM(jaxpe.ModelConfig(vocab_size=11, d_model=16, num_layers=1, num_heads=2, max_len=16,
                                              pe="corope", impl="triton"))
try:
    jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
except ValueError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=tmp_path)  # not the checkout's jaxpe/
    assert result.returncode == 0, result.stderr
    assert "pip install 'jaxpe[triton]'" in result.stdout, result.stdout


def triton_entries() -> None:
    """Skip unless the native Triton kernels exist (they run in Triton's interpreter here)."""
    for encoding in dispatch.ENCODINGS:
        pytest.importorskip(f"jaxpe.kernels.{encoding}_triton", reason=f"kernels/{encoding}_triton.py not there yet")


def model(pe: str, impl: str) -> jaxpe.TransformerLM:
    config = jaxpe.ModelConfig(vocab_size=11, d_model=16, num_layers=1, num_heads=2, max_len=16, pe=pe, dropout=0.0,
                               impl=impl)
    return jaxpe.TransformerLM(config)


@pytest.mark.parametrize("pe", ["cope", "corope"])
def test_triton_runs_in_a_model_as_the_reference(pe):
    """impl="triton" goes from the model config to the layers' kernels, as "pallas" does: the training gradient of
    a TransformerLM launches the Triton kernels (here the interpreter's host callbacks), and its loss and parameter
    gradients equal the dense reference's."""
    triton_entries()
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 13), 0, 11)
    params = model(pe, "reference").init(jax.random.PRNGKey(0), tokens)

    def loss(impl: str) -> Callable:
        return lambda p: jnp.mean(jax.nn.log_softmax(model(pe, impl).apply(p, tokens[:, :-1]))[..., 0])

    assert str(jax.make_jaxpr(jax.grad(loss("triton")))(params)).count("pure_callback") == 2  # forward, backward
    got, want = (jax.jit(jax.value_and_grad(loss(impl)))(params) for impl in ("triton", "reference"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4), got, want)


def test_triton_refuses_what_pallas_refuses():
    """Bidirectional attention, CoPE's dense-only variants and symbolic shapes, in the words that name the impl."""
    triton_entries()
    q, k, v, e = inputs(16)
    with pytest.raises(ValueError, match="causal=False is not supported by impl='triton'"):
        jaxpe.cope_attention(q, k, v, e, causal=False, impl="triton")
    with pytest.raises(ValueError, match="causal=False is not supported by impl='triton'"):
        jaxpe.corope_attention(q, k, v, causal=False, impl="triton")
    with pytest.raises(ValueError, match="impl='triton' cannot run CoPE's soft one-hot"):
        jaxpe.cope_attention(q, k, v, e, soft_onehot_temp=0.1, impl="triton")
    batch, length = jax.export.symbolic_shape("b, l")
    for pe in ("cope", "corope"):
        lm = model(pe, "triton")
        params = lm.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
        with pytest.raises(ValueError, match="impl='triton' needs static shapes|symbolic"):
            jax.export.export(jax.jit(lm.apply))(params, jax.ShapeDtypeStruct((batch, length), jnp.int32))


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_triton_under_transformations_on_cpu(encoding):
    """The "triton" column of docs/transformations.md, in Triton's interpreter (a pure_callback per launch): vmap
    (members one after another), remat (saving nothing, saving the dots), lax.scan, eval_shape, x64, float16 and a
    traced sm_scale give the reference's values."""
    triton_entries()
    q, k, v, e = inputs(16)
    stacked = tuple(jnp.stack([x, 0.5 * x]) for x in (q, k, v))

    def scaled(impl: str) -> Callable:
        if encoding == "cope":
            return lambda s: jnp.sum(jnp.sin(jaxpe.cope_attention(q, k, v, e, sm_scale=s, impl=impl)))
        return lambda s: jnp.sum(jnp.sin(jaxpe.corope_attention(q, k, v, sm_scale=s, impl=impl)))

    def remat(impl: str, policy: str) -> tuple[jax.Array, ...]:
        fn = jax.checkpoint(attention(encoding, impl), policy=getattr(jax.checkpoint_policies, policy))
        return jax.jit(grads_of(fn))(q, k, v, e)

    def x64(impl: str) -> jax.Array:
        with jax.enable_x64(True):
            return jax.jit(attention(encoding, impl))(q, k, v, e)

    programs = {
        "vmap": lambda impl: jax.jit(jax.vmap(attention(encoding, impl), in_axes=(0, 0, 0, None)))(*stacked, e),
        **{f"remat {policy}": functools.partial(remat, policy=policy)
           for policy in ("nothing_saveable", "dots_saveable")},
        "scan": lambda impl: jax.jit(lambda *x: jax.lax.scan(lambda c, x: (c, grads(encoding, impl)(*x, e)), 0.0,
                                                             x)[1])(*stacked),
        "eval_shape": lambda impl: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                jax.eval_shape(attention(encoding, impl), q, k, v, e)),
        "x64": x64,
        "float16": lambda impl: jax.jit(attention(encoding, impl))(*(x.astype(jnp.float16) for x in (q, k, v, e))),
        "traced sm_scale": lambda impl: jax.jit(jax.value_and_grad(scaled(impl)))(0.3),
    }
    for name, run in programs.items():
        got, want = run("triton"), run("reference")
        jax.tree.map(lambda a, b: assert_same_type_and_close(a, b, name), got, want)


def assert_same_type_and_close(got: jax.Array, want: jax.Array, name: str) -> None:
    assert got.dtype == want.dtype, name
    tolerance = 2e-3 if got.dtype == jnp.float16 else 1e-4
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tolerance,
                               rtol=tolerance, err_msg=name)


@pytest.mark.parametrize("encoding", dispatch.ENCODINGS)
def test_triton_refusals_under_transformations_on_cpu(encoding):
    """What the "triton" column marks ✗ on CPU: forward mode (a custom VJP), a second derivative, jax.export (the
    interpreter is a host callback) and, under shard_map's default checks, the gradient (the callback's outputs do
    not carry the mesh axes its inputs vary over)."""
    triton_entries()
    q, k, v, e = inputs(16)
    fn = attention(encoding, "triton")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(fn, (q, k, v, e), (q, k, v, e))
    with pytest.raises(NotImplementedError, match="differentiable once"):
        jax.jit(jax.grad(lambda x: jnp.sum(grads(encoding, "triton")(x, k, v, e)[0]))).trace(q)
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        jax.export.export(jax.jit(fn))(q, k, v, e)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sharded = jax.shard_map(grads(encoding, "triton"), mesh=mesh, in_specs=SHARDED, out_specs=SHARDED)
    with pytest.raises(ValueError, match="manual axis types"):
        jax.jit(sharded).trace(q, k, v, e)


def test_one_table_holds_every_path_of_every_contextual_operation():
    """jaxpe.dispatch.PATHS: each operation has "reference" and "blockwise", CoPE and Co-RoPE both fused paths, FoX and
    stick-breaking the ones UNFUSED_KERNELS names, and nothing else; every entry loads as a function of the one
    signature path(call, compiled)."""
    fused = {op: ("pallas", "triton") for op in dispatch.ENCODINGS} | dict(dispatch.UNFUSED_KERNELS)
    want = {(op, impl) for op, kernels in fused.items() for impl in ("reference", "blockwise", *kernels)}
    assert set(dispatch.PATHS) == want
    for name in dispatch.PATHS.values():
        module, function = name.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name
    for key, name in dispatch.PATHS.items():
        params = list(inspect.signature(dispatch._load(name)).parameters)
        assert params == ["call", "compiled"], (key, params)


@pytest.mark.parametrize("operation", ["cope", "corope", "fox", "stickbreaking"])
def test_every_call_runs_the_path_the_table_names(operation, monkeypatch):
    """Rerouting a table row reroutes the public function: the blockwise row pointed at a function that records its
    call and returns the reference path's output is what jaxpe runs for impl="blockwise" (the operations reach their
    paths through the table only), and the output is then the reference's."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 12, 2, 8))
    seen = []

    def spy(call, compiled):
        seen.append((type(call).__module__, compiled))
        return dispatch.run_path(operation, "reference", call, compiled)

    monkeypatch.setattr(dispatch, "_spy", spy, raising=False)
    monkeypatch.setitem(dispatch.PATHS, (operation, "blockwise"), "jaxpe.dispatch:_spy")
    run = {"cope": lambda impl: jaxpe.cope_attention(q, q, q, jnp.ones((8, 8)) * 0.1, impl=impl),
           "corope": lambda impl: jaxpe.corope_attention(q, q, q, impl=impl),
           "fox": lambda impl: jaxpe.forgetting_attention(q, q, q, -0.1 * jnp.ones(q.shape[:3]), impl=impl),
           "stickbreaking": lambda impl: jaxpe.stickbreaking_attention(q, q, q, impl=impl)}[operation]
    np.testing.assert_allclose(run("blockwise"), run("reference"), atol=1e-6, rtol=1e-6)
    assert seen == [(f"jaxpe.{operation}", False)]
