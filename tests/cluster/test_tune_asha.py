"""BakingASHA: ASHA never stops a trial on its last training step's report (it bakes next)."""
from types import SimpleNamespace

import pytest

from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from cluster.tune import BakingASHA


def _decisions(sched) -> list:
    """Two trials, rungs at 1, 2 and 4 reports (max_t 5): t0 scores 0 at every report; t1
    scores better until its 4th report (its last training step, step 4 of 4), then worse. The
    decision at t1's 4th report, and at a final (baked) report after it."""
    t0, t1 = (SimpleNamespace(trial_id=f"t{i}", config={}) for i in range(2))
    for t in (t0, t1):
        sched.on_trial_add(None, t)
    for it in range(1, 5):
        assert sched.on_trial_result(None, t0, {"training_iteration": it, "objective": 0.0,
                                                "step": it}) == TrialScheduler.CONTINUE
    out = [sched.on_trial_result(None, t1, {"training_iteration": it, "objective": -1.0,
                                            "step": it}) for it in range(1, 4)]
    out.append(sched.on_trial_result(None, t1, {"training_iteration": 4, "objective": 5.0,
                                                "step": 4}))
    return out


@pytest.mark.parametrize("cls", [ASHAScheduler, BakingASHA])
def test_a_trial_is_not_stopped_on_its_last_training_step(cls):
    kw = dict(time_attr="training_iteration", max_t=5, grace_period=1, reduction_factor=2,
              metric="objective", mode="min")
    sched = cls(last_step=4, **kw) if cls is BakingASHA else cls(**kw)
    d = _decisions(sched)
    assert d[:3] == [TrialScheduler.CONTINUE] * 3
    # plain ASHA stops it there, all its training unbaked; BakingASHA lets it bake
    assert d[3] == (TrialScheduler.STOP if cls is ASHAScheduler else TrialScheduler.CONTINUE)
