"""Seeds trained as one program in the cases a user meets: members that stand at different checkpoints, a member
whose loss becomes NaN, and bad values for the seeds and the time limit (jaxpe.train.experiments, trainer).

The references are separate runs (or the uninterrupted run), never values of the code under test alone; stacked
members agree with them to test_seeds_together's tolerance (RTOL).
"""
from __future__ import annotations

import shutil

from test_seeds_together import assert_same_runs, counting
from jaxpe.train import experiments


def test_members_rewound_to_a_common_checkpoint_save_the_later_steps_again(tmp_path):
    """A member whose newest checkpoint is lost sends the others back to their common step; their own later
    checkpoints are deleted, not left to collide with the step saved again (orbax refused it:
    StepAlreadyExistsError, on every rerun), and the runs end as the uninterrupted ones."""
    config = counting("run.steps=4", "run.log_every=2", "run.checkpoint_every=2", "run.steps_per_dispatch=2",
                      "run.async_checkpoints=false")
    whole = experiments.compare_encodings([config], [0, 1], tmp_path / "whole")["runs"]
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    cut = [tmp_path / "cut" / "cope" / f"seed{s}" for s in (0, 1)]
    for run_dir in cut:
        (run_dir / "result.json").unlink()
    shutil.rmtree(cut[1] / "checkpoints" / "4")  # seed 1's last save was cut: both resume from step 2
    resumed = experiments.compare_encodings([config], [0, 1], tmp_path / "cut")["runs"]
    assert [r["resumed_from"] for r in resumed] == [2, 2]
    assert [experiments.latest_checkpoint_step(d) for d in cut] == [4, 4]
    assert_same_runs(resumed, whole, (cut, [tmp_path / "whole" / "cope" / f"seed{s}" for s in (0, 1)]))
