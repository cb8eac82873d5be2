"""Bucket calls that write their payloads where the caller says (``into``): the exchange's frame
buffer, so that a frame needs no join of its pieces. The payloads are byte for byte the ones
the same call makes in buffers of its own, each at the offset given, and nothing else of the
caller's buffer is written."""
from __future__ import annotations

import numpy as np
import pytest

import grace.native as gn
from grace.core import bucket as frames
from tests.native.conftest import gradient, same_bytes, torch  # noqa: F401

SIZES = [1, 9, 300, 40000, 2**16 + 3]
CANARY = 0xA5


def placer(layout):
    """An ``into`` that lays the pieces out by ``layout(dtypes, counts)`` (each piece's byte
    offset, and the buffer's size) in a buffer of canary bytes; what it handed out, in ``seen``."""
    seen = {}

    def into(dtypes, counts):
        offsets, size = layout(dtypes, counts)
        seen.update(buffer=torch.full((size,), CANARY, dtype=torch.uint8), offsets=offsets, dtypes=dtypes,
                    counts=counts)
        return seen["buffer"], offsets

    return into, seen


def as_frame(dtypes, counts):  # as the exchange does: a flagged frame's pieces, widest first
    pieces, _, size = frames.layout(dtypes, counts, False, True)
    return [offset for offset, _, _ in pieces], size


def backwards_with_gaps(dtypes, counts):  # last piece first, 8 bytes between pieces
    offsets, pos = [0] * len(dtypes), 8
    for i in reversed(range(len(dtypes))):
        size = frames.ITEMSIZE[dtypes[i]]
        pos += -pos % size
        offsets[i] = pos
        pos += counts[i] * size + 8
    return offsets, pos


def check_placed(got, want, seen):
    """Each placed piece equals the unplaced call's, lies at its offset, and every byte the
    pieces do not cover still holds the canary."""
    pieces = [t for payload in got for t in payload]
    wanted = [t for payload in want for t in payload]
    buffer = seen["buffer"]
    assert len(pieces) == len(wanted) == len(seen["offsets"])
    covered = np.zeros(buffer.numel(), bool)
    for piece, expected, offset, count, dtype in zip(pieces, wanted, seen["offsets"], seen["counts"], seen["dtypes"]):
        same_bytes(expected, piece)
        assert piece.data_ptr() == buffer.data_ptr() + offset
        covered[offset:offset + count * frames.ITEMSIZE[dtype]] = True
    assert (buffer.numpy()[~covered] == CANARY).all(), "bytes outside the pieces were written"


def inputs():
    gs = [gradient(n, seed=n) for n in SIZES]
    gs[2][:4] = [-0.0, np.inf, np.nan, 3e38]
    return [torch.from_numpy(g) for g in gs]


@pytest.mark.parametrize("layout", [as_frame, backwards_with_gaps], ids=["frame", "backwards"])
@pytest.mark.parametrize("method, parameters", [("signsgd", ()), ("terngrad", ()), ("natural", ()),
                                                ("qsgd", (127, 0)), ("qsgd", (5, 1000))])
def test_compress_many_places_its_payloads(method, parameters, layout):
    xs = inputs()
    words = None if method == "signsgd" else [(0x9E3779B9 * (s + 1) % 2**32, 77 + s) for s in range(len(xs))]
    into, seen = placer(layout)
    got = gn.compress_many(method, xs, words, *parameters, into=into)
    check_placed(got, gn.compress_many(method, xs, words, *parameters), seen)


@pytest.mark.parametrize("layout", [as_frame, backwards_with_gaps], ids=["frame", "backwards"])
def test_top_k_steps_place_their_values_and_indices(layout):
    gs = inputs()
    rs = [torch.from_numpy(gradient(n, seed=n + 1)) * 0.3 for n in SIZES]
    ks = [max(1, n // 100) for n in SIZES]
    into, seen = placer(layout)
    values, indices, news = gn.topk_ef_step_many(gs, rs, ks, beta=0.9, outs=[torch.empty(n) for n in SIZES], into=into)
    want = gn.topk_ef_step_many(gs, rs, ks, beta=0.9)
    check_placed(list(zip(values, indices)), list(zip(*want[:2])), seen)
    for a, b in zip(want[2], news):
        same_bytes(a, b)


@pytest.mark.parametrize("layout", [as_frame, backwards_with_gaps], ids=["frame", "backwards"])
@pytest.mark.parametrize("method", ["efsignsgd", "onebit"])
def test_sign_family_steps_place_their_payloads(method, layout):
    many = getattr(gn, f"{method}_ef_step_many")
    gs = inputs()
    rs = [torch.from_numpy(gradient(n, seed=n + 1)) * 0.3 for n in SIZES]
    into, seen = placer(layout)
    payloads, news = many(gs, rs, 0.9, 1.0, [torch.empty(n) for n in SIZES], into=into)
    want_payloads, want_news = many(gs, rs, 0.9, 1.0, [torch.empty(n) for n in SIZES])
    check_placed(payloads, want_payloads, seen)
    for a, b in zip(want_news, news):
        same_bytes(a, b)


def test_a_place_that_does_not_fit_is_refused():
    xs = inputs()
    with pytest.raises(ValueError, match="do not fit"):  # a float32 scale at an odd byte
        gn.compress_many("terngrad", xs, [(1, 2)] * len(xs), into=lambda d, c: (
            torch.zeros(10**6, dtype=torch.uint8), [1] * len(d)))
    with pytest.raises(ValueError, match="do not fit"):  # past the end
        gn.compress_many("signsgd", xs, into=lambda d, c: (torch.zeros(8, dtype=torch.uint8), [0] * len(d)))


def test_a_kept_buffers_views_are_made_once_per_layout():
    """An ``into`` that hands its dict with the buffer (the exchange's frame buffer, kept from
    step to step) gets the same views back while buffer and layout stay, and new ones, at the new
    offsets, once either changes; the values are each call's."""
    gs = inputs()
    rs = [torch.from_numpy(gradient(n, seed=n + 1)) * 0.3 for n in SIZES]
    ks = [max(1, n // 100) for n in SIZES]
    kept, buffers = {}, {"frame": torch.zeros(10**6, dtype=torch.uint8)}

    def into(dtypes, counts, layout=as_frame):
        offsets, _ = layout(dtypes, counts)
        return buffers["frame"], offsets, kept

    def step(scale, place=into):
        values, indices, _ = gn.topk_ef_step_many([g * scale for g in gs], rs, ks, outs=[torch.empty(n) for n in SIZES],
                                                  into=place)
        want = gn.topk_ef_step_many([g * scale for g in gs], rs, ks)
        for got, expected in zip([*values, *indices], [*want[0], *want[1]]):
            same_bytes(expected, got)
        return [*values, *indices]

    first = step(1.0)
    again = step(2.0)
    assert all(a is b for a, b in zip(first, again)), "the same layout made its views again"
    moved = step(1.0, lambda d, c: into(d, c, backwards_with_gaps))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, moved))
    buffers["frame"] = torch.zeros(10**6, dtype=torch.uint8)  # (a new buffer: a layout outgrown)
    fresh = step(1.0, lambda d, c: into(d, c, backwards_with_gaps))
    start = buffers["frame"].data_ptr()
    assert all(start <= b.data_ptr() < start + 10**6 for b in fresh), "views of the buffer replaced"
    assert len(kept) == 1, "views of layouts gone are kept"


def test_frame_rows_of_a_repeated_layout_follow_each_steps_frames():
    """A bucket's frames repeat their layout every step: ``layout`` hands back the same tuple,
    and what FrameRows derives from it (made once) serves every step, while each step's frames
    give the pointers; a sum over them is each step's own."""
    dtypes, counts = ["float32", "int32"] * 3, [5, 5, 300, 300, 7, 7]
    pieces, _, size = frames.layout(dtypes, counts, False, False)
    assert frames.layout(list(dtypes), list(counts), False, False)[0] is pieces
    structure = [2, 2, 2]
    for step in range(3):  # each step's frames in a new buffer, with values of its own
        data = torch.zeros(4 * size, dtype=torch.uint8)
        values = {}
        for r in range(4):
            for (offset, count, dtype), d in zip(pieces, dtypes):
                if d == "float32":
                    v = torch.arange(count, dtype=torch.float32) * (step + 1) + r
                    data[r * size + offset:r * size + offset + 4 * count] = v.view(torch.uint8)
                    values.setdefault(offset, []).append(v)
                else:
                    data[r * size + offset:r * size + offset + 4 * count] = (
                        torch.arange(count, dtype=torch.int32).view(torch.uint8))
        rows = gn.FrameRows(data, range(0, 4 * size, size), pieces, structure)
        field = rows.field(0)
        start = data.data_ptr()
        assert [p - start for p in field.pointers] == [r * size + pieces[2 * u][0] for u in range(3) for r in range(4)]
        assert list(field.lengths()) == [count for count in counts[::2] for _ in range(4)]
        outs = [torch.empty(c) for c in counts[::2]]
        gn.scatter_add_segments_into(rows, outs, 4)
        for out, (offset, count, _) in zip(outs, pieces[::2]):
            same_bytes(sum(v / 4 for v in values[offset]), out)
