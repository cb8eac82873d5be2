"""The alpha-beta cost model (grace.bench.cost_model) against hand-computed cases."""
from __future__ import annotations

import pytest

from grace.bench import cost_model as cm

LINK = cm.Link(alpha=1e-3, bandwidth=1e6)  # 1 ms per message, 1 MB/s


def test_ring_allreduce_sends_twice_the_payload_less_a_share():
    # n = 4, 1 MB: 2 * 3 messages and 2 * 3/4 MB
    assert cm.collective_seconds("allreduce", 1e6, 4, LINK) == pytest.approx(6e-3 + 1.5)


def test_allgather_receives_every_other_rank_payload():
    assert cm.collective_seconds("allgather", 1e6, 4, LINK) == pytest.approx(3e-3 + 3.0)


def test_rounds_add_latency_not_bytes():
    one = cm.collective_seconds("allreduce", 1e6, 4, LINK)
    assert cm.collective_seconds("allreduce", 1e6, 4, LINK, rounds=2) == pytest.approx(one + 6e-3)


def test_one_rank_costs_nothing_and_alpha_inverts_a_tiny_allreduce():
    assert cm.collective_seconds("allgather", 1e6, 1, LINK) == 0
    alpha = cm.alpha_from_allreduce(0.012, 4)
    assert cm.collective_seconds("allreduce", 0, 4, cm.Link(alpha, 1e6)) == pytest.approx(0.012)


def test_step_is_the_sum_of_its_parts_and_unknown_collectives_are_refused():
    assert cm.step_seconds(0.5, 0.1, "allgather", 1e6, 4, LINK) == pytest.approx(0.6 + 3.003)
    with pytest.raises(ValueError, match="unknown collective 'scatter'"):
        cm.collective_seconds("scatter", 1, 4, LINK)
