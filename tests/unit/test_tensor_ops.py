"""A segmented bucket's tensor-op path (an accelerator without grace's CUDA library) as two calls
per bucket (``grace.core.plans.tensor_ops``), fused by torch.compile: each gradient's result
still its per-tensor one bit for bit, an overflow still costing one step, eager ops where
compiling fails. The accelerator is this CPU told it is one; inductor's C++ kernels stand in
for a GPU's Triton ones."""
from __future__ import annotations

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core.communicator import ReplicaCommunicator
from grace.core.plans import segmented
from tests.unit.conftest import METHODS
from tests.unit.test_buckets import assert_same, gradients, with_buckets
from tests.unit.test_overflow import overflowing

torch = pytest.importorskip("torch")
torch_fusion = pytest.importorskip("grace.backends.torch_fusion")

# the two calls from the second step on (the quantizers' and random-k's draws seeded on the
# device from the step as a tensor; threshold's variable-length selection and pairs)
FUSED = ["topk", "efsignsgd", "onebit", "qsgd", "terngrad", "natural", "randomk", "dgc", "threshold"]


@pytest.fixture
def accelerator(monkeypatch):
    """The torch backend on an accelerator without grace's native kernels."""
    xp = get_backend("torch")
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    monkeypatch.setattr(type(xp), "native", lambda self, *args: None)
    return xp


def steps(xp, method, bad_step=None):
    """Four steps of ``method`` on several buckets (an inf in step ``bad_step``): the exchange,
    every step's results, the state at the end."""
    exchange = grace.Exchange(with_buckets(METHODS[method], 0.002), ReplicaCommunicator(3))
    outs = [exchange.exchange(overflowing(xp, s, np.inf) if s == bad_step else gradients(xp, s)) for s in range(4)]
    return exchange, outs, exchange.state_dict()


@pytest.mark.parametrize("method", FUSED)
def test_the_two_calls_take_over_after_the_first_step(accelerator, method):
    exchange, _, _ = steps(accelerator, method)
    plans = list(exchange.bucket_plans().values())
    assert len(plans) > 2 and all(type(plan).__name__ == "Segmented" for plan in plans)
    assert sum(plan.tensor_ops is not None for plan in plans) >= len(plans) - 1  # (a bucket may go dense)


def test_a_schedule_stays_op_by_op(accelerator):
    """DGC's sparsity warm-up sets each step's k on the host."""
    exchange, _, _ = steps(accelerator, "dgc_warmup")
    assert all(plan.tensor_ops is None for plan in exchange.bucket_plans().values())


@pytest.mark.filterwarnings("error::RuntimeWarning")  # (torch_fusion's: compiling failed, eager ops ran)
@pytest.mark.parametrize("method", FUSED)
def test_compiled_calls_give_the_op_by_op_results_and_an_overflow_costs_one_step(accelerator, monkeypatch, method):
    """Against the same steps op by op throughout (every step as the first)."""
    with monkeypatch.context() as op_by_op:
        op_by_op.setattr(segmented, "tensor_ops_of", lambda plan, pending: None)
        _, want, want_state = steps(accelerator, method, bad_step=2)
    monkeypatch.setattr(torch_fusion, "ON_CPU", True)
    compiled_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    exchange, got, got_state = steps(accelerator, method, bad_step=2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > compiled_before
    assert not np.isfinite(accelerator.to_numpy(got[2]["fc.weight"])).all()
    for step, (w, g) in enumerate(zip(want, got)):
        for name in w:
            assert_same(accelerator, w[name], g[name], f"{method} step {step} {name}")
    for table in ("memory", "state", "steps"):
        assert sorted(want_state[table]) == sorted(got_state[table])
        for name in want_state[table]:
            assert_same(accelerator, want_state[table][name], got_state[table][name], f"{method} {table} {name}")


def test_a_function_that_does_not_compile_runs_op_by_op_with_one_warning(monkeypatch):
    def refused(fn, **options):
        def call(*args):
            raise RuntimeError("no C++ compiler")
        return call

    monkeypatch.setattr(torch_fusion, "ON_CPU", True)
    monkeypatch.setattr(torch, "compile", refused)
    x = torch.arange(4.0)
    twice = torch_fusion.fused(lambda t: t * 2, "twice", x)
    assert torch.equal(twice(x), x * 2)  # (the first call op by op: no compiling yet)
    with pytest.warns(RuntimeWarning, match="twice runs its tensor ops one by one.*no C\\+\\+ compiler"):
        assert torch.equal(twice(x), x * 2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(twice(x + 1), (x + 1) * 2)


def test_fusing_is_for_accelerators_and_off_with_grace_fuse_0(monkeypatch):
    def double(t):
        return t * 2

    x = torch.arange(4.0)
    assert torch_fusion.fused(double, "double", x) is double  # (a CPU's tensors: one op each anyway)
    monkeypatch.setattr(torch_fusion, "ON_CPU", True)
    assert torch_fusion.fused(double, "double", x) is not double
    monkeypatch.setenv("GRACE_FUSE", "0")
    assert torch_fusion.fused(double, "double", x) is double


def test_a_compiled_repeat_finds_each_places_segment_from_the_starts_empty_segments_too():
    """Inside a compiled program a segment's value reaches its elements by a search of the
    segments' starts (not inductor's scan and search of the counts): the same tensor."""
    xp = get_backend("torch")
    counts = torch.tensor([2, 0, 3, 0, 0, 1, 4])
    starts = torch.cumsum(counts, 0) - counts
    x = torch.arange(1.0, 8.0)
    spread = torch.compile(lambda v: xp.repeat(v, counts, int(counts.sum()), starts), dynamic=False)
    assert torch.equal(spread(x), torch.repeat_interleave(x, counts))


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dense_rank", [False, True], ids=["sparse", "a-rank-dense"])
def test_threshold_mean_compiled_reads_every_ranks_own_pairs(accelerator, monkeypatch, dense_rank):
    """Three ranks' frames of different selections (every index width of the bucket), end to
    end: the mean of the compiled pairs (``SelectionOps.pairs``) is the op-by-op one
    (``_sparse_mean``) bit for bit, compiled once for every length; a rank that sent its dense
    bucket: op by op."""
    monkeypatch.setattr(torch_fusion, "ON_CPU", True)
    exchange, _, _ = steps(accelerator, "threshold")
    plan = max(exchange.bucket_plans().values(), key=lambda p: len(p.own_layout.kinds))
    layout, table, n = plan.own_layout, plan.table, 3
    assert type(plan.tensor_ops).__name__ == "SelectionOps" and len(layout.kinds) >= 2
    rng = np.random.default_rng(7)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for trial, density in enumerate([0.1, 0.3, 0.02]):
        frames, headers = [], []
        for rank in range(n):
            p = torch.as_tensor(rng.standard_normal(table.numel), dtype=torch.float32)
            take = torch.as_tensor(rng.random(table.numel) < (1.0 if dense_rank and rank == 1 else density))
            counts = torch.as_tensor(np.add.reduceat(take.numpy().astype(np.int64), np.asarray(table.starts)))
            own = counts.tolist()
            if layout.sends_dense(own):
                frames.append(layout.write_dense(accelerator, p))
            else:
                fields, _ = plan.services.kernels.selected_pairs(accelerator, p, take, (own, counts), table)
                frames.append(layout.write(accelerator, *fields, own))
            headers.append(layout.header_of(accelerator, counts))
        received, counts = torch.cat(frames), torch.cat(headers).tolist()
        fused = plan._pairs_mean(accelerator, received, layout, counts)
        read, _ = layout.read(accelerator, received, torch.cat(headers), n, counts)
        want = plan._sparse_mean(accelerator, read)
        if dense_rank:
            assert fused is None
            continue
        assert_same(accelerator, want, fused, f"trial {trial}")
    # (compiled in the steps already: one program for every length, none compiled for these)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before
