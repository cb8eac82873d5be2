"""Mixed precision on 2 real ranks (horovodrun, Gloo): an inf in one rank's gradient costs
exactly one step, for every method, through Horovod's documented GradScaler recipe."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from grace.core import registry
from tests.conftest import launch
from tests.multiprocess.workers.common import VARIANTS

WORKER = Path(__file__).parent / "workers" / "torch_amp.py"
OVERFLOW_STEP, STEPS, SCALE, RANKS = 2, 6, 1024.0, 2
# every method once, and the ways a bucket can travel: per tensor, whole, by broadcast, dense,
# segment-wise (an accelerator's plan)
LABELS = ["none", "fp16", "bf16", "topk", "topk_per_tensor", "topk_bucket_scope", "topk_broadcast",
          "topk_nomemory", "threshold", "threshold_per_tensor", "threshold_dense", "threshold_segmented_small_buckets",
          "threshold_segmented_sometimes_dense", "randomk",
          "randomk_scaled", "signsgd", "signsgd_mean", "onebit", "qsgd", "qsgd_bucketed_broadcast",
          "terngrad", "natural", "u8bit", "inceptionn", "signum", "efsignsgd", "dgc", "adaq",
          "sketchml", "powersgd", "powersgd_per_tensor", "powersgd_small_buckets"]
LABELS += [name for name in registry.methods(None) if name not in LABELS]  # any other method (a test fixture)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp")
    launch("horovodrun", RANKS, WORKER, "--out", out, "--variants", *LABELS)
    return out


def load(runs, label, run, rank):
    return np.load(runs / f"{label}.{run}.rank{rank}.npz")


@pytest.mark.parametrize("label", LABELS)
def test_an_overflow_on_one_rank_costs_one_step_on_every_rank(label, runs):
    guarded = VARIANTS[label].make().flags_overflow
    for rank in range(RANKS):
        faulty, skipped = load(runs, label, "faulty", rank), load(runs, label, "skipped", rank)
        # every rank's averaged gradient was non-finite at that step only, so every scaler
        # skipped it and halved its scale once
        for step in range(STEPS):
            assert faulty[f"finite/{step}"].all() == (step != OVERFLOW_STEP), f"rank {rank} step {step}"
        scales = [float(faulty[f"scale/{s}"]) for s in range(STEPS)]
        assert scales == [SCALE] * OVERFLOW_STEP + [SCALE / 2] * (STEPS - OVERFLOW_STEP), f"rank {rank}"
        # nothing of the step was kept: memories, method state and step counters
        before, after = f"step{OVERFLOW_STEP - 1}/", f"step{OVERFLOW_STEP}/"
        kept = [k[len(before):] for k in faulty.files if k.startswith(before)]
        if not guarded:  # none and fp16 without memory keep nothing, not even a step counter
            assert kept == [], kept
        assert sorted(kept) != [] or not guarded
        for key in kept:
            np.testing.assert_array_equal(faulty[after + key], faulty[before + key], err_msg=f"rank {rank} {key}")
            assert np.isfinite(faulty[after + key]).all(), f"rank {rank} {key}"
        # and training went on exactly as if the step had not happened
        params = [k for k in faulty.files if k.startswith("param/")]
        assert params
        for key in params:
            assert np.isfinite(faulty[key]).all()
            np.testing.assert_array_equal(faulty[key], skipped[key], err_msg=f"rank {rank} {key}")
            np.testing.assert_array_equal(faulty[key], load(runs, label, "faulty", 0)[key],
                                          err_msg=f"rank {rank} {key}: the ranks diverged")


TF_WORKER = Path(__file__).parent / "workers" / "tensorflow_overflow.py"
TF_LABELS = ["topk", "topk_per_tensor", "randomk", "threshold", "signum", "dgc", "qsgd", "powersgd", "fp16"]
TF_OVERFLOW_STEP, TF_STEPS = 1, 4


@pytest.fixture(scope="module")
def tf_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf-overflow")
    launch("horovodrun", RANKS, TF_WORKER, "--out", out, "--variants", *TF_LABELS)
    return out


@pytest.mark.parametrize("label", TF_LABELS)
def test_tensorflow_traced_overflow_on_one_rank_costs_one_step(label, tf_runs):
    for rank in range(RANKS):
        faulty, skipped = load(tf_runs, label, "faulty", rank), load(tf_runs, label, "skipped", rank)
        assert not faulty[f"finite/{TF_OVERFLOW_STEP}"].all(), f"rank {rank}: the overflow was not seen"
        before, after = f"state{TF_OVERFLOW_STEP - 1}/", f"state{TF_OVERFLOW_STEP}/"
        for key in (k[len(before):] for k in faulty.files if k.startswith(before)):
            np.testing.assert_array_equal(faulty[after + key], faulty[before + key], err_msg=f"rank {rank} {key}")
        for step in range(TF_OVERFLOW_STEP + 1, TF_STEPS):
            assert faulty[f"finite/{step}"].all()
            for key in (k for k in skipped.files if k.startswith("grad/") and k.endswith(f"/{step}")):
                np.testing.assert_array_equal(faulty[key], skipped[key], err_msg=f"rank {rank} {key}")
