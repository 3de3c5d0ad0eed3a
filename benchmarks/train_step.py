"""One training step of the CoPE paper's counting model, jaxpe next to the official PyTorch code, on this machine.

Config: the official counting generator's jsonl (3 variables, programs of up to 64 statements, ~78
tokens), 2 layers, width 128, 4 heads, block 128, batch 32, post-norm, tied embeddings, dropout 0.1; CoPE, absolute
(learned) and relative positions. Both sides pad a batch to its longest sequence (jaxpe rounds it up to a multiple
of 16, as `run.pad_to="multiple"` does). The official side (facebookresearch/RAM, projects/cope) runs as it is, in
its own PyTorch interpreter, through benchmarks/official_counting_step.py. The official side runs at its default
thread count and at one thread (torch.set_num_threads(1)); jaxpe runs as its entry points do (a CPU device per core,
the batch split over them: jaxpe.train.distributed.split_host_cpu; glibc keeping freed memory:
jaxpe.train._malloc.keep_freed_memory), on one device, and on one device with one thread
(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"), each in a fresh subprocess; the
fastest median of each side counts: on 2 busy cores both can run several times slower with 2 threads. Sides alternate
in rounds so that a change of load hits both. Without PyTorch or a RAM checkout only jaxpe runs, saying why.

    python benchmarks/train_step.py --torch-python TORCH_VENV/bin/python --ram RAM --out results/bench/train_step.json
    python benchmarks/train_step.py --quick --out FILE          # fewer steps, jaxpe only

--ram is a checkout or a bare git mirror of github facebookresearch/RAM (default $RAM_CHECKOUT), --torch-python an
interpreter with torch (default $TORCH_PYTHON). Writes --out: device, versions, date, config, median seconds per step
and ratios.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
DRIVER = REPO / "benchmarks" / "official_counting_step.py"
# (jaxpe encoding, its options, the official --pos-emb)
ENCODINGS = {"cope": ("cope", {"npos": 129}, "cope"), "learned": ("learned", {}, "abs"),
             "relative": ("relative", {"npos": 128}, "rel")}
MODEL = dict(d_model=128, num_layers=2, num_heads=4, dropout=0.1, prenorm=False, tie_embeddings=True, max_len=128)
BLOCK, BATCH, NVARS, MAX_STEPS, PAD_MULTIPLE = 128, 32, 3, 64, 16


def find_ram(given: str | None) -> tuple[pathlib.Path | None, str]:
    """RAM's projects/cope directory (a checkout, or extracted from a bare git mirror), and a note on its origin
    (the repository and its commit, not where it lies on this machine)."""
    candidate = given or os.environ.get("RAM_CHECKOUT")
    if not candidate:
        return None, "no RAM checkout given (--ram or $RAM_CHECKOUT)"
    path = pathlib.Path(candidate)
    commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    origin = f"facebookresearch/RAM at {commit or 'an unknown commit'}"
    if (path / "projects" / "cope" / "src").is_dir():
        path = path / "projects" / "cope"
    if (path / "src" / "cope" / "context_position.py").is_file():
        return path, origin
    if (path / "HEAD").is_file() and (path / "objects").is_dir():  # a bare mirror: extract projects/cope
        target = pathlib.Path(tempfile.mkdtemp(prefix="ram-"))
        archive = subprocess.run(["git", "-C", str(path), "archive", "HEAD", "projects/cope"], capture_output=True)
        if archive.returncode == 0:
            subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
            return target / "projects" / "cope", origin
    return None, f"{candidate} holds no RAM projects/cope (--ram)"


def official_data(ram: pathlib.Path | None, python: str | None, workdir: pathlib.Path) -> tuple[pathlib.Path, str]:
    """A directory of train/valid/test .jsonl: the official generator's when it can run, else jaxpe's restatement."""
    out = workdir / "count_data"
    if ram is not None and python is not None:
        subprocess.run([python, "scripts/count_data_gen.py", "--nvars", str(NVARS), "--max-steps", str(MAX_STEPS),
                        "--ntrain", "2000", "--ntest", "200", "--out-path", str(out)], cwd=ram, check=True,
                       capture_output=True)
        (data_dir,) = out.iterdir()
        return data_dir, "RAM scripts/count_data_gen.py"
    from jaxpe.train.tasks.counting import generate_samples, write_jsonl
    out.mkdir(parents=True)
    for split, n, seed in (("train", 2000, 0), ("valid", 200, 1), ("test", 200, 2)):
        write_jsonl(out / f"{split}.jsonl", generate_samples(n, nvars=NVARS, min_steps=3, max_steps=MAX_STEPS,
                                                             seed=seed))
    return out, "jaxpe.train.tasks.counting.generate_samples (the official generator's logic)"


class JaxpeSide:
    """jaxpe's jitted train step (jaxpe.train.step, as the trainer builds it) on the counting batches."""

    def __init__(self, data_dir: pathlib.Path, steps: int):
        import jax
        import numpy as np
        from jaxpe.train.tasks import make_task

        from jaxpe.train import distributed

        self.jax = jax
        self.mesh = distributed.make_mesh(0, divides=(BATCH,))
        task = make_task("counting", nvars=NVARS, data_dir=str(data_dir), seq_len=BLOCK)
        self.vocab_size = task.vocab_size
        self.batches, self.lengths = [], []
        for step in range(steps):
            batch = task.train_batch(step, BATCH)
            used = batch["weights"] > 0
            longest = int((BLOCK - np.argmax(used[:, ::-1], axis=1))[used.any(axis=1)].max())
            length = min(BLOCK, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
            self.batches.append(distributed.put_batch({k: v[:, :length] for k, v in batch.items()}, self.mesh))
            self.lengths.append(length)
        self.states, self.steps = {}, {}

    def build(self, name: str) -> None:
        import flax.linen as nn
        import jax.numpy as jnp
        from jaxpe.model import ModelConfig, TransformerLM
        from jaxpe.train import distributed
        from jaxpe.train.config import OptimConfig
        from jaxpe.train.step import TrainState, make_optimizer, make_train_step, weighted_loss

        jax = self.jax
        pe, options, _ = ENCODINGS[name]
        model = TransformerLM(ModelConfig(vocab_size=self.vocab_size, pe=pe, pe_options=options, **MODEL))
        tx = make_optimizer(OptimConfig(batch_size=BATCH), 1000)

        def logits_train(params, inputs, key):
            return model.apply({"params": params}, inputs, deterministic=False, rngs={"dropout": key})

        params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, BLOCK), jnp.int32))["params"])
        state = TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                           rng=jax.random.PRNGKey(1))
        self.states[name] = jax.device_put(state, distributed.replicated(self.mesh))
        self.steps[name] = jax.jit(make_train_step(weighted_loss(logits_train), tx), donate_argnums=0)
        for length in sorted(set(self.lengths)):  # compile every length before timing
            batch = self.batches[self.lengths.index(length)]
            self.states[name], metrics = self.steps[name](self.states[name], batch)
            jax.block_until_ready(metrics)

    def time(self, name: str, indices: range) -> list[float]:
        times = []
        for i in indices:
            start = time.perf_counter()
            self.states[name], metrics = self.steps[name](self.states[name], self.batches[i])
            self.jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return times


ONE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"
ONE_DEVICE_XLA = "--xla_force_host_platform_device_count=1"
# jaxpe's ways to run, the entry points' first: XLA_FLAGS put before the environment's (None: split_host_cpu's)
JAXPE_MODES = {"device_per_core": None, "one_device": ONE_DEVICE_XLA,
               "one_device_one_thread": f"{ONE_DEVICE_XLA} {ONE_THREAD_XLA}"}


def run_jaxpe(data_dir: pathlib.Path, name: str, first: int, steps: int, mode: str) -> dict:
    """jaxpe's step times in a fresh process (XLA reads its device and thread settings once, at start)."""
    env = dict(os.environ)
    # the mode's flags first: XLA stops reading at a word without "--"
    env["XLA_FLAGS"] = " ".join(f for f in (JAXPE_MODES[mode], env.get("XLA_FLAGS", "")) if f)
    out = subprocess.run([sys.executable, __file__, "--worker", str(data_dir), "--pe", name, "--first", str(first),
                          "--steps", str(steps)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"jaxpe's step failed ({name}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker(data_dir: str, name: str, first: int, steps: int) -> None:
    from jaxpe.train import _malloc, distributed

    distributed.split_host_cpu()  # as the entry points do (a no-op when XLA_FLAGS sets a device count)
    _malloc.keep_freed_memory()  # as the entry points do
    side = JaxpeSide(pathlib.Path(data_dir), first + steps)
    side.build(name)
    times = side.time(name, range(first, first + steps))
    print(json.dumps({"times": times, "lengths": side.lengths[first:first + steps], "devices": side.mesh.size}))


def run_official(python: str, ram: pathlib.Path, data_dir: pathlib.Path, pos_emb: str, steps: int,
                 threads: int) -> dict:
    out = subprocess.run([python, str(DRIVER), "--ram", str(ram), "--data", str(data_dir), "--pos-emb", pos_emb,
                          "--steps", str(steps), "--warmup", "3", "--threads", str(threads)],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the official code failed ({pos_emb}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON"),
                        help="a Python interpreter with torch (and the official code's imports: tqdm, wandb, "
                             "submitit)")
    parser.add_argument("--ram", help="a facebookresearch/RAM checkout or bare mirror (default: $RAM_CHECKOUT)")
    parser.add_argument("--pe", default="cope,learned,relative")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per side, encoding and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="--steps 5 --rounds 1")
    parser.add_argument("--out", type=pathlib.Path, metavar="FILE", help="the JSON report (required)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: time jaxpe's step on this data directory
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.pe, args.first, args.steps)
    if args.out is None:
        parser.error("--out FILE is required")
    if args.quick:
        args.steps, args.rounds = 5, 1
    names = args.pe.split(",")

    ram, ram_note = find_ram(args.ram)
    python, why_not = args.torch_python, None
    if not (python and pathlib.Path(python).exists()):
        why_not = (f"no PyTorch interpreter at {args.torch_python!r} (--torch-python)" if python else
                   "no PyTorch interpreter given (--torch-python or $TORCH_PYTHON)")
        python = None
    elif subprocess.run([python, "-c", "import torch, tqdm, wandb, submitit"], capture_output=True).returncode:
        why_not = f"{args.torch_python} lacks torch or the official code's imports (tqdm, wandb, submitit)"
        python = None
    if ram is None:
        why_not = why_not or ram_note
    if why_not:
        print(f"jaxpe only: {why_not}")

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="train-step-"))
    data_dir, data_note = official_data(ram, python, workdir)
    ours = {(name, mode): [] for name in names for mode in JAXPE_MODES}
    our_devices = {}
    theirs = {(name, threads): [] for name in names for threads in (0, 1)}
    our_lengths = {name: [] for name in names}
    their_lengths = {name: [] for name in names}
    torch_version, default_threads = None, None
    for r in range(args.rounds):
        for name in names:
            for mode in JAXPE_MODES:
                result = run_jaxpe(data_dir, name, r * args.steps, args.steps, mode)
                ours[name, mode] += result["times"]
                our_lengths[name] += result["lengths"]
                our_devices[mode] = result["devices"]
                print(f"round {r} {name} jaxpe {mode} ({result['devices']} devices): "
                      f"{statistics.median(result['times']):.3f} s", flush=True)
            if why_not:
                continue
            for threads in (0, 1):
                result = run_official(python, ram, data_dir, ENCODINGS[name][2], args.steps, threads)
                theirs[name, threads] += result["times"]
                their_lengths[name] += result["lengths"]
                torch_version = result["torch"]
                if threads == 0:
                    default_threads = result["threads"]
                print(f"round {r} {name} official threads={threads or 'default'}: "
                      f"{statistics.median(result['times']):.3f} s", flush=True)

    import flax
    import jax
    import jaxlib
    rows = {}
    print(f"{'':10s} {'jaxpe s/step':>13s} {'official s/step':>16s} {'ratio':>7s}")
    for name in names:
        mine = {mode: statistics.median(ours[name, mode]) for mode in JAXPE_MODES}
        fast = min(mine, key=mine.get)
        row = {"jaxpe_s": mine[fast], "jaxpe_mode": fast, **{f"jaxpe_s_{mode}": t for mode, t in mine.items()},
               "jaxpe_length_median": statistics.median(our_lengths[name])}
        if not why_not:
            by_threads = {threads: statistics.median(theirs[name, threads]) for threads in (0, 1)}
            best = min(by_threads, key=by_threads.get)
            row.update(official_s=by_threads[best], official_threads=default_threads if best == 0 else 1,
                       official_s_default_threads=by_threads[0], official_s_one_thread=by_threads[1],
                       official_length_median=statistics.median(their_lengths[name]),
                       ratio=row["jaxpe_s"] / by_threads[best])
        rows[name] = row
        official = f"{row['official_s']:16.3f}" if "official_s" in row else f"{'-':>16s}"
        ratio = f"{row['ratio']:7.2f}" if "ratio" in row else f"{'-':>7s}"
        print(f"{name:10s} {row['jaxpe_s']:13.3f} {official} {ratio}")

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text(encoding="utf-8")
                   .splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"backend": jax.default_backend(), "cpu": cpu, "cores": os.cpu_count(),
                   "load_average": os.getloadavg()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "flax": flax.__version__, "torch": torch_version},
        "config": {"model": MODEL, "block": BLOCK, "batch": BATCH, "nvars": NVARS, "max_steps": MAX_STEPS,
                   "pad": f"longest of the batch (jaxpe: rounded up to a multiple of {PAD_MULTIPLE})",
                   "encodings": {name: ENCODINGS[name] for name in names}, "steps": args.steps,
                   "rounds": args.rounds, "data": data_note,
                   "jaxpe_modes": {mode: flags or f"split_host_cpu: {our_devices.get(mode)} devices"
                                   for mode, flags in JAXPE_MODES.items()},
                   "official": None if why_not else ram_note},
        "official_missing": why_not,
        "command": " ".join(["python", "benchmarks/train_step.py", *sys.argv[1:]]),
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
