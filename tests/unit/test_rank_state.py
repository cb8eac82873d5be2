"""What of an exchange's state is a rank's own (memory) and what all ranks share (step
counters, PowerSGD's Q): checkpoints saved elsewhere, and Horovod's broadcast of the state."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core.communicator import ReplicaCommunicator
from tests.unit.test_buckets import gradients


class Rank(ReplicaCommunicator):
    def __init__(self, rank: int, size: int):
        super().__init__(size)
        self.rank = rank


def saved_elsewhere(exchange):
    """A checkpoint as another process (a file from an earlier run) would hand it over."""
    state = exchange.state_dict()
    state["origin"] = {**state["origin"], "process": "another-host:1234:0"}
    return state


def trained(make, rank=0, size=2, steps=2):
    exchange = grace.Exchange(make(), Rank(rank, size))
    for s in range(steps):
        exchange.exchange(gradients(get_backend("numpy"), s))
    return exchange


def test_a_checkpoint_records_where_it_came_from():
    origin = trained(lambda: grace.topk(0.1), rank=1, size=3).state_dict()["origin"]
    assert (origin["rank"], origin["size"]) == (1, 3) and origin["process"]


def test_the_same_rank_loads_everything_silently():
    saved = saved_elsewhere(trained(lambda: grace.topk(0.1)))
    fresh = grace.Exchange(grace.topk(0.1), Rank(0, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(saved)
    assert sorted(fresh.memory) == sorted(saved["memory"])


@pytest.mark.parametrize("make, keeps_state", [(lambda: grace.topk(0.1), False), (lambda: grace.signum(0.5), False),
                                               (lambda: grace.powersgd(1), True)])
def test_another_ranks_checkpoint_brings_its_steps_but_not_its_memory(make, keeps_state):
    saved = saved_elsewhere(trained(make, rank=0))
    other = grace.Exchange(make(), Rank(1, 2))
    with pytest.warns(RuntimeWarning, match="holds rank 0's error-feedback memory; rank 1 starts with empty memory"):
        other.load_state_dict(saved)
    assert other.memory == {}
    assert other.steps == saved["steps"] and set(saved["steps"].values()) == {2}
    assert bool(other.state) == keeps_state  # PowerSGD's Q is shared; signum's momentum is not


def test_another_world_size_keeps_the_memory_with_a_warning():
    saved = saved_elsewhere(trained(lambda: grace.topk(0.1), rank=0, size=2))
    bigger = grace.Exchange(grace.topk(0.1), Rank(0, 4))
    with pytest.warns(RuntimeWarning, match="saved in a world of 2 ranks, this one has 4"):
        bigger.load_state_dict(saved)
    assert sorted(bigger.memory) == sorted(saved["memory"])


def test_a_state_this_process_saved_is_its_own_under_any_rank():
    """Horovod's elastic reset restores each process's own committed state after ranks moved."""
    saved = trained(lambda: grace.topk(0.1), rank=2, size=3).state_dict()
    moved = grace.Exchange(grace.topk(0.1), Rank(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moved.load_state_dict(saved)
    assert sorted(moved.memory) == sorted(saved["memory"])


def test_the_ranks_compare_again_after_the_world_changed():
    calls = []

    class Elastic(Rank):
        def allreduce_async(self, tensor, name):  # (the first-step check; the payloads' are named by bucket)
            if not name.startswith("grace.bucket"):
                calls.append(name)
            return super().allreduce_async(tensor, name)

    comm = Elastic(0, 2)
    exchange = grace.Exchange(grace.randomk(0.1), comm)
    exchange.exchange(gradients(get_backend("numpy"), 0))
    exchange.exchange(gradients(get_backend("numpy"), 1))
    assert calls == ["grace.agreement"]
    comm.size = 1  # a rank left
    exchange.exchange(gradients(get_backend("numpy"), 2))
    assert calls == ["grace.agreement"] * 2


@pytest.mark.parametrize("make, shares_state", [(lambda: grace.randomk(0.1), False), (lambda: grace.powersgd(1), True)])
def test_shared_state_carries_steps_and_shared_method_state_and_keeps_the_own_memory(make, shares_state):
    root = trained(make, rank=0, steps=3)
    mine = trained(make, rank=1, steps=1)
    own_memory = {name: np.copy(value) for name, value in mine.memory.items()}
    shared = root.shared_state()
    assert sorted(shared) == (["state", "steps"] if shares_state else ["steps"])
    mine.load_shared_state(shared)
    assert mine.steps == root.steps
    for name, value in own_memory.items():
        np.testing.assert_array_equal(mine.memory[name], value)
    if shares_state:
        for name, q in root.state.items():
            np.testing.assert_array_equal(mine.state_dict()["state"][name], q)
