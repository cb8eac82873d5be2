"""``hvd.join()`` (horovodrun, Gloo, 2 real ranks): allreduce methods behave as Horovod's own
optimizer does under join; allgather methods are refused with a clear error."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import launch

WORKER = Path(__file__).parent / "workers" / "torch_join.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("join")
    launch("horovodrun", 2, WORKER, "--out", out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("method", ["none", "randomk"])
def test_allreduce_methods_join_as_horovod_does(ranks, method):
    for rank in ranks:
        np.testing.assert_allclose(rank[method], rank["horovod"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["randomk", "powersgd"])
@pytest.mark.parametrize("epoch", ["uneven", "joined before its first step"])
def test_replicas_agree_in_the_epoch_after_a_join(ranks, method, epoch):
    """The joined rank skipped steps; its draws (random-k's indices, PowerSGD's Q) must agree
    with the others' again, or the replicas drift apart from the next step on."""
    first, second = (rank[f"{method} {epoch}"] for rank in ranks)
    assert first["steps"] == second["steps"] and len(set(first["steps"].values())) == 1
    assert first["steps"][next(iter(first["steps"]))] == (5 if epoch == "uneven" else 4)
    np.testing.assert_array_equal(first["parameters"], second["parameters"])


def test_allgather_methods_refuse_join_clearly(ranks):
    assert "hvd.join() cannot be used with grace(TopK" in ranks[1]["topk"]
    assert "exchanges by allgather" in ranks[1]["topk"]
