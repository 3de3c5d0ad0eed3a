"""Where jaxpe's counting training step spends its time on CPU: a `jax.profiler` trace of the step that
benchmarks/train_step.py times, read back with `jax.profiler.ProfileData`, each XLA op's duration summed by the jax
operation it came from (its HLO `op_name`, layers folded together, FWD / BWD for the forward and the gradient).

    python benchmarks/profile_train_step.py --pe cope               # a device per core, as the entry points run
    JAXPE_CPU_DEVICES=1 python benchmarks/profile_train_step.py     # one device
    python benchmarks/profile_train_step.py --pe relative --top 60 --data DIR   # reuse the data a run printed

Times are summed over the device threads, so with a device per core the total is about cores × the step; waits at
the gradient all-reduce show as "Rendezvous" and "Wait". The trace itself slows the step a little.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import train_step  # noqa: E402  (benchmarks/train_step.py: the step, its data and its model)

SKIPPED = ("ThunkExecutor", "Await", "end: ")  # runtime bookkeeping around the ops, not ops


def op_names(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: its op_name metadata} from a compiled module's text."""
    names = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", line)
        if match:
            names[match.group(1)] = match.group(2)
    return names


def label(op_name: str) -> str:
    """A jax op_name with the layer index, the jit prefix and jvp/transpose wrappers folded: "BWD blockN/mlp/..."."""
    op_name = re.sub(r"block\d+", "blockN", op_name).replace("jit(train_step)/", "")
    return re.sub(r"^(transpose\()?jvp\((TransformerLM)?\)?\)?/?", lambda m: "BWD " if m.group(1) else "FWD ", op_name)


def summed_durations(trace_dir: pathlib.Path, names: dict[str, str]) -> collections.Counter:
    """Nanoseconds per label over the XLA threads of the newest trace in trace_dir."""
    import jax

    path = sorted(trace_dir.rglob("*.xplane.pb"))[-1]
    totals: collections.Counter = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            if not (line.name.startswith("tf_XLAEigen") or "PjRtCpuClient" in line.name):
                continue
            for event in line.events:
                if any(skip in event.name for skip in SKIPPED):
                    continue
                if event.name.startswith("all-reduce"):  # one for all gradients and metrics: its op_name lists them
                    totals["all-reduce (gradients and metrics)"] += event.duration_ns
                else:
                    totals[label(names.get(event.name, event.name))[:120]] += event.duration_ns
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pe", default="cope", choices=sorted(train_step.ENCODINGS))
    parser.add_argument("--steps", type=int, default=10, help="steps traced (after 10 untraced ones)")
    parser.add_argument("--top", type=int, default=40, help="rows printed")
    parser.add_argument("--data", help="a directory with the counting train/valid/test.jsonl "
                                       "(default: generated in a temp dir)")
    args = parser.parse_args()

    from jaxpe.train import _malloc, distributed

    distributed.split_host_cpu()  # as the entry points do ($JAXPE_CPU_DEVICES or XLA_FLAGS may set the count)
    _malloc.keep_freed_memory()
    import jax

    if args.data:
        data = pathlib.Path(args.data)
        if not (data / "train.jsonl").is_file():
            parser.error(f"--data {data} holds no train.jsonl")
    else:
        data, _ = train_step.official_data(None, None, pathlib.Path(tempfile.mkdtemp(prefix="profile-")))
        print(f"counting data in {data} (pass it as --data next time)")
    side = train_step.JaxpeSide(data, 10 + args.steps)
    side.build(args.pe)
    median = statistics.median(side.time(args.pe, range(10)))
    compiled = side.steps[args.pe].lower(side.states[args.pe], side.batches[10]).compile()
    trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="trace-"))
    jax.profiler.start_trace(str(trace_dir))
    side.time(args.pe, range(10, 10 + args.steps))
    jax.profiler.stop_trace()
    totals = summed_durations(trace_dir, op_names(compiled.as_text()))
    total = sum(totals.values())
    print(f"{args.pe}: {side.mesh.size} device(s), median step {1e3 * median:.1f} ms untraced; op time summed over "
          f"threads {total / 1e6 / args.steps:.1f} ms per step (trace in {trace_dir})")
    for name, ns in totals.most_common(args.top):
        print(f"{ns / 1e6 / args.steps:8.2f} ms {100 * ns / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
