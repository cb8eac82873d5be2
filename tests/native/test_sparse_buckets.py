"""The sparsifiers' bucket kernels on the device (one cooperative or segment-table launch each on a
GPU) against their CPU twins, which the segment-wise tests check against the per-tensor oracle:
the same bytes. On the CPU each twin meets itself (a smoke run); with a GPU these are the checks
of the CUDA code."""
from __future__ import annotations

import numpy as np
import pytest

import grace
import grace.native as gn
from grace.backends import get_backend
from grace.core import draws, segments, sparse_frames
from grace.core.plans.kernels import kernels_of

from .conftest import gradient, host, on, same_bytes, torch

# 70 segments (two batches of 64), every index width
SIZES = [1, 7, 200, 300, 1001, 2049, 9000, 2**16 + 3, 70000] * 7 + [5, 3, 4100, 17, 2**15, 260, 90]


def _table(device, sizes=SIZES):
    xp = get_backend("torch")
    return xp, segments.SegmentTable.build(xp, sizes, torch.zeros(1, device=device))


def test_threshold_select_write_and_mean(device):
    """threshold_select_segments, threshold_write_segments and sparse_variable_mean."""
    xp, table = _table(device)
    g, e = gradient(table.numel, seed=1), gradient(table.numel, seed=2) * np.float32(0.1)
    g[17] = np.inf
    layout = sparse_frames.SparseFrames(xp, table, "float32", True, torch.zeros(1, device=device))

    def run(dev):
        t = table if dev == device else _table(dev)[1]
        flag = torch.zeros(1, dtype=torch.uint8, device=dev)
        p, take, counts, header = gn.threshold_select_segments(on(dev, g), on(dev, e), t.start, 1.0, 0.9, 1.0,
                                                               nonfinite=flag)
        own = host(counts).tolist()
        places, tail, size = layout.write_places(own)
        frame = gn.threshold_write_segments(p, take, on(dev, places), size, tail, flag)
        head = [c for c in own for _ in (0, 1)]
        frames = torch.cat([frame, frame, frame])
        mean = gn.sparse_variable_mean(frames, on(dev, layout.pair_table(head * 3, 3)), 3, 3.0, table.numel)
        return p, take, counts, header, flag, frame, mean

    got, want = run(device), run("cpu")
    for name, a, b in zip(("p", "take", "counts", "header", "flag", "frame", "mean"), got, want):
        same_bytes(a, b, f"threshold's {name}")


def test_fixed_frames_mean_and_its_flags(device):
    """sparse_frames_mean: the mean, poisoned by a rank's flag, and the flagging ranks counted."""
    xp, table = _table(device, SIZES[:20])
    kernels = kernels_of(grace.topk(0.01).compressor)
    layout = segments.SegmentedFrame(xp, kernels.segment_fields(table.numels, "float32"), True,
                                     torch.zeros(1, device=device))
    slots, flag_at = layout.pair_slots(xp, table.starts)
    frames = []
    for flag in (0, 1, 0):
        values, idx, _ = gn.topk_ef_step_segments(on("cpu", gradient(table.numel, seed=flag + 5)),
                                                  on("cpu", np.zeros(table.numel, np.float32)), table.starts,
                                                  table.numels, kernels._ks(table))
        frames.append(layout.write(get_backend("torch"), (values, idx), torch.tensor([flag], dtype=torch.uint8)))
    received = host(torch.cat(frames))
    for poisoned in (True, False):
        if not poisoned:
            received[flag_at + layout.size] = 0  # (rank 1's flag cleared)
        got, want = (gn.sparse_frames_mean(on(dev, received), 3, layout.size, on(dev, host(slots)), flag_at, 3.0,
                                           table.numel) for dev in (device, "cpu"))
        same_bytes(got[0], want[0], "mean")
        same_bytes(got[1], want[1], "flagged ranks")


@pytest.mark.parametrize("framed", [False, True])
def test_top_k_and_dgc_into_their_frames(device, framed):
    """topk_ef_step_segments, dgc_compensate_into, dgc_cut_segments and dgc_select_segments, their
    pairs as fields or written into the frame (two batches of segments, a NaN)."""
    xp, table = _table(device)
    kernels = kernels_of(grace.topk(0.01).compressor)
    ks = kernels._ks(table)
    layout = segments.SegmentedFrame(xp, kernels.segment_fields(table.numels, "float32"), True,
                                     torch.zeros(1, device=device))
    slots, flag_at = layout.pair_slots(xp, table.starts)
    g, u, v = (gradient(table.numel, seed=s) for s in (7, 8, 9))
    g[5] = np.nan

    def run(dev):
        frame = torch.full((layout.size,), 0x5A, dtype=torch.uint8, device=dev)
        into = (frame, on(dev, host(slots)), layout.size - layout.pad) if framed else None
        flag = frame[flag_at:flag_at + 1] if framed else torch.zeros(1, dtype=torch.uint8, device=dev)
        fields = gn.topk_ef_step_segments(on(dev, g), on(dev, v), table.starts, table.numels, ks, nonfinite=flag,
                                          frame=into)
        out = [f for f in fields if f is not None] + [flag, frame.clone()]
        un, p = gn.dgc_compensate_into(on(dev, u), on(dev, v), on(dev, g), 0.9,
                                       torch.empty(table.numel, device=dev), torch.empty(table.numel, device=dev))
        sizes, needs, dgc_ks = grace.dgc(0.01).compressor.sample_plan(table.numels, 0.01)
        words = [draws.seed_words((3, s)) for s in range(len(table.numels))]
        cut = gn.dgc_cut_segments(p, table.starts, table.numels, sizes, needs, words)
        picked = gn.dgc_select_segments(p, un, table.starts, table.numels, dgc_ks, cut, nonfinite=flag, frame=into)
        return out + [un, p, cut, flag, frame] + [f for f in picked if f is not None]

    got, want = run(device), run("cpu")
    assert len(got) == len(want)
    for j, (a, b) in enumerate(zip(got, want)):
        same_bytes(a, b, f"output {j}")


def test_variable_mean_of_ranks_with_empty_segments(device):
    """sparse_variable_mean of four ranks whose selections differ, with empty ones."""
    xp, table = _table(device, SIZES[:12])
    layout = sparse_frames.SparseFrames(xp, table, "float32", False, torch.zeros(1, device=device))
    rng = np.random.default_rng(4)
    received, heads = [], []
    for rank in range(4):
        counts = [0 if (s + rank) % 3 == 0 else int(rng.integers(1, max(2, n // 20))) for s, n in enumerate(SIZES[:12])]
        local = [np.sort(rng.choice(n, c, replace=False)) for n, c in zip(SIZES[:12], counts)]
        values = rng.standard_normal(sum(counts)).astype(np.float32)
        received.append(host(layout.write(xp, torch.from_numpy(values), torch.from_numpy(np.concatenate(local)),
                                          counts)))
        heads += [c for c in counts for _ in (0, 1)]
    frames, places = np.concatenate(received), layout.pair_table(heads, 4)
    got, want = (gn.sparse_variable_mean(on(dev, frames), on(dev, places), 4, 4.0, table.numel)
                 for dev in (device, "cpu"))
    same_bytes(got, want, "mean")
