"""Tensors an exchange keeps from step to step, so that no step allocates gradient-sized ones.

On a backend whose tensors are mutable, a new gradient-sized tensor each step costs more than
the arithmetic on a CPU (fresh pages, mapped and zeroed by the kernel). So an exchange keeps:
flat buffers per name (a bucket's flat gradient, its joined payloads, its frame), free again
once the step's collective has been awaited; and one spare memory per unit (a bucket or a
gradient), into which the next memory is written, the old one becoming the next spare.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, Iterable, Sequence

from grace.core.compressor import Shape
from grace.core.memory import buffer_of


class Pieces(tuple):
    """Tensors a kernel meets more than once: views of one kept buffer (``Buffers.pieces_of``) or
    a bucket's memories (``Buffers.kept``), the same objects step after step; a step's gradients,
    compressed and then written over. ``derived``: what a kernel derives from them once (their
    native buffers), dropped with them."""

    def __new__(cls, views):
        pieces = super().__new__(cls, views)
        pieces.derived = {}
        return pieces

    def derive(self, key, make):
        """``make()``, made once and kept in ``derived`` under ``key``."""
        made = self.derived.get(key)
        if made is None:
            made = self.derived[key] = make()
        return made


def same_layout(xp, a, b) -> bool:
    """Whether state values ``a`` and ``b`` (tensors, or tuples of them) have the same shapes,
    dtypes and devices."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) \
            and all(same_layout(xp, x, y) for x, y in zip(a, b))
    return xp.same_layout(a, b)


def column(xs, i: int):
    """The ``i``-th of each of ``xs`` (tuples: DGC's (u, v) memories); of a kept ``Pieces``, a
    kept ``Pieces`` too, made once (so is what kernels derive from it)."""
    if getattr(xs, "derived", None) is None:
        return [x[i] for x in xs]
    return xs.derive(("column", i), lambda: Pieces([x[i] for x in xs]))


def subset(xs, indices):
    """``xs[i]`` for each of ``indices``; of a kept ``Pieces``, a ``Pieces`` made once per indices
    (so is what kernels derive from it)."""
    if getattr(xs, "derived", None) is None:
        return [xs[i] for i in indices]
    indices = tuple(indices)
    return xs.derive(("subset", indices), lambda: Pieces([xs[i] for i in indices]))


def zipped(xs, ys):
    """``(xs[i], ys[i])`` for each i; of two kept ``Pieces``, a ``Pieces`` kept with ``xs`` while it
    goes with ``ys`` (PowerSGD's factors, P and Q, each set with the same other set step after
    step), so is what kernels derive from it."""
    if getattr(xs, "derived", None) is None or getattr(ys, "derived", None) is None:
        return list(zip(xs, ys))
    made = xs.derived.get("zipped")
    if made is None or made[0] is not ys:
        made = xs.derived["zipped"] = (ys, Pieces(zip(xs, ys)))
    return made[1]


def buffers_of(memories):
    """Each memory's buffer (``buffer_of``): the kept ``Pieces`` of them that ``Buffers.take_spares``
    marks a step's ``memories`` (a ``Pieces``) with, whose native buffers are derived once; else a
    list."""
    derived = getattr(memories, "derived", None)
    kept = None if derived is None else derived.get("buffers")
    return kept if kept is not None else [buffer_of(m) for m in memories]


def laid_out(pieces: "Pieces", shapes) -> "Pieces":
    """``pieces`` (a step's gradients, handed to the exchange for a bucket) marked as of
    ``shapes`` (the bucket's ``ctx_shapes``), which ``shapes_of`` then hands out."""
    pieces.derived["laid out as"] = shapes
    return pieces


def marked_shapes(gs):
    """The shapes ``gs`` are marked as (``laid_out``: their bucket's ``ctx_shapes``, the same tuple
    every step; or found alike by ``laid_out_as``), or None."""
    derived = getattr(gs, "derived", None)
    return None if derived is None else derived.get("laid out as")


def shapes_of(xp, gs) -> Sequence:
    """Each of ``gs``' ctx (``Shape``): their bucket's (made once) where ``gs`` are a step's
    gradients marked by ``laid_out``, or kept tensors ``laid_out_as`` found alike; else made now
    (a Shape per gradient and step costs more than a small gradient's kernel)."""
    shapes = marked_shapes(gs)
    return shapes if shapes is not None else [Shape(xp.shape(g), xp.dtype(g)) for g in gs]


def laid_out_as(xp, kept, shapes) -> bool:
    """Whether ``kept`` (a kept ``Pieces``: memories, spares) holds tensors of ``shapes``:
    checked once per Pieces and ``shapes``."""
    derived = getattr(kept, "derived", None)
    if derived is None:
        return False
    if derived.get("laid out as") is not shapes:
        if len(kept) != len(shapes) or any(xp.shape(k) != c.shape for k, c in zip(kept, shapes)):
            return False
        derived["laid out as"] = shapes
    return True


def shaped_as(xp, news, outs, shapes) -> list:
    """A bucket call's new memories (``news``, written into ``outs``) as tensors of ``shapes``:
    the kept ``outs`` as they are where ``laid_out_as`` them, else each reshaped."""
    return list(outs) if laid_out_as(xp, outs, shapes) else [xp.reshape(e, c.shape) for e, c in zip(news, shapes)]


class Buffers:
    def __init__(self):
        self.flat: Dict[str, Any] = {}  # per name: flat gradients, joined payloads, frames
        self.spares: Dict[str, Any] = {}  # per unit: where its next memory is written
        # per name: the views made of that flat buffer for its latest layout (a bucket kernel's,
        # ``grace.native``'s ``_placed``; ``pieces_of``): made once, not per step (a view costs 0.4-1.5 us)
        self.views: Dict[str, dict] = {}

    def buffer_for(self, xp, name: str, dtype: str, numel: int, like):
        """A flat buffer of ``numel`` elements kept per ``name``. One outgrown (a variable-length
        frame) is replaced by one an eighth larger than needed."""
        buffer = self.flat.get(name)
        if buffer is None or xp.numel(buffer) < numel or xp.dtype(buffer) != dtype \
                or xp.device(buffer) != xp.device(like):
            grown = numel if buffer is None else numel + numel // 8
            buffer = self.flat[name] = xp.zeros(grown, dtype, like=like)
        return buffer if xp.numel(buffer) == numel else buffer[:numel]

    def pieces_of(self, xp, name: str, dtype: str, numels, like) -> tuple:
        """The buffer kept per ``name`` (``buffer_for``'s) and its pieces of ``numels`` elements
        (views, in order): the same views while the buffer and the numels stay (a view costs about
        0.4 us, and a bucket's payloads are cut alike every step)."""
        numels = tuple(numels)
        buffer = self.buffer_for(xp, name, dtype, sum(numels), like)
        kept = self.views.setdefault(name, {})
        if kept.get("pieces of") is not self.flat[name] or kept.get("numels") != numels:
            kept.clear()
            kept.update({"pieces of": self.flat[name], "numels": numels, "pieces": Pieces(xp.split(buffer, numels))})
        return buffer, kept["pieces"]

    def shaped_pieces(self, xp, name: str, dtype: str, shapes, like) -> Pieces:
        """``pieces_of``'s views reshaped to ``shapes`` (tuples), made once with them: where a
        kernel writes outputs kept from step to step (PowerSGD's factors)."""
        shapes = tuple(shapes)
        kept = self.views.get(name, {})
        shaped = kept.get(("shaped", dtype, shapes))
        if shaped is not None and kept["pieces of"] is self.flat.get(name):
            return shaped  # (pieces_of clears it with the views it replaces)
        self.flat.pop(name, None)  # (a new buffer: views of the one replaced may still be held)
        _, pieces = self.pieces_of(xp, name, dtype, [math.prod(shape) for shape in shapes], like)
        shaped = self.views[name]["shaped", dtype, shapes] = Pieces(
            [xp.reshape(piece, shape) for piece, shape in zip(pieces, shapes)])
        return shaped

    def concat_into_kept(self, xp, name: str, tensors):
        """1-d ``tensors`` as one, in the buffer kept per ``name`` where tensors are mutable."""
        if len(tensors) == 1:
            return tensors[0]
        if not xp.mutable_tensors:
            return xp.concat(tensors)
        numel, dtype = sum(xp.numel(t) for t in tensors), xp.dtype(tensors[0])
        return xp.concat_into(tensors, self.buffer_for(xp, name, dtype, numel, tensors[0]))

    def concat_gradients(self, bucket, xp, grads):
        """A bucket's gradients as one flat tensor (results never alias its buffer)."""
        if len(grads) == 1:
            return xp.flatten(grads[0])
        buffer = self.buffer_for(xp, f"{bucket.key}.gradient", bucket.dtype, bucket.numel, grads[0]) \
            if xp.mutable_tensors else None
        return xp.concat_flat(grads, buffer)

    def kept(self, name: str, values) -> Pieces:
        """``values`` (what the exchange keeps: a bucket's memories or spares, whose layouts and
        storage never change) as a ``Pieces``, the same one while they are the same objects: what
        kernels derive from it (native buffers) serves every step. The two latest per ``name``
        are kept, as memories and spares trade places each step."""
        latest = self.views.setdefault(name, {}).setdefault("kept", [])
        for pieces in latest:
            if len(pieces) == len(values) and all(map(operator.is_, pieces, values)):
                return pieces
        pieces = Pieces(values)
        latest[:] = [pieces, *latest[:1]]
        return pieces

    def take_spares(self, key: str, xp, names: Sequence[str], currents, leave: bool = False) -> Pieces:
        """``take_spare`` of each of bucket ``key``'s units (``names``, memories ``currents``),
        kept (``kept``). Where these memories were handed these spares before (two steps ago),
        they are taken again with no layout check unit by unit. ``leave``: the spares left in
        ``spares`` too (a caller that tells by them where it wrote). ``currents``, a ``Pieces``,
        is marked with the kept ``Pieces`` of its buffers (``buffers_of``)."""
        memories = self.kept(f"{key}.memories", buffers_of(currents))  # (a kept one's, as marked before)
        if isinstance(currents, Pieces):
            currents.derived["buffers"] = memories
        spares = memories.derived.get("spares")
        if spares is not None and all(map(operator.is_, map(self.spares.get, names), spares)):
            if not leave:
                for name in names:
                    self.spares.pop(name, None)  # (a unit without memory has no spare)
            return spares
        spares = self.kept(f"{key}.spares", [self.take_spare(n, xp, c) for n, c in zip(names, currents)])
        if xp.mutable_tensors:  # (each memory has its spare; a unit without one, None)
            memories.derived["spares"] = spares
        if leave:
            self.spares.update((name, spare) for name, spare in zip(names, spares) if spare is not None)
        return spares

    def take_spare(self, key: str, xp, current):
        """``key``'s spare memory (taken out), laid out like ``current`` (a deferred state: like
        its buffer), to write a new value into; None where tensors are immutable."""
        if not xp.mutable_tensors or current is None:
            return None
        current = buffer_of(current)
        spare = self.spares.pop(key, None)
        if spare is None or not same_layout(xp, spare, current):
            spare = tuple(xp.zeros_like(t) for t in current) if isinstance(current, tuple) else xp.zeros_like(current)
        return spare

    def forget(self, key: str, names: Iterable[str]) -> None:
        """Drop what is kept for bucket ``key`` and its gradients ``names`` (a layout that ended)."""
        self.spares.pop(key, None)
        for name in names:
            self.spares.pop(name, None)
        for kept in (self.flat, self.views):
            for name in [n for n in kept if n == key or n.startswith(key + ".")]:
                del kept[name]


def flat_concat(xp, tensors):
    """``tensors`` flattened, as one (a new tensor where there are several)."""
    flat = [xp.flatten(t) for t in tensors]
    return flat[0] if len(flat) == 1 else xp.concat(flat)


def assign_ranges(xp, outs, parts) -> bool:
    """Flat ``parts``, end to end, written over ``outs`` end to end (the parts' elements past
    the outs' end dropped: a shard's padding), in one ``assign_many``; False, writing nothing,
    where an out's memory is not one flat run (``xp.flat_view``)."""
    pieces = ranges_over(xp, outs, [xp.numel(part) for part in parts])
    if pieces is None:
        return False
    xp.assign_many([dst for _, _, _, dst in pieces], [parts[i][at:at + n] for i, at, n, _ in pieces])
    return True


def ranges_over(xp, outs, sizes):
    """Where parts of ``sizes`` elements, end to end, fall over ``outs`` end to end (the parts'
    elements past the outs' end dropped): [(part, its first element there, count, the view of an
    out they fill)], in order; None where an out's memory is not one flat run (``xp.flat_view``)."""
    views = [xp.flat_view(out) for out in outs]
    if any(v is None for v in views):
        return None
    pieces, i, at = [], 0, 0  # (part i, from its element at)
    for view in views:
        lo, numel = 0, xp.numel(view)
        while lo < numel:
            take = min(numel - lo, sizes[i] - at)
            pieces.append((i, at, take, view[lo:lo + take]))
            lo, at = lo + take, at + take
            if at == sizes[i]:
                i, at = i + 1, 0
    return pieces


def assign(xp, dst, src) -> None:
    """``src`` written into ``dst`` (tensors, or tuples of them)."""
    if isinstance(dst, tuple):
        for d, s in zip(dst, src):
            xp.assign(d, s)
    else:
        xp.assign(dst, src)
