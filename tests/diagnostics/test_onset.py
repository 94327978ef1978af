"""Where a rise begins (`stats.first_rise`): the onset every slow-rank and fail-slow label
states. A fault that worsens in stages is dated at its first stage; a few noisy steps
before the fault, as a loaded host gives them, are not a stage."""

from __future__ import annotations

import numpy as np

from flare.diagnostics.stats import first_rise

# Steps 0-16 are noise (sd 0.25 of the rise), the fault adds 1.0 from step 17. Without
# the consistency guard the onset read step 4: steps 4-16 average 0.07 above steps 0-3.
NOISY_LEAD_IN = [-0.23, 0.08, -0.16, -0.38, 0.26, 0.12, 0.12, -0.12, 0.26, -0.06, 0.27,
                 -0.23, -0.21, 0.05, -0.18, 0.17, 0.07, 0.77, 1.02, 0.91, 1.23, 0.84, 0.89,
                 1.3, 1.56, 1.5, 1.02, 1.05, 1.38, 0.97, 0.76, 1.03, 1.11, 0.79, 0.59, 0.64,
                 1.17, 0.81, 0.96, 1.05]


def test_noise_before_the_fault_is_not_an_earlier_stage():
    assert first_rise(np.array(NOISY_LEAD_IN), 2, 0.25) == 17


def test_a_fault_that_worsens_in_stages_is_dated_at_its_first_stage():
    series = np.concatenate([np.zeros(17), np.full(10, 0.45), np.ones(30)])
    series += np.tile([0.02, -0.02, 0.01], 19)[:series.size]
    assert first_rise(series, 2, 0.25) == 17


def _heavy(rng, n, sd):
    """Noise as a loaded host gives it: normal, and one step in ten a spike."""
    return rng.normal(0, sd, n) + (rng.random(n) < 0.1) * rng.exponential(3 * sd, n)


def test_over_many_noisy_series_early_onsets_are_rare_and_stages_still_found():
    rng = np.random.default_rng(2)
    early = staged = 0
    trials = 300
    for _ in range(trials):
        one_step = np.concatenate([_heavy(rng, 17, 0.25), 1 + _heavy(rng, 40, 0.25)])
        onset = first_rise(one_step, 2, 0.25)
        early += onset is not None and onset < 14
        two_stages = np.concatenate([_heavy(rng, 17, 0.25), 0.45 + _heavy(rng, 10, 0.25),
                                     1 + _heavy(rng, 30, 0.25)])
        onset = first_rise(two_stages, 2, 0.25)
        staged += onset is not None and abs(onset - 17) <= 3
    # this seed: 6 % early and 51 % of the stages found; without the consistency guard
    # 21 % early and 66 % found
    assert early / trials <= 0.08, early / trials
    assert staged / trials >= 0.45, staged / trials


def test_leave_one_out_medians_are_each_rows_peers_median():
    """Against the definition (nanmedian of the other rows), with ties and NaNs, on 300
    random matrices of 1-8 rows: the straggler detector's hidden-rank rule compares each
    healthy rank with the others' median, once per rank before (53 s of a 1,024-rank
    hour's diagnosis), from one sort now."""
    import warnings

    from flare.diagnostics.stats import leave_one_out_medians

    rng = np.random.default_rng(7)
    for _ in range(300):
        rows, cols = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        values = rng.integers(0, 4, size=(rows, cols)).astype(float)
        values[rng.random((rows, cols)) < 0.3] = np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            expected = np.array([np.nanmedian(np.delete(values, i, axis=0), axis=0) if rows > 1
                                 else np.full(cols, np.nan) for i in range(rows)])
        assert np.allclose(leave_one_out_medians(values), expected, equal_nan=True), values
