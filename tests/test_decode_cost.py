"""One decoded token costs O(S) for a cache of S positions, for every encoding: read from the decode step's program.

CoPE's and Co-RoPE's positions depend on the current query, so each decoded token recomputes its gates over the
cached keys; that is O(S) work, never O(S²), provided no [.., S, S] array is built. Two readings of one decode step
(one token, batch 1, one layer) at cache lengths S, 2S and 4S:
- its jaxpr: no value with two axes of length >= S, and the total size of all the values it computes grows linearly
  (each doubling of S adds twice what the previous doubling added; a quadratic step would add four times as much);
- for the contextual encodings, the FLOPs of the compiled step (XLA's cost analysis), held to the same rule.
S starts at 512: up to 256 keys CoPE sums its gates with a triangular [S, S] matmul (faster on CPU than a scan; a
cost bounded by 256²), so the asymptotic rule is read above that length.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_harness import equations

import jaxpe

CACHE_LENGTHS = (512, 1024, 2048)  # S, 2S, 4S
CONTEXTUAL = ("cope", "cope_gated", "cope_rope", "corope")


def decode_step(pe: str, cache_len: int):
    """(the decode step as a function of params, cache and one token [1, 1], its abstract arguments)."""
    config = jaxpe.ModelConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_len=4096,
                               pe=pe, dropout=0.0)
    model = jaxpe.TransformerLM(config)
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))))
    cache = jax.eval_shape(lambda: jaxpe.init_cache(model, 1, cache_len))

    def step(params, cache, token):
        return model.apply({**params, "cache": cache}, token, decode=True, mutable=["cache"])

    return step, (params, cache, jax.ShapeDtypeStruct((1, 1), jnp.int32))


def value_shapes(pe: str, cache_len: int) -> list[tuple[int, ...]]:
    """The shapes of every value the decode step's jaxpr computes (nested jaxprs included)."""
    step, args = decode_step(pe, cache_len)
    return [tuple(var.aval.shape) for eqn in equations(jax.make_jaxpr(step)(*args).jaxpr) for var in eqn.outvars
            if hasattr(var.aval, "shape")]


def compiled_flops(pe: str, cache_len: int) -> float:
    step, args = decode_step(pe, cache_len)
    cost = jax.jit(step).trace(*args).lower().compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def growth(costs: list[float]) -> float:
    """(cost(4S) − cost(2S)) / (cost(2S) − cost(S)): 2 for a + b·S, 4 for a + c·S²."""
    small, medium, large = costs
    return (large - medium) / (medium - small)


def test_growth_tells_linear_from_quadratic():
    s = np.array(CACHE_LENGTHS, float)
    assert growth(list(7.0 + 3.0 * s)) == pytest.approx(2.0)
    assert growth(list(7.0 + 3.0 * s + 0.01 * s ** 2)) > 3.0


@pytest.mark.parametrize("pe", jaxpe.PE_NAMES)
def test_decode_step_values_grow_linearly_with_the_cache(pe):
    shapes = {s: value_shapes(pe, s) for s in CACHE_LENGTHS}
    for s, values in shapes.items():
        square = [shape for shape in values if sum(d >= s for d in shape) >= 2]
        assert square == [], f"{pe}: values of shape [.., S, S] at S={s}: {square[:3]}"
    sizes = [sum(int(np.prod(shape)) for shape in shapes[s]) for s in CACHE_LENGTHS]
    assert sizes[1] > sizes[0]  # the step does read the cache
    assert growth(sizes) < 2.5, (pe, sizes)


@pytest.mark.parametrize("pe", CONTEXTUAL)
def test_decode_step_flops_grow_linearly_with_the_cache(pe):
    flops = [compiled_flops(pe, s) for s in CACHE_LENGTHS]
    assert flops[1] > flops[0]
    assert growth(flops) < 2.5, (pe, flops)
