"""benchmarks/sweep_cost.py: a sweep's hours from per-step seconds, worked by hand, and one small preset measured end
to end (its numbers' consistency, not their speed)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import sweep_cost  # noqa: E402


def test_sweep_hours_by_hand():
    rows = {"a": {"seconds_per_step": 0.1, "run_steps": 1000, "gpu": 0.01},
            "b": {"seconds_per_step": 0.3, "run_steps": 1000, "gpu": 0.02}}
    # (0.1 + 0.3) s x 3600 steps x 2 settings x 3 seeds / 2 at a time = 4320 s = 1.2 h
    assert sweep_cost.sweep_hours(rows, steps=3600, settings=2, seeds=3, parallel=2) == pytest.approx(1.2)
    # each row's own run_steps: (0.1 + 0.3) x 1000 x 1 x 1 / 1 = 400 s
    assert sweep_cost.sweep_hours(rows, steps=None, settings=1, seeds=1, parallel=1) == pytest.approx(400 / 3600)
    assert sweep_cost.sweep_hours(rows, steps=3600, settings=1, seeds=1, parallel=1,
                                  seconds_key="gpu") == pytest.approx(108 / 3600)


def test_a_small_preset_measured_end_to_end(tmp_path):
    out = tmp_path / "cost.json"
    subprocess.run([sys.executable, str(BENCH / "sweep_cost.py"), "--out", str(out), "--presets", "cpu-small",
                    "--pes", "none,cope", "--steps", "2", "--sweep-steps", "cpu-small=100", "--seeds", "1",
                    "--gpu-peak-tflops", "100", "--gpu-utilisation", "0.5"], check=True, capture_output=True)
    report = json.loads(out.read_text(encoding="utf-8"))
    entry = report["presets"]["cpu-small"]
    rows = entry["encodings"]
    assert set(rows) == {"none", "cope"} and entry["sweep_steps"] == 100
    for row in rows.values():
        assert row["seconds_per_step"] > 0 and row["flops_per_step"] > 1e6 and row["block"] == 128
        assert row["gpu_seconds_per_step_estimate"] == pytest.approx(row["flops_per_step"] / 50e12)
    assert rows["cope"]["flops_per_step"] > rows["none"]["flops_per_step"]  # CoPE's gates and positions cost FLOPs
    hours = sum(row["seconds_per_step"] for row in rows.values()) * 100 * 2 * 1 / 2 / 3600
    assert entry["sweep_hours_cpu"] == pytest.approx(hours)
    assert report["versions"]["jax"] and report["device"]["backend"] == "cpu"


def test_unknown_encodings_are_named(capsys):
    with pytest.raises(SystemExit):
        sweep_cost.main(["--out", "x.json", "--pes", "cope,nope"])
    assert "nope" in capsys.readouterr().err
