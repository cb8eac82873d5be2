"""The hard-threshold paper's logistic-regression claim (Sahu et al. 2021, docs/methods.md) with
grace's own compressors and residual memory: at the same total volume, hard threshold trains to
a lower loss than top-k and keeps a smaller error-feedback memory. 8 simulated workers, 5000
features (grace.bench.threshold_vs_topk)."""
from __future__ import annotations

import json
import math

import pytest

from grace.bench import threshold_vs_topk

# The script's defaults, spelled out so that a change of default does not change this test.
# Top-k density 0.2% (k = 10 per worker), near Sahu et al.'s 0.17%.
CONFIG = dict(workers=8, features=5000, steps=300, ratio=0.002, lr=1.0, batch=32, samples_per_worker=256,
              seed=0, scale_sigma=0.25, active=0.2, tolerance=0.02)


@pytest.fixture(scope="module")
def script():
    return threshold_vs_topk


@pytest.fixture(scope="module")
def result(script):
    return script.compare(**CONFIG)


def report(script, result) -> str:
    out = script.to_json(result)
    del out["traces"]
    return "\n" + json.dumps(out, indent=1)


def test_same_volume(script, result):
    k = math.ceil(CONFIG["ratio"] * CONFIG["features"])
    assert result.volume["topk"] == CONFIG["steps"] * CONFIG["workers"] * k, report(script, result)
    assert abs(result.volume_ratio - 1) <= 0.05, report(script, result)
    assert result.volume["topk"] * 100 < result.volume["sgd"], report(script, result)  # really compressed


def test_threshold_reaches_lower_training_loss(script, result):
    loss = result.final_loss
    assert loss["sgd"] < 0.1, report(script, result)  # the problem is learned at all
    assert loss["threshold"] < loss["topk"], report(script, result)


def test_threshold_error_feedback_stays_smaller(script, result):
    # Over the run: mean, peak, and Sahu et al.'s total error sum_t |e_t|^2. Not the last step alone:
    # once the model has converged, top-k keeps sending k per step and drains its memory below
    # threshold's floor (|e_j| < lambda for every j); with steps=600 top-k ends lower, 5.5 vs 9.0.
    for stat in (result.ef_norm_mean, result.ef_norm_max, result.total_error):
        assert stat["threshold"] < stat["topk"], report(script, result)


def test_command_line_writes_plot_and_json(script, tmp_path, monkeypatch):
    compare = script.compare  # a small problem: this checks the outputs, not the claim
    monkeypatch.setattr(script, "compare", lambda **kw: compare(**{**kw, "features": 500, "steps": 40}))
    script.main(["--out", str(tmp_path / "plots"), "--json", str(tmp_path / "r.json")])
    assert (tmp_path / "plots" / "threshold_vs_topk.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["traces"]) == {"sgd", "topk", "threshold"}
