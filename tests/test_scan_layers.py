"""Stacks of jaxpe layers under scan-over-layers equal the same layers applied one after another in a Python loop,
forward and gradient: linen `nn.scan` (no `metadata_params` needed) and Flax NNX's recipe (`nnx.split_rngs` +
`nnx.vmap` to build the stack, `nnx.scan` to run it)."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpe
import jaxpe.nnx

N, B, L, D_MODEL = 2, 2, 8, 16
HEADS = dict(num_heads=2, num_kv_heads=2, head_dim=8)
ENCODINGS = ["cope", "corope", "rope", "relative", "alibi"]
TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)


class Residual(nn.Module):
    """One layer as a scan body: (x, None) -> (x + attention(x), None)."""

    pe: str

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return x + jaxpe.Attention(**HEADS, pe=self.pe, max_len=16, name="attn")(x), None


def inputs() -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(1), (B, L, D_MODEL))


def layer(params: dict, i: int) -> dict:
    """Layer i of a stack: every array sliced at i on its leading axis."""
    return jax.tree.map(lambda p: p[i], params)


def output_and_grad(forward):
    """params -> (forward(params), gradient of the mean square of it)."""
    loss = lambda p: (jnp.mean(forward(p) ** 2), forward(p))  # noqa: E731
    return lambda p: jax.grad(loss, has_aux=True)(p)[::-1]


def stacked_attention(pe: str, rngs: nnx.Rngs, *, dropout: float = 0.0) -> jaxpe.nnx.Attention:
    """N jaxpe.nnx.Attention layers built by Flax's recipe: split the rngs N ways, vmap the constructor."""

    @nnx.jit  # one compiled program instead of the vmapped init op by op
    @nnx.split_rngs(splits=N)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> jaxpe.nnx.Attention:
        return jaxpe.nnx.Attention(D_MODEL, **HEADS, pe=pe, max_len=16, dropout=dropout, rngs=rngs,
                                   deterministic=True)

    return create(rngs)


@nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
def run_stack(attention: jaxpe.nnx.Attention, x: jax.Array) -> jax.Array:
    return x + attention(x)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_scan_over_layers_equals_a_loop(pe):
    """The same N layers three ways: NNX nnx.scan over a stack made by Flax's recipe, linen nn.scan with that stack's
    parameters, and a Python loop over the layers; outputs and gradients agree."""
    x = inputs()
    layers = stacked_attention(pe, nnx.Rngs(params=0))  # no dropout stream: parameters are all the state
    params = {"attn": layers.linen_params()}
    chex.assert_shape(params["attn"]["query"]["kernel"], (N, D_MODEL, 2, 8))
    assert not np.allclose(params["attn"]["query"]["kernel"][0], params["attn"]["query"]["kernel"][1])
    stack = nn.scan(Residual, variable_axes={"params": 0}, split_rngs={"params": True}, length=N)(pe)
    boxed = jax.eval_shape(stack.init, jax.random.PRNGKey(0), x, None)["params"]  # no metadata_params needed
    chex.assert_trees_all_equal_shapes(nn.meta.unbox(boxed), params)
    assert nn.get_partition_spec(boxed)["attn"]["query"]["kernel"] == jax.sharding.PartitionSpec(
        None, "embed", "heads", "head_dim")

    def loop(p: dict) -> jax.Array:
        y = x
        for i in range(N):
            y = Residual(pe).apply({"params": layer(p, i)}, y, None)[0]
        return y

    graph, state = nnx.split(layers)
    nnx_params = lambda p: jax.tree.map(lambda v: v[...], nnx.to_pure_dict(p)["params"])  # noqa: E731

    @jax.jit  # one compiled program for the three
    def three_ways(p: dict, s: nnx.State) -> tuple:
        return (output_and_grad(loop)(p), output_and_grad(lambda p: stack.apply({"params": p}, x, None)[0])(p),
                output_and_grad(lambda s: run_stack(nnx.merge(graph, s), x))(s))

    (expected_y, expected_grads), (y, grads), (nnx_y, nnx_grads) = three_ways(params, state)
    chex.assert_trees_all_close(y, expected_y, **TOL)
    chex.assert_trees_all_close(grads, expected_grads, **GRAD_TOL)
    chex.assert_trees_all_close(nnx_y, expected_y, **TOL)
    chex.assert_trees_all_close(nnx_params(nnx_grads), expected_grads["attn"], **GRAD_TOL)


def test_a_named_stacked_axis_goes_into_the_partition_specs():
    named = nn.scan(Residual, variable_axes={"params": 0}, split_rngs={"params": True}, length=N,
                    metadata_params={nn.PARTITION_NAME: "layers"})("cope")
    specs = nn.get_partition_spec(jax.eval_shape(named.init, jax.random.PRNGKey(0), inputs(), None))
    assert specs["params"]["attn"]["out"]["kernel"] == jax.sharding.PartitionSpec("layers", "heads", "head_dim",
                                                                                   "embed")
    assert specs["params"]["attn"]["pe"]["pos_emb"] == jax.sharding.PartitionSpec("layers", "positions", "head_dim")


def test_stacked_layers_hold_their_own_dropout_keys():
    """Each stacked layer draws dropout masks from its own stream: training under nnx.scan equals the loop that hands
    layer i the first key of stream i."""
    layers = stacked_attention("rope", nnx.Rngs(0), dropout=0.5)
    keys = layers.rngs.key[...]
    assert keys.shape == (N,) and len({tuple(np.ravel(k)) for k in np.asarray(jax.random.key_data(keys))}) == N
    x, params = inputs(), layers.linen_params()
    first_keys = [nnx.RngStream(keys[i], tag="dropout")() for i in range(N)]

    @jax.jit
    def loop(dropout_keys: list[jax.Array]) -> jax.Array:
        y = x
        for i in range(N):
            y = y + layers.linen.apply({"params": layer(params, i)}, y, deterministic=False,
                                       rngs={"dropout": dropout_keys[i]})
        return y

    expected = loop(first_keys)
    layers.train()
    chex.assert_trees_all_close(run_stack(layers, x), expected, **TOL)
    assert not np.allclose(expected, loop([first_keys[0]] * N))  # the layers' masks differ


def test_cores_and_embeddings_stack():
    """The encodings' own NNX modules follow the same recipe: a stack of CoPE cores scanned over q, and a stack of
    learned position tables scanned over x, equal their loops."""

    @nnx.jit
    @nnx.split_rngs(splits=N)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def cores(rngs: nnx.Rngs) -> jaxpe.nnx.AttentionCore:
        return jaxpe.nnx.core("cope", **HEADS, d_model=D_MODEL, max_len=16, rngs=rngs)

    @nnx.jit
    @nnx.split_rngs(splits=N)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def tables(rngs: nnx.Rngs) -> jaxpe.nnx.PositionEmbedding:
        return jaxpe.nnx.embedding("learned", d_model=D_MODEL, max_len=16, rngs=rngs)

    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, L, 2, 8)) for i in (2, 3, 4))
    ctx = jaxpe.AttentionContext(x=inputs(), q_pos=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))
    stack = cores(nnx.Rngs(0))
    scanned = nnx.scan(lambda core, h: core(h, k, v, ctx), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(stack, q)

    @jax.jit
    def loop(params: dict) -> jax.Array:
        h = q
        for i in range(N):
            h = stack.linen.apply({"params": layer(params, i)}, h, k, v, ctx)
        return h

    chex.assert_trees_all_close(scanned, loop(stack.linen_params()), **TOL)

    stack, x = tables(nnx.Rngs(0)), inputs()
    scanned = nnx.scan(lambda emb, h: emb(h), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(stack, x)
    np.testing.assert_allclose(scanned, x + jnp.sum(stack.linen_params()["table"][:, :L], axis=0)[None],
                               atol=1e-6, rtol=1e-6)
