"""Ranks agree or fail loudly (horovodrun, Gloo, 2 real ranks): a configuration that differs
between ranks is an error on every rank at the first step, and Horovod's resume recipes
(rank 0 loads, then broadcasts: PyTorch before the first step, TensorFlow after it) leave the
ranks in step."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import launch

WORKER = Path(__file__).parent / "workers" / "torch_agreement.py"
TF_WORKER = Path(__file__).parent / "workers" / "tensorflow_agreement.py"
RANKS = 2


def results(tmp_path_factory, worker: Path) -> list:
    """What each rank of ``worker`` saw, per scenario."""
    out = tmp_path_factory.mktemp(worker.stem)
    launch("horovodrun", RANKS, worker, "--out", out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return results(tmp_path_factory, WORKER)


@pytest.fixture(scope="module")
def tf_ranks(tmp_path_factory):
    return results(tmp_path_factory, TF_WORKER)


@pytest.mark.parametrize("scenario, what", [("ratio", "configuration"), ("seed", "configuration"),
                                            ("bucket_mb", "configuration"), ("tensors", "gradients")])
def test_a_difference_between_ranks_is_an_error_on_every_rank(ranks, scenario, what):
    for rank in ranks:
        assert f"ranks [1] differ from rank 0 in their {what}" in rank[scenario], rank[scenario]


def test_ranks_configured_alike_train(ranks):
    assert [rank["same"] for rank in ranks] == [""] * RANKS


@pytest.mark.parametrize("scenario", ["resume_randomk", "resume_powersgd"])
def test_horovods_resume_recipe_keeps_the_ranks_in_step(ranks, scenario):
    results = [rank[scenario] for rank in ranks]
    assert [r["error"] for r in results] == [""] * RANKS
    assert results[1]["steps"] == results[0]["steps"] and set(results[0]["steps"].values()) == {6}
    for mine, theirs in zip(results[1]["params"], results[0]["params"]):
        np.testing.assert_array_equal(mine, theirs)  # replicas identical, as with Horovod alone


def test_a_checkpoint_on_rank_0_alone_without_the_broadcast_is_refused(ranks):
    for rank in ranks:
        message = rank["resume_without_broadcast"]["error"]
        assert "differ from rank 0 in their step counters" in message
        assert "hvd.broadcast_optimizer_state" in message


@pytest.mark.parametrize("scenario", ["ratio", "seed"])
def test_tensorflow_a_difference_between_ranks_is_an_error_on_every_rank(tf_ranks, scenario):
    for rank in tf_ranks:
        assert "ranks [1] differ from rank 0 in their configuration" in rank[scenario], rank[scenario][-500:]
    assert [rank["same"] for rank in tf_ranks] == [""] * RANKS


@pytest.mark.parametrize("scenario", ["resume_randomk", "resume_randomk_per_tensor", "resume_powersgd"])
def test_tensorflow_resume_recipe_keeps_the_ranks_in_step(tf_ranks, scenario):
    """Rank 0 alone restores; the traced step broadcasts the variables after its first batch.
    The ranks take rank 0's step counters (and PowerSGD's Q) at that first step; each keeps
    its own memory."""
    results = [rank[scenario] for rank in tf_ranks]
    assert [r["error"] for r in results] == [""] * RANKS
    assert results[1]["steps"] == results[0]["steps"] and set(results[0]["steps"].values()) == {6}
    assert results[0]["memory"] == results[1]["memory"] != []
    for mine, theirs in zip(results[1]["params"], results[0]["params"]):
        np.testing.assert_array_equal(mine, theirs)


def test_tensorflow_step_counters_that_rank_0_cannot_hand_over_are_an_error(tf_ranks):
    for rank in tf_ranks:
        assert "differ from rank 0 in their step counters" in rank["resume_on_rank_1_only"]["error"]
