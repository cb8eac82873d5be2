"""The buffers an exchange keeps from step to step: kept lists of memories and spares, whose
native buffers a kernel derives once, and the spares a bucket's memories trade places with."""
from __future__ import annotations

import operator

import numpy as np

import grace
from grace import Exchange
from grace.compressors.powersgd import LowRankResidual, PowerSGD
from grace.core.buffers import Buffers, Pieces, buffers_of, column, zipped
from grace.core.communicator import LocalCommunicator
from grace.core.memory import buffer_of
from grace.memories.powersgd import PowerSGDMemory
from tests.unit.conftest import to_backend


def test_kept_is_the_same_pieces_while_its_values_are_the_same_objects(xp):
    buffers = Buffers()
    a, b = [to_backend(xp, np.zeros(3)) for _ in range(4)], [to_backend(xp, np.zeros(3)) for _ in range(4)]
    first = buffers.kept("k.memories", a)
    assert isinstance(first, Pieces) and list(first) == a
    first.derived["bufs"] = "derived once"
    assert buffers.kept("k.memories", list(a)) is first  # (a new list of the same objects)
    other = buffers.kept("k.memories", b)  # memories and spares in turn: both kept
    assert other is not first and buffers.kept("k.memories", a) is first and buffers.kept("k.memories", b) is other
    changed = buffers.kept("k.memories", a[:3] + [b[3]])  # one of them another object
    assert changed is not first and "bufs" not in changed.derived
    buffers.forget("k", [])
    assert buffers.kept("k.memories", a) is not first  # dropped with the layout


def test_a_kept_pairs_column_is_kept_with_it(xp):
    pairs = [(to_backend(xp, np.zeros(2)), to_backend(xp, np.ones(2))) for _ in range(3)]
    assert column(pairs, 1) == [v for _, v in pairs]  # (a plain list: a list)
    kept = Buffers().kept("k.old", pairs)
    us = column(kept, 0)
    assert isinstance(us, Pieces) and list(us) == [u for u, _ in pairs] and column(kept, 0) is us


def test_a_kept_pieces_derives_each_thing_once():
    pieces, made = Pieces([1, 2]), []
    assert pieces.derive("k", lambda: made.append("k") or "first") == "first"
    assert pieces.derive("k", lambda: made.append("k") or "again") == "first" and made == ["k"]
    assert Pieces([1, 2]).derive("k", lambda: "other") == "other"  # (another Pieces: its own)


def test_pairs_of_two_kept_pieces_are_kept_while_they_go_together(xp):
    ps, qs, others = (Pieces([to_backend(xp, np.zeros(2)) for _ in range(3)]) for _ in range(3))
    pairs = zipped(ps, qs)
    assert isinstance(pairs, Pieces) and list(pairs) == list(zip(ps, qs)) and zipped(ps, qs) is pairs
    other = zipped(ps, others)  # (another partner: its pairs, not the ones kept)
    assert other is not pairs and all(p is a and q is b for (p, q), (a, b) in zip(other, zip(ps, others)))
    assert zipped(list(ps), qs) == list(zip(ps, qs))  # (a plain list: a list)


def test_a_steps_memories_are_marked_with_their_kept_buffers(xp):
    """``take_spares`` marks a step's memories (a ``Pieces``) with the kept ``Pieces`` of their
    buffers (a deferred memory's its buffer, none's None): the same while they are the same
    objects, new ones where a memory is another."""
    buffers, names = Buffers(), ["w", "b", "v"]
    m = to_backend(xp, np.ones((2, 3)))
    memories = Pieces([LowRankResidual(m, to_backend(xp, np.ones((2, 1))), to_backend(xp, np.ones((3, 1)))), None,
                       to_backend(xp, np.ones(4))])
    assert [b is e for b, e in zip(buffers_of(memories), [m, None, memories[2]])] == [True] * 3  # (unmarked: made)
    buffers.take_spares("k", xp, names, memories)
    kept = buffers_of(memories)
    assert isinstance(kept, Pieces) and all(map(operator.is_, kept, [m, None, memories[2]]))
    again = Pieces(list(memories))
    buffers.take_spares("k", xp, names, again)
    assert buffers_of(again) is kept
    other = Pieces([to_backend(xp, np.ones((2, 3))), None, memories[2]])  # (another memory: other buffers)
    buffers.take_spares("k", xp, names, other)
    assert buffers_of(other) is not kept and all(map(operator.is_, buffers_of(other), other))


def test_a_unit_without_memory_leaves_its_buckets_spares_taken_as_kept(xp):
    """A bucket with a unit without memory (PowerSGD's vectors: no spare) still takes its
    spares as kept two steps before (no layout check unit by unit); ``leave``: left in
    ``spares`` too."""
    if not xp.mutable_tensors:
        return
    buffers, names = Buffers(), ["w", "b"]
    memories, handed = [to_backend(xp, np.ones(3)), None], []
    for step in range(4):  # a step: the spare becomes the memory, the memory the next spare
        spares = buffers.take_spares("k", xp, names, memories, leave=True)
        assert spares[1] is None and buffers.spares.get("w") is spares[0] and "b" not in buffers.spares
        handed.append(spares)
        buffers.spares["w"], memories = memories[0], [spares[0], None]
    assert handed[2] is handed[0] and handed[3] is handed[1] and handed[0][0] is not handed[1][0]


def test_a_buckets_spares_trade_places_with_its_memories(xp):
    """``take_spares``: each memory's spare laid out like it; where these memories had these spares
    two steps ago, the same spares again; a memory of another layout, or a spare that is no longer
    the one kept (an overflow's undo put another there), is not handed a spare of the old."""
    if not xp.mutable_tensors:
        assert list(Buffers().take_spares("k", xp, ["a"], [to_backend(xp, np.zeros(2))])) == [None]
        return
    buffers, names = Buffers(), ["a", "b"]
    memories = [to_backend(xp, np.ones(3)), (to_backend(xp, np.ones(2)), to_backend(xp, np.ones(2)))]
    handed = [buffers.take_spares("k", xp, names, memories)]
    assert xp.shape(handed[0][0]) == (3,) and [xp.shape(t) for t in handed[0][1]] == [(2,), (2,)]
    for step in range(1, 5):  # a step: the spares become the memories, the old memories the spares
        buffers.spares.update(zip(names, memories))
        old, memories = memories, list(handed[-1])
        handed.append(buffers.take_spares("k", xp, names, memories))
        assert all(a is b for a, b in zip(handed[-1], old)) and not buffers.spares  # (taken out)
        if step >= 2:
            assert handed[-1] is handed[-3]  # (kept: no layout checked unit by unit)
    buffers.spares.update(zip(names, memories))
    buffers.spares["a"] = to_backend(xp, np.zeros(3))  # another buffer put there (an overflow's undo)
    taken = buffers.take_spares("k", xp, names, list(handed[-1]))
    assert taken[0] is not handed[-2][0] and taken[1] is handed[-2][1]
    buffers.spares.update(zip(names, list(handed[-1])))
    wider = [to_backend(xp, np.ones(5)), taken[1]]  # a memory of another layout
    assert xp.shape(buffers.take_spares("k", xp, names, wider)[0]) == (5,)


def test_dgcs_bucket_trades_two_buffers_per_gradient_and_stays_the_reference(xp):
    """A bucketed DGC exchange (kept memories, spares and their native buffers) gives the
    gradient-by-gradient reference results bit for bit, step after step, with each gradient's
    memory in two buffers in turn (mutable tensors)."""
    shapes = {"w": (40, 30), "b": (30,), "v": (7, 11)}
    rng = np.random.default_rng(1)
    exchanges = [Exchange(grace.create("dgc", ratio=0.1, sample_ratio=0.5, bucket_mb=mb), LocalCommunicator())
                 for mb in (0, 1)]
    held = []
    for step in range(5):
        grads = {n: rng.standard_normal(s) for n, s in shapes.items()}
        results = [{n: xp.to_numpy(t) for n, t in e.exchange({n: to_backend(xp, g) for n, g in grads.items()}).items()}
                   for e in exchanges]
        for name in shapes:
            np.testing.assert_array_equal(results[1][name], results[0][name], err_msg=f"{name} at step {step}")
        memory = exchanges[1].store.tables["memory"]["w"]
        held.append(buffer_of(memory))
    if xp.mutable_tensors:
        assert held[2] is held[4] and held[1] is held[3] and held[2] is not held[3]


def test_dgcs_bucket_call_keeps_nothing_stale_across_tensors_skips_and_restores(xp):
    """A bucketed DGC exchange (its bucket call's buffers, sizes, pointers and pair rooms kept with
    the memories and spares) gives the gradient-by-gradient reference results and memories bit for
    bit: through the sparsity warm-up (k shrinking step by step), the same gradient tensors then
    others, a skipped step (infs), and a checkpoint of an early step restored (k as large again,
    into the same spares)."""
    shapes = {"w": (40, 30), "b": (30,), "v": (7, 11), "c": (11,)}
    rng = np.random.default_rng(4)
    made = [grace.create("dgc", ratio=0.02, sample_ratio=0.5, sparsity_warmup_steps=5, bucket_mb=mb) for mb in (0, 1)]
    exchanges = [Exchange(made[0], LocalCommunicator()), Exchange(made[1], LocalCommunicator(), in_place=True)]
    handed = [{n: to_backend(xp, np.zeros(s, np.float32)) for n, s in shapes.items()} for _ in range(2)]
    saved = {}  # (a late checkpoint restored first: spares new to its small k, which the early one's then outgrows)
    events = [(0, "save early"), (0, None), (1, None), (1, "inf"), (0, None), (0, None), (0, None), (0, "save late"),
              (1, "restore late"), (1, None), (0, "restore early"), (0, None), (1, None)]
    for step, (which, event) in enumerate(events):
        values = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        for value in values.values() if event == "inf" else ():  # (every gradient's: the reference skips all)
            value.flat[3] = np.inf
        if event and event.startswith("restore"):
            for exchange, state in zip(exchanges, saved[event.split()[1]]):
                exchange.load_state_dict(state)
        results = []
        for exchange in exchanges:
            grads = {n: to_backend(xp, v) for n, v in values.items()}
            if exchange is exchanges[1] and xp.mutable_tensors:  # (the same tensors, new values in them)
                grads = handed[which]
                for name, g in grads.items():
                    xp.assign(g, to_backend(xp, values[name]))
            results.append({n: xp.to_numpy(t) for n, t in exchange.exchange(grads).items()})
        for name in shapes:
            np.testing.assert_array_equal(results[1][name], results[0][name], err_msg=f"{name} at step {step}")
        if event and event.startswith("save"):
            saved[event.split()[1]] = [exchange.state_dict() for exchange in exchanges]
    memories = [exchange.state_dict()["memory"] for exchange in exchanges]
    for name in shapes:
        for got, want in zip(memories[1][name], memories[0][name]):
            np.testing.assert_array_equal(xp.to_numpy(got), xp.to_numpy(want), err_msg=f"memory {name}")


def test_powersgds_bucket_keeps_its_factors_in_two_sets_in_turn_and_stays_the_reference(xp):
    """A bucketed PowerSGD exchange writes each step's factors into the one of two kept sets that
    no memory or state refers to (a skipped step's put back included) and gives the per-gradient
    reference results bit for bit."""
    shapes = {"w": (40, 30), "b": (30,), "v": (7, 11)}
    rng = np.random.default_rng(2)
    exchanges = [Exchange(grace.create("powersgd", rank=1, bucket_mb=mb), LocalCommunicator()) for mb in (0, 1)]
    held = []
    for step in range(4):
        grads = {n: to_backend(xp, rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()}
        results = [{n: xp.to_numpy(t) for n, t in e.exchange(grads).items()} for e in exchanges]
        for name in shapes:
            np.testing.assert_array_equal(results[1][name], results[0][name], err_msg=f"{name} at step {step}")
        held.append(exchanges[1].store.tables["state"]["w"])
    for step in range(2):  # a skipped step (an inf), then one that runs
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        grads["v"][2, 3] = np.inf if step == 0 else grads["v"][2, 3]
        out = exchanges[1].exchange({n: to_backend(xp, g) for n, g in grads.items()})["w"]
        assert np.isnan(xp.to_numpy(out)).all() == (step == 0)
        held.append(exchanges[1].store.tables["state"]["w"])
    if xp.mutable_tensors and xp.native("lowrank_project_many", held[0], "float32"):
        assert held[0] is held[2] and held[1] is held[3] is held[4] and held[5] is held[2] and held[0] is not held[1]


def test_powersgds_bucket_handed_the_same_gradients_then_others_stays_the_reference(xp):
    """The same gradient tensors step after step (new values written into them: what a kernel
    derives from a kept list of them serves every step), then other tensors, then the first
    again: the bucketed PowerSGD exchange gives the per-gradient reference results bit for bit."""
    shapes = {"w": (40, 30), "b": (30,), "v": (7, 11), "c": (11,)}
    rng = np.random.default_rng(3)
    exchanges = [Exchange(grace.create("powersgd", rank=1, bucket_mb=mb), LocalCommunicator(), in_place=in_place)
                 for mb, in_place in ((0, False), (1, True))]
    handed = [{n: to_backend(xp, np.zeros(s)) for n, s in shapes.items()} for _ in range(2)]
    for step, which in enumerate([0, 0, 0, 1, 1, 0, 0]):
        values = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        results = []
        for exchange in exchanges:
            grads = handed[which] if exchange is exchanges[1] else {n: to_backend(xp, v) for n, v in values.items()}
            for name, g in grads.items():  # (in place, where tensors are mutable: the same objects)
                if grads is not handed[which]:
                    continue
                if xp.mutable_tensors:
                    xp.assign(g, to_backend(xp, values[name]))
                else:
                    grads[name] = to_backend(xp, values[name])
            results.append({n: xp.to_numpy(t) for n, t in exchange.exchange(grads).items()})
        for name in shapes:
            np.testing.assert_array_equal(results[1][name], results[0][name], err_msg=f"{name} at step {step}")


class _MadeByUpdate(PowerSGDMemory):
    """PowerSGD's memory made by the first update, not by init (which makes none)."""

    def init(self, xp, g):
        return None


def test_a_memory_stored_after_its_init_made_none_is_read(xp):
    """A unit whose memory init made none at its plan's first step (PowerSGD's vectors) is not
    made again, but a value stored since is read: a memory made by its first update serves as in
    the per-gradient reference."""
    shapes = {"w": (40, 30), "b": (30,), "v": (7, 11)}
    rng = np.random.default_rng(4)
    exchanges = [Exchange(grace.GradientCompression(PowerSGD(1), _MadeByUpdate(), bucket_mb=mb), LocalCommunicator())
                 for mb in (0, 1)]
    for step in range(4):
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        results = [{n: xp.to_numpy(t) for n, t in e.exchange({n: to_backend(xp, g) for n, g in grads.items()}).items()}
                   for e in exchanges]
        for name in shapes:
            np.testing.assert_array_equal(results[1][name], results[0][name], err_msg=f"{name} at step {step}")
    assert sorted(exchanges[1].store.tables["memory"]) == ["v", "w"]


def test_a_sparsifiers_ks_are_made_once_per_bucket_layout_and_again_for_another(xp):
    from grace.compressors.topk import TopK
    from grace.core.buffers import laid_out
    from grace.core.compressor import Shape
    from grace.kernels.sparse import SparseKernels

    kernels = SparseKernels(TopK(0.3))
    gs = [to_backend(xp, np.zeros(n, np.float32)) for n in (5, 9, 1)]
    plain = [TopK(0.3).kernel_argument(xp.numel(g)) for g in gs]  # (unmarked: asked of each gradient)
    assert list(kernels._kernel_arguments(xp, gs)) == plain == [2, 3, 1]
    shapes = tuple(Shape((n,), "float32") for n in (5, 9, 1))
    first = kernels._kernel_arguments(xp, laid_out(Pieces(gs), shapes))
    assert list(first) == plain
    assert kernels._kernel_arguments(xp, laid_out(Pieces(list(gs)), shapes)) is first  # (a later step's gradients)
    other = tuple(Shape((n,), "float32") for n in (10, 9, 4))  # another layout: made again, from its shapes
    gs = [to_backend(xp, np.zeros(n, np.float32)) for n in (10, 9, 4)]
    assert list(kernels._kernel_arguments(xp, laid_out(Pieces(gs), other))) == [3, 3, 2]
