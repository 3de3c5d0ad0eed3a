"""benchmarks/model_vs_gpu.py: the clocks per logit a GPU spent, against hand-computed numbers on a made-up cost
report and benchmark."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import model_vs_gpu  # noqa: E402


def _loop(name: str, bound: float) -> dict:
    return {"name": name, "per_logit": {"bound": bound}}


def _kernel(op: str, kernel: str, loops: list[dict]) -> dict:
    return {"path": "triton", "op": op, "kernel": kernel, "head_dim": 64, "dtype": "bfloat16", "q_heads": 8,
            "kv_heads": 2, "npos": 64 if op == "cope" else None, "loops": loops}


COST = {
    "date": "2026-01-01", "kernel_sources_sha256": "0" * 64,
    "kernels": [_kernel("cope", "forward", [_loop("positions", 0.5), _loop("clamped", 0.25)]),
                _kernel("cope", "backward", [_loop("clamped", 1.0), _loop("positions", 2.0)]),
                _kernel("corope", "forward", [_loop("keys", 3.0)]),
                _kernel("corope", "backward", [_loop("keys", 10.0), _loop("gates", 0.5)])],
    "plain": [{"variant": "defaults", "kernel": "forward", "head_dim": 64, "dtype": "bfloat16",
               "loops": [_loop("keys", 0.125)]},
              {"variant": "defaults", "kernel": "backward", "head_dim": 64, "dtype": "bfloat16",
               "loops": [_loop("dkdv", 0.5), _loop("dq", 0.25)]}],
}


def _row(op: str, impl: str, mode: str, ms: float) -> dict:
    return {"op": op, "impl": impl, "length": 1023, "head_dim": 64, "mode": mode, "batch": 2, "heads": 4,
            "dtype": "bfloat16", "time_ms": ms}


BENCH = {"device_kind": "NVIDIA H200", "date": "2026-01-02", "jax_version": "0.11.2",
         "rows": [_row("cope", "triton", "fwd", 1.0), _row("cope", "triton", "fwd+bwd", 4.0),
                  _row("corope", "triton", "fwd", 2.0), _row("corope", "triton", "fwd+bwd", 10.0),
                  _row("rope", "anchor", "fwd", 0.5), _row("rope", "anchor", "fwd+bwd", 1.5),
                  _row("cope", "pallas", "fwd", 9.0), _row("cope", "pallas", "fwd+bwd", 9.0),
                  {**_row("corope", "triton", "fwd", 0.0), "head_dim": 128, "error": "out of memory"}]}


def test_measured_clocks_per_logit_and_the_model_loop_each_kernel_runs():
    rows = {(r["op"], r["pass"]): r for r in model_vs_gpu.compare(COST, BENCH)}
    assert set(rows) == {(op, p) for op in ("cope", "corope", "rope") for p in ("fwd", "bwd")}  # no pallas, no error
    logits = 2 * 4 * 1023 * 1024 / 2
    per_ms = 1e-3 * 1980e6 * 132 / logits  # clk/logit for 1 ms
    want = {("cope", "fwd"): (1.0, 0.25), ("cope", "bwd"): (3.0, 1.0), ("corope", "fwd"): (2.0, 3.0),
            ("corope", "bwd"): (8.0, 10.5), ("rope", "fwd"): (0.5, 0.125), ("rope", "bwd"): (1.0, 0.75)}
    for key, (ms, bound) in want.items():
        row = rows[key]
        assert row["time_ms"] == pytest.approx(ms)
        assert row["measured_clk_per_logit"] == pytest.approx(ms * per_ms)
        assert row["model_clk_per_logit"] == pytest.approx(bound)
        assert row["measured_over_model"] == pytest.approx(ms * per_ms / bound)


def test_cli_writes_both_files_and_refuses_an_unknown_gpu(tmp_path, capsys):
    cost, bench = tmp_path / "cost.json", tmp_path / "bench.json"
    cost.write_text(json.dumps(COST), encoding="utf-8")
    bench.write_text(json.dumps(BENCH), encoding="utf-8")
    model_vs_gpu.main(["--cost", str(cost), "--bench", str(bench), "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    assert report["sm_clock_mhz"] == 1980 and len(report["rows"]) == 6
    assert "| corope | bwd | 64 | 1023 | 8.0 |" in (tmp_path / "out.md").read_text(encoding="utf-8")
    bench.write_text(json.dumps({**BENCH, "device_kind": "NVIDIA A100"}), encoding="utf-8")
    with pytest.raises(SystemExit):
        model_vs_gpu.main(["--cost", str(cost), "--bench", str(bench), "--out", str(tmp_path / "again")])
    assert "no SM clock known for 'NVIDIA A100'" in capsys.readouterr().err
