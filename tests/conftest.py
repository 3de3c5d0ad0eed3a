"""Shared test settings: 8 simulated CPU devices, strict rank promotion, Triton's interpreter without a GPU, a `key`
fixture."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

ON_GPU = jax.default_backend() == "gpu"
# Without a GPU the native Triton kernels (impl="triton") run in Triton's interpreter, which is chosen when triton is
# first imported (jaxpe imports it only for impl="triton"). TRITON_INTERPRET=0 keeps them compiled: lowering for CUDA.
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when no GPU backend is present."""
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def key() -> jax.Array:
    return jax.random.PRNGKey(0)
