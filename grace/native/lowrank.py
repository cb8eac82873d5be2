"""PowerSGD's products for a bucket's matrices (CPU), each element summed in one fixed order.

    lowrank_project_many(ms, qs, shapes, residuals, m_outs, nonfinite, deferred, p_into),
    lowrank_back_many(ms, ps, shapes, unit, q_into),
    lowrank_expand_many(ps, qs, shapes, outs, divisor, ms, residual_outs, q_into);
    lowrank_project, lowrank_back, lowrank_expand: the same for one matrix

The factors they make go into one new buffer, or into ``*_into``: tensors an exchange keeps
(``grace.core.buffers.Pieces``: their buffers and addresses derived once, not per step).
"""
from __future__ import annotations

import ctypes
import functools
import itertools

from grace.native._arrays import c_array, call
from grace.native._common import (_addresses, _cpu_kind, _derived_once, _float32_sizes, _in_place_all, _int64s,
                                  _pointers, _pointers_of, _same_kind_all)


def _lowrank_buffers(kind, inputs, outputs=()):
    """PowerSGD's float32 matrices as buffers (the short path for contiguous CPU tensors: these
    calls come per gradient), then the outputs written in place."""
    ins = _same_kind_all(kind, inputs)
    _derived_once(inputs, "float32 sizes", lambda: _float32_sizes(ins, "a PowerSGD product"))  # (as _float32_all)
    return ins + (_in_place_all(kind, outputs, "float32") if outputs else [])


def _rank(n: int, rows: int, cols: int, factor: int, factor_rows: int) -> int:
    """r of a factor_rows x r factor beside a rows x cols matrix of n elements."""
    r = factor // factor_rows if factor_rows > 0 else 0
    if rows < 1 or cols < 1 or n != rows * cols or r < 1 or factor != factor_rows * r:
        raise ValueError(f"a {rows} x {cols} matrix and a {factor_rows} x r factor are needed, "
                         f"got {n} and {factor} elements")
    return r


def lowrank_project_many(ms, qs, shapes, residuals=None, m_outs=None, nonfinite=None, deferred=None, p_into=None):
    """PowerSGD's first product for many matrices in one call (CPU): for each s, p_s = M_s q_s,
    (rows x r, row-major), for M_s the rows x cols (``shapes[s]``) float32 matrix in
    ``ms[s]``, or, where ``residuals[s]`` is given (not None), M_s = ms[s] + residuals[s] written
    into ``m_outs[s]`` in the same pass; where ``deferred[s]`` is also given, a pair (p', q') of
    factors (rows x r, cols x r), M_s = ms[s] + (residuals[s] - p' q'^T), the residual's subtraction
    left to this pass (p' q'^T made as ``lowrank_expand_many`` makes it). ``nonfinite`` (a
    one-element float32 tensor, optional) is set to 1 where an ms[s] holds an inf or a NaN and
    left as it is otherwise (a bucket's gradients share one). Each element is summed in one
    fixed order on every build and thread count. Returns the p_s, (rows, r) views of one new buffer
    (or ``p_into``, written)."""
    kind = _cpu_kind(ms[0])
    mb, qb = _lowrank_buffers(kind, ms), _lowrank_buffers(kind, qs)
    shapes = _as_key(shapes)
    ranks = _ranks(shapes, tuple([q.n for q in qb]), True, tuple([m.n for m in mb]))
    sums = outs = dps = dqs = None
    if residuals is None and deferred is not None:
        raise ValueError("deferred factors need the residual they are subtracted from")
    if residuals is not None:
        sums, outs = _where_given(kind, residuals, m_outs)
        if any(e is not None and not e.n == o.n == m.n for e, o, m in zip(sums, outs, mb)):
            raise ValueError("each residual and m_out must have its matrix's size")
        if deferred is not None:
            dps, dqs = _deferred_factors(kind, deferred, sums, shapes, ranks)
    flag = None
    if nonfinite is not None:
        (flag,) = _lowrank_buffers(kind, [], [nonfinite])
        if flag.n != 1:
            raise ValueError("the overflow flag is one float32 element")
    ps, places = _factors(kind, [rows for rows, _ in shapes], ranks, p_into)
    call(kind, "lowrank_project_many", len(mb), _pointers_of(ms, mb), _maybe_pointers(sums, residuals),
         *_deferred_pointers(deferred, dps, dqs), *_shapes(shapes), _pointers_of(qs, qb), _int64s(ranks),
         _maybe_pointers(outs, m_outs), places, flag and flag.ptr)
    return _wrap_list(kind, ps, p_into)


def lowrank_back_many(ms, ps, shapes, unit: bool = False, q_into=None):
    """PowerSGD's second product for many matrices in one call (CPU): q_s = M_s^T p_s
    (cols x r, row-major), for the rows x cols float32 matrix M_s in ``ms[s]`` and p_s rows x
    r, each element summed over the rows in order. ``unit``: each p_s of one column is first
    made p / |p| in place (the squares summed in float64, in order; the first unit vector
    where p is zero), as the backends' ``orthonormalize``. Returns the q_s, (cols, r) views of one new buffer
    (or ``q_into``, written)."""
    kind = _cpu_kind(ms[0])
    mb = _lowrank_buffers(kind, ms)
    pb = _in_place_all(kind, ps, "float32")
    shapes = _as_key(shapes)
    ranks = _ranks(shapes, tuple([p.n for p in pb]), False, tuple([m.n for m in mb]))
    qs, places = _factors(kind, [cols for _, cols in shapes], ranks, q_into)
    call(kind, "lowrank_back_many", len(mb), _pointers_of(ms, mb), *_shapes(shapes), _pointers_of(ps, pb),
         _int64s(ranks), int(unit), places)
    return _wrap_list(kind, qs, q_into)


def lowrank_expand_many(ps, qs, shapes, outs, divisor: float = 1.0, ms=None, residual_outs=None, q_into=None):
    """PowerSGD's approximation for many matrices in one call (CPU): q'_s = q_s / ``divisor``
    ((cols, r) views of one new buffer, or ``q_into``), then p_s q'_s^T (rows x cols, flat) into ``outs[s]`` (a
    new tensor where None; not ms[s]), and where ``residual_outs[s]`` is given, ms[s] - p_s
    q'_s^T into it in the same pass (it may be ms[s]). Returns (the approximations, the q'_s)."""
    kind = _cpu_kind(ps[0])
    pb, qb = _lowrank_buffers(kind, ps), _lowrank_buffers(kind, qs)
    shapes = _as_key(shapes)
    ranks = _ranks(shapes, tuple([p.n for p in pb]), False)
    if any(q.n != cols * r for q, (_, cols), r in zip(qb, shapes, ranks)):
        raise ValueError("each q must be cols x r")
    made = [kind.empty(rows * cols, "float32") if o is None else None for o, (rows, cols) in zip(outs, shapes)]
    if any(o is None for o in outs):
        given = iter(_lowrank_buffers(kind, [], [o for o in outs if o is not None]))  # (one call for them all)
        ob = [b if o is None else next(given) for b, o in zip(made, outs)]
        out_pointers = _pointers(ob)
    else:  # (as they are: a kept list's buffers are derived once)
        ob = _lowrank_buffers(kind, [], outs)
        out_pointers = _pointers_of(outs, ob)
    mb = eb = None
    if residual_outs is not None:
        mb, eb = _where_given(kind, [None if e is None else m for m, e in zip(ms, residual_outs)], residual_outs)
    if any(o.n != rows * cols or (e is not None and not m.n == e.n == rows * cols)
           for o, m, e, (rows, cols) in zip(ob, mb or ob, eb or [None] * len(ob), shapes)):
        raise ValueError("out, m and residual_out must have rows x cols elements")
    divided, places = _factors(kind, [cols for _, cols in shapes], ranks, q_into)
    call(kind, "lowrank_expand_many", len(pb), _pointers_of(ps, pb), _pointers_of(qs, qb), *_shapes(shapes),
         _int64s(ranks), float(divisor), places, out_pointers, _maybe_pointers(mb), _maybe_pointers(eb))
    divided = _wrap_list(kind, divided, q_into)  # (synced)
    return [o if b is None else kind.wrap(b.obj) for o, b in zip(outs, made)], divided


def lowrank_project(m, q, rows: int, cols: int, residual=None, m_out=None, nonfinite=None, deferred=None):
    """lowrank_project_many of one matrix."""
    return lowrank_project_many([m], [q], [(rows, cols)], None if residual is None else [residual],
                                None if residual is None else [m_out], nonfinite,
                                None if deferred is None else [deferred])[0]


def lowrank_back(m, p, rows: int, cols: int, unit: bool = False):
    """lowrank_back_many of one matrix (``p`` made a unit vector in place where ``unit``)."""
    return lowrank_back_many([m], [p], [(rows, cols)], unit)[0]


def lowrank_expand(p, q, rows: int, cols: int, out=None, m=None, residual_out=None, divisor: float = 1.0):
    """lowrank_expand_many of one matrix: its approximation (q divided by ``divisor`` first)."""
    return lowrank_expand_many([p], [q], [(rows, cols)], [out], divisor, None if m is None else [m],
                               None if residual_out is None else [residual_out])[0][0]


def _as_key(shapes) -> tuple:
    """A list of (rows, cols) as a tuple of tuples: what the checks and C arrays made once per
    bucket layout are kept by."""
    return shapes if type(shapes) is tuple else tuple(map(tuple, shapes))


@functools.lru_cache(maxsize=1024)
def _shapes(shapes: tuple):
    """The C arrays of the rows and the cols of (rows, cols) tuples (read only: kept per layout)."""
    return _int64s([rows for rows, _ in shapes]), _int64s([cols for _, cols in shapes])


@functools.lru_cache(maxsize=1024)
def _ranks(shapes: tuple, factors: tuple, of_cols: bool, ns: tuple = None) -> tuple:
    """``_rank`` of each rows x cols matrix (of ``ns[s]`` elements; rows x cols where not given)
    beside its factor of ``factors[s]`` elements, cols x r where ``of_cols``, else rows x r:
    checked once per bucket layout."""
    ns = ns or [rows * cols for rows, cols in shapes]
    return tuple(_rank(n, rows, cols, f, cols if of_cols else rows) for n, (rows, cols), f in zip(ns, shapes, factors))


def _factors(kind, rows, ranks, into=None):
    """One new float32 buffer for factors of ``rows[s]`` x ``ranks[s]`` (row-major): a (rows, r)
    view of it for each, and their addresses (a C array). Of one r (rank 1, a bucket's usual
    case), the views come from one split of the buffer seen as (total rows, r): no view made per
    factor, and none again where a caller asks for that shape. ``into``: the factors' tensors,
    given (contiguous float32, written in place); their addresses kept with a ``Pieces``."""
    sizes = [n * r for n, r in zip(rows, ranks)]
    if into is not None:
        bufs = _in_place_all(kind, into, "float32")
        if [b.n for b in bufs] != sizes:
            raise ValueError("each factor given must have rows x r elements")
        return list(into), _pointers_of(into, bufs)
    buf, starts = kind.empty(sum(sizes), "float32"), [0, *itertools.accumulate(sizes[:-1])]
    if kind.name == "torch" and len(set(ranks)) == 1:
        views = buf.obj.view(-1, ranks[0]).split(list(rows)) if rows else []
    elif kind.name == "torch":
        views = [v.view(n, r) for v, n, r in zip(buf.obj.split(sizes), rows, ranks)]
    else:
        views = [buf.obj[o:o + n * r].reshape(n, r) for o, n, r in zip(starts, rows, ranks)]
    return list(views), _addresses(buf, [4 * o for o in starts])


def _wrap_list(kind, objs, into=None):
    """The factors made (``objs``), as arrays of the inputs' kind; ``into`` as it is where given
    (written in place: the caller's own)."""
    kind.sync()
    return list(into) if into is not None else [kind.wrap(o) for o in objs]


def _where_given(kind, inputs, outputs):
    """Buffers of ``inputs[s]`` and ``outputs[s]`` where inputs[s] is not None, else None."""
    given = [s for s, x in enumerate(inputs) if x is not None]
    if len(given) == len(inputs):  # (as they are: a kept Pieces' buffers are derived once)
        return _lowrank_buffers(kind, inputs), _in_place_all(kind, outputs, "float32")
    bufs = _lowrank_buffers(kind, [inputs[s] for s in given], [outputs[s] for s in given])
    ins, outs = [None] * len(inputs), [None] * len(inputs)
    for k, s in enumerate(given):
        ins[s], outs[s] = bufs[k], bufs[len(given) + k]
    return ins, outs


def _deferred_factors(kind, deferred, sums, shapes, ranks):
    """The buffers of each given pair of deferred factors (rows x r and cols x r), None elsewhere:
    (Ps, Qs); made and checked once for a kept list of pairs."""
    if any(sums[s] is None for s, pair in enumerate(deferred) if pair is not None):
        raise ValueError("deferred factors need the residual they are subtracted from")
    return _derived_once(deferred, ("factors", shapes, ranks), lambda: _factor_buffers(kind, deferred, shapes, ranks))


def _factor_buffers(kind, deferred, shapes, ranks):
    """``_deferred_factors``' buffers, made and checked."""
    dps, dqs = [None] * len(deferred), [None] * len(deferred)
    given = [s for s, pair in enumerate(deferred) if pair is not None]
    bufs = _lowrank_buffers(kind, [t for s in given for t in deferred[s]])  # (one call for them all)
    for k, s in enumerate(given):
        dps[s], dqs[s] = bufs[2 * k], bufs[2 * k + 1]
        (rows, cols), r = shapes[s], ranks[s]
        if dps[s].n != rows * r or dqs[s].n != cols * r:
            raise ValueError(f"deferred factors of a {rows} x {cols} matrix must be {rows} x {r} and {cols} x {r}")
    return dps, dqs


def _maybe_pointers(bufs, xs=None):
    """A C array of the buffers' pointers (NULL for None), or NULL for no list; ``xs``: the list
    they are the buffers of, where each is given (``_pointers_of``: made once for a kept one)."""
    if bufs is not None and xs is not None and None not in bufs:
        return _pointers_of(xs, bufs)
    return None if bufs is None else c_array(ctypes.c_void_p, len(bufs))(*[b and b.ptr for b in bufs])


def _deferred_pointers(deferred, dps, dqs):
    """``_maybe_pointers`` of the deferred factors' buffers: made once for a kept list of pairs."""
    if dps is None:
        return None, None
    return _derived_once(deferred, "factor pointers", lambda: (_maybe_pointers(dps), _maybe_pointers(dqs)))
