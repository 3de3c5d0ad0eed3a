"""A whole jaxpe.TransformerLM lowered and exported for CUDA on a machine without a GPU: its forward and its training
step (value_and_grad of the loss), for CoPE, Co-RoPE and the RoPE baseline, with impl "pallas" (Pallas lowered to
Triton), "triton" (native Triton kernels through jax-triton, compiled for an H100) and "auto" (traced on CPU with a
CUDA plugin installed: for CUDA the native Triton kernels where jax-triton compiles them, else the Pallas ones).
Checked in the StableHLO text: the kernel calls, one forward per contextual layer and a forward and one fused backward
per layer in the training step, and no array quadratic in the length on the CoPE and Co-RoPE paths (the RoPE
baseline's dense attention shows that the search finds one).

Needs one of jax's CUDA plugins (for jax-triton, and so that "auto" stages the CUDA branch): `make test-compile` runs
it in .venv-compile with `JAX_PLATFORMS=cpu TRITON_INTERPRET=0`; elsewhere it skips. What remains for a GPU is
compiling these programs and their numerics (`pytest -m gpu`, docs/reports/kernels.md).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import pytest

import jaxpe
from jaxpe.dispatch import CUDA_PLUGINS, triton_compiles

pytestmark = pytest.mark.skipif(
    not any(importlib.util.find_spec(name) for name in CUDA_PLUGINS),
    reason=f"lowering for CUDA through jax-triton and impl='auto' needs a CUDA plugin ({' or '.join(CUDA_PLUGINS)}); "
           f"`make test-compile` runs this file in .venv-compile")

L = 384  # apart from every other size in the model (batch 2, heads 2, D 8, table rows 64, MLP 64, vocab 11)
NUM_LAYERS = 2
VOCAB = 11
PALLAS_CALL = "__gpu$xla.gpu.triton"  # pallas_call lowered to Triton
JAX_TRITON_CALLS = ("triton_kernel_call", "triton_kernel_call_ffi")  # jax-triton's triton_call: 0.3.x, 0.4.x
CUSTOM_CALLS = (PALLAS_CALL, *JAX_TRITON_CALLS)  # none is on jax.export's list of stable custom-call targets
CONTEXTUAL = ("cope", "corope")
TENSOR_SHAPE = r"tensor<((?:\d+x)+)[a-z]"  # the dims of a ranked tensor type, e.g. "2x384x" of tensor<2x384xf32>


def triton_skip_reason() -> str | None:
    """Why the "triton" cases cannot run here (None when they can)."""
    for encoding in CONTEXTUAL:
        if importlib.util.find_spec(f"jaxpe.kernels.{encoding}_triton") is None:
            return f"jaxpe.kernels.{encoding}_triton does not exist yet"
    from jaxpe.kernels import _triton_launch

    reason = _triton_launch.unavailable()
    if reason is None and _triton_launch.interpreted():
        reason = "TRITON_INTERPRET=1 runs Triton's interpreter: set TRITON_INTERPRET=0 to lower through jax-triton"
    return reason


def kernel_calls(module: str, target: str) -> int:
    """How many custom calls of `target` running the module's main makes. jax lowers a jit inside a jit (each
    kernel's entry is one) to a private function that every use calls: count through the calls."""
    own: dict[str, int] = {}
    callees: dict[str, list[str]] = {}
    function = None
    for line in module.splitlines():
        if (header := re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)\(", line)) is not None:
            function = header.group(1)
            own[function], callees[function] = 0, []
        elif function is not None:
            own[function] += line.count(f"@{target}(")
            callees[function] += re.findall(r"(?<!custom_)call @([\w.$-]+)\(", line)

    def total(name: str) -> int:
        return own[name] + sum(total(callee) for callee in callees[name])

    return total("main")


def quadratic_arrays(module: str) -> set[str]:
    """Tensor types quadratic in L: one dim L and another of at least L/3 (the dense path's causal query blocks)."""
    found = set()
    for shape in re.findall(TENSOR_SHAPE, module):
        dims = sorted(int(d) for d in shape.rstrip("x").split("x"))
        if L in dims and len(dims) > 1 and dims[-2] >= L // 3:
            found.add(shape)
    return found


def programs(pe: str, impl: str) -> tuple[dict[str, Callable], dict]:
    """The jitted forward and training step of a small TransformerLM, and its parameters' shapes."""
    options = {"npos": 64} if pe == "cope" else {}
    config = jaxpe.ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=NUM_LAYERS, num_heads=2, max_len=L, pe=pe,
                               pe_options=options, dropout=0.0, impl=impl)
    model = jaxpe.TransformerLM(config)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))  # runs no kernel

    def loss(p: dict, tokens: jax.Array) -> jax.Array:
        logits = model.apply(p, tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    forward = lambda p, tokens: model.apply(p, tokens)  # noqa: E731
    return {"forward": jax.jit(forward), "train_step": jax.jit(jax.value_and_grad(loss))}, params


def on_abstract_h100() -> jax.sharding.AbstractMesh:
    """An abstract mesh of one H100: jax >= 0.12 reads the GPU generation from its device when no GPU is present
    (earlier versions do not ask)."""
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=h100)


def expected_calls(pe: str, impl: str, program: str) -> dict[str, int]:
    """Kernel calls per program: per contextual layer one forward, or in the training step the forward that saves
    residuals and one fused backward; none for RoPE. "auto" lowered for CUDA runs the path jaxpe.dispatch prefers:
    the native Triton kernels where jax-triton compiles them here, else the Pallas ones."""
    per_layer = (1 if program == "forward" else 2) * NUM_LAYERS if pe in CONTEXTUAL else 0
    triton = impl == "triton" or (impl == "auto" and triton_compiles())
    return {"pallas": 0 if triton else per_layer, "jax-triton": per_layer if triton else 0}


@pytest.mark.parametrize("impl", ["pallas", "triton", "auto"])
@pytest.mark.parametrize("pe", [*CONTEXTUAL, "rope"])
def test_model_lowers_and_exports_for_cuda(pe, impl):
    if impl == "triton" and (reason := triton_skip_reason()) is not None:
        pytest.skip(reason)
    jitted, params = programs(pe, impl)
    tokens = jax.ShapeDtypeStruct((2, L + 1), jnp.int32)
    disabled = [jax.export.DisabledSafetyCheck.custom_call(target) for target in CUSTOM_CALLS]
    for program, fn in jitted.items():
        args = (params, tokens) if program == "train_step" else (params, jax.ShapeDtypeStruct((2, L), jnp.int32))
        with jax.sharding.use_abstract_mesh(on_abstract_h100()):
            lowered = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            exported = jax.export.export(fn, platforms=("cuda",), disabled_checks=disabled)(*args)
        assert exported.platforms == ("cuda",)
        for module in (lowered, exported.mlir_module()):
            calls = {"pallas": kernel_calls(module, PALLAS_CALL),
                     "jax-triton": sum(kernel_calls(module, target) for target in JAX_TRITON_CALLS)}
            assert calls == expected_calls(pe, impl, program), (program, calls)
            if pe in CONTEXTUAL:
                assert not quadratic_arrays(module), (program, quadratic_arrays(module))
            else:
                assert quadratic_arrays(module), f"{program}: the RoPE baseline's dense attention was not found"
        restored = jax.export.deserialize(exported.serialize())
        assert restored.mlir_module() == exported.mlir_module()


@pytest.mark.parametrize(("pe", "impl"), [("fox", "pallas"), ("stickbreaking", "pallas"), ("stickbreaking", "triton")])
def test_unfused_encodings_lower_for_cuda_with_their_fused_kernels(pe, impl):
    """Forgetting and stick-breaking attention with a fused path asked for by name ("auto" does not pick those yet),
    traced on CPU: for CUDA the kernels compiled (not Pallas's interpreter), per layer one kernel in the forward, the
    forward that saves residuals and one fused backward in the training step, and no [L, L] array."""
    if impl == "triton" and (reason := triton_skip_reason()) is not None:
        pytest.skip(reason)
    jitted, params = programs(pe, impl)
    target = {"pallas": (PALLAS_CALL,), "triton": JAX_TRITON_CALLS}[impl]
    for program, fn in jitted.items():
        tokens = jax.ShapeDtypeStruct((2, L + (program == "train_step")), jnp.int32)
        with jax.sharding.use_abstract_mesh(on_abstract_h100()):
            module = fn.trace(params, tokens).lower(lowering_platforms=("cuda",)).as_text()
        assert sum(kernel_calls(module, t) for t in target) == (1 if program == "forward" else 2) * NUM_LAYERS
        assert not quadratic_arrays(module), (program, quadratic_arrays(module))


@pytest.mark.parametrize("pe", CONTEXTUAL)
def test_stacked_models_lower_for_cuda_with_the_native_kernels(pe):
    """Seeds trained as one program (jaxpe.train's stacked members) vmap the training step over the models: jax-triton
    refuses vmap, so the native kernels run once a member (a loop in the program); the step lowers for CUDA with the
    same kernel calls in its loop body as one model's step."""
    if (reason := triton_skip_reason()) is not None:
        pytest.skip(reason)
    jitted, params = programs(pe, "triton")
    members = jax.tree.map(lambda s: jax.ShapeDtypeStruct((3, *s.shape), s.dtype), params)
    step = jax.jit(jax.vmap(jitted["train_step"], in_axes=(0, None)))
    with jax.sharding.use_abstract_mesh(on_abstract_h100()):
        module = step.trace(members, jax.ShapeDtypeStruct((2, L + 1), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert sum(kernel_calls(module, target) for target in JAX_TRITON_CALLS) == expected_calls(
        pe, "triton", "train_step")["jax-triton"]
    assert "stablehlo.while" in module and not quadratic_arrays(module)


@pytest.mark.parametrize("pe", CONTEXTUAL)
def test_the_stacked_dispatch_of_the_training_package_lowers_for_cuda(pe):
    """What the GPU sweep runs, jaxpe.train's own program: three seeds stacked, up to K steps a dispatch over the
    training set on the device (Trainer.train_steps), lowered for CUDA with the native kernels in its loops; with
    run.seeds_at_once=1 (a CPU's default) the seeds in turn lower too."""
    if (reason := triton_skip_reason()) is not None:
        pytest.skip(reason)
    import numpy as np

    from jaxpe.train import Trainer, build_config, build_task
    from jaxpe.train.config import build_model, longest_length
    from jaxpe.train.feed import Feed

    config = build_config(task="counting", pe=pe, overrides=[
        "task.seq_len=24", "task.n_train=32", "task.max_steps=5", "model.d_model=16", f"model.num_layers={NUM_LAYERS}",
        "model.num_heads=2", "model.dropout=0.0", "optim.batch_size=8", "run.steps_per_dispatch=4",
        "run.num_devices=1"])
    task = build_task(config)
    model = build_model(config.model, task.vocab_size, longest_length(task))
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    for at_once in (3, 1):  # side by side, as on a GPU; in turn, as on a CPU
        trainer = Trainer(model=model, config=dataclasses.replace(
            config, run=dataclasses.replace(config.run, seeds_at_once=at_once)), seq_len=task.seq_len, seeds=(0, 1, 2))
        chunk = Feed(trainer, task).steps(0, 4)
        module = trainer.train_steps.trace(abstract(jax.eval_shape(trainer.init_state)), abstract(chunk.data),
                                           abstract(chunk.rows), np.int32(chunk.steps), chunk.length).lower(
            lowering_platforms=("cuda",)).as_text()
        assert sum(kernel_calls(module, target) for target in JAX_TRITON_CALLS) == 2 * NUM_LAYERS  # fwd, bwd
        assert kernel_calls(module, PALLAS_CALL) == 0 and "stablehlo.while" in module


FUSION_PROBE = """
import hashlib, sys, jax, jax.numpy as jnp, jaxpe
sys.path.insert(0, {tests!r})
from test_cuda_lowering import on_abstract_h100
q, kv = jax.ShapeDtypeStruct((1, 128, 2, 32), jnp.bfloat16), jax.ShapeDtypeStruct((1, 128, 1, 32), jnp.bfloat16)
loss = lambda q, k, v, e: jnp.sum(jaxpe.cope_attention(q, k, v, e, impl="triton").astype(jnp.float32))
step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
with jax.sharding.use_abstract_mesh(on_abstract_h100()):
    module = step.trace(q, kv, kv, jax.ShapeDtypeStruct((16, 32), jnp.float32)).lower(lowering_platforms=("cuda",))
print(hashlib.sha256(module.as_text().encode()).hexdigest())
"""


def test_native_kernels_ask_for_fp_fusion_whatever_tritons_default():
    """The native kernels are compiled with FMA contraction, as they were timed, whatever Triton's default: jax-triton
    0.4 leaves it to that default, which Triton 3.10 turns off (TRITON_DEFAULT_FP_FUSION=0 sets it so today), so each
    launch asks for it by name. Each setting lowers in a process of its own (jax-triton keeps compiled kernels)."""
    if (reason := triton_skip_reason()) is not None:
        pytest.skip(reason)
    probe = FUSION_PROBE.format(tests=str(pathlib.Path(__file__).parent))
    runs = [subprocess.run([sys.executable, "-c", probe], env={**os.environ, "TRITON_DEFAULT_FP_FUSION": flag},
                           capture_output=True, text=True) for flag in ("0", "1")]
    assert [run.returncode for run in runs] == [0, 0], [run.stderr[-1000:] for run in runs]
    assert runs[0].stdout == runs[1].stdout
