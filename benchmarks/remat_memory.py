"""What `ModelConfig.remat` saves: the temporary memory of a TransformerLM gradient step for each policy, from XLA's
memory analysis of the compiled program (no run, no accelerator needed).

For each encoding and length, compiles `jax.value_and_grad` of the next-token cross-entropy (dropout on) for
remat "none", "dots" and "full", and records `memory_analysis().temp_size_in_bytes`: the peak of the buffers XLA
assigns beside the parameters, inputs and outputs (the activations kept for the backward and the backward's own
work space). Compiled for the machine it runs on (XLA's CPU compiler here; the GPU's schedules differently).
B batch, L length.

    python benchmarks/remat_memory.py --out results/bench/remat_memory.json   # L 4096; rope, cope, corope
    python benchmarks/remat_memory.py --out FILE --lengths 2048,8192 --pe rope
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxpe
from jaxpe.model import REMAT_POLICIES


def measure(config: jaxpe.ModelConfig, length: int, batch: int) -> dict[str, Any]:
    """Temporary bytes of the compiled gradient step of `config` at [batch, length] tokens, for each remat policy."""
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    params = jax.eval_shape(lambda t: jaxpe.TransformerLM(config).init(jax.random.key(0), t), tokens)
    row: dict[str, Any] = {"pe": config.pe, "length": length}
    for remat in REMAT_POLICIES:
        model = jaxpe.TransformerLM(dataclasses.replace(config, remat=remat))

        def loss(params: Any, tokens: jax.Array) -> jax.Array:
            logits = model.apply(params, tokens, deterministic=False, rngs={"dropout": jax.random.key(1)})
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

        analysis = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile().memory_analysis()
        row[f"{remat}_temp_bytes"] = int(analysis.temp_size_in_bytes)
        print(f"{config.pe:>7} L={length:>6} remat={remat:>4}: {analysis.temp_size_in_bytes / 2**20:9.1f} MiB",
              flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--lengths", default="4096", help="comma-separated sequence lengths")
    parser.add_argument("--pe", default="rope,cope,corope", help="comma-separated encoding names")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    # the CoPE paper's counting model (4 layers, width 256, 4 heads), pre-norm
    base = dict(vocab_size=256, d_model=256, num_layers=4, num_heads=4, dropout=0.1)
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        for pe in args.pe.split(","):
            rows.append(measure(jaxpe.ModelConfig(pe=pe, max_len=length, **base), length, args.batch))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__, "python": platform.python_version(),
        "device": f"{jax.devices()[0].platform} (compiled, not run)",
        "config": dict(base, batch=args.batch, lengths=args.lengths, policies=list(REMAT_POLICIES)),
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
