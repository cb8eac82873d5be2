"""The frames of a bucket whose segments send a number of (value, index) pairs that varies by
step and rank (a threshold's selection, segment-wise: ``grace.core.plans.segmented``): a header
of counts that goes first, and the frame once every rank's counts are read back."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from grace.core.bucket import ITEMSIZE, Dense, _order, _padded, frame_size
from grace.core.segments import SegmentTable
from grace.formats import index_dtype


FLAG_SHIFT = 62  # the bit of a header's last count that carries the overflow flag (counts stay below 2**62)


class SparseFrames:
    """The frames of a bucket whose segments each send a number of (value, index) pairs that
    varies by step and rank (a threshold's selection): c_s values in the bucket's dtype and c_s
    indices within the segment, in the smallest integer type that holds its size. A rank sends
    a header, each piece's count (int64), by an allgather of equal sizes, and beside it its
    frame: the pieces widest first (the values beside the int32 indices, in segment order), the
    overflow flag, padding. Header and frame end to end are byte for byte the frame
    ``bucket.frame`` makes of the segments' own payloads (but for the flag, which the header
    carries too, where the ranks read it: ``header_of``); sent apart, every rank's counts are
    read back at once, not one rank's after another, and the header goes before the frame is
    made (whose size needs the counts on the host). A rank whose frame would be larger than the
    dense bucket sends that instead, after the same header (``sends_dense``). A frame is
    written with a split and a join of whole tensors (one per index type), whatever the number
    of segments."""

    def __init__(self, xp, table: SegmentTable, dtype: str, flagged: bool, like):
        self.dtype, self.flagged, self.numel = dtype, flagged, table.numel
        self.dtypes = [d for n in table.numels for d in (dtype, index_dtype(n))]  # the pieces, payload order
        self.order = _order(self.dtypes)  # the pieces, frame order
        self.header = 8 * len(self.dtypes)
        # per index type: its segments, in order
        self.kinds = {d: [s for s, n in enumerate(table.numels) if index_dtype(n) == d]
                      for d in dict.fromkeys(self.dtypes[1::2])}
        self._starts = np.asarray(table.starts, np.int64)
        self._itemsizes = np.asarray([ITEMSIZE[d] for d in self.dtypes], np.int64)
        self._spread = {}  # per number of sparse frames read at once: see _spread_of
        self._twice = xp.asarray(np.arange(len(self.dtypes)) // 2, like=like)  # (each count's place, twice)
        # the overflow flag, on top of the header's last count: read back with the counts
        self._flag_place = xp.asarray(np.int64([0] * (len(self.dtypes) - 1) + [1 << FLAG_SHIFT]), like=like)
        self._like = like

    def size(self, counts: Sequence[int]) -> int:
        """The bytes a rank sends (header and frame) where its segments send ``counts`` pairs."""
        return frame_size([c for c in counts for _ in (0, 1)], self.dtypes, True, self.flagged)

    def dense_size(self) -> int:
        """The bytes a rank sends (header and frame) where it sends the dense bucket instead."""
        return self.header + frame_size([self.numel], [self.dtype], False, self.flagged)

    def sends_dense(self, counts: Sequence[int]) -> bool:
        """Whether a rank whose segments select ``counts`` sends the dense bucket instead (its
        frame would be larger): every rank tells it of every rank from the headers."""
        return self.size(counts) > self.dense_size()

    def header_of(self, xp, counts, flag=None):
        """A rank's header from its segments' counts (int64, on the device): each count twice,
        one per piece (no copy to the device, no wait); and its overflow ``flag`` (1 or 0) as
        the last count's bit ``FLAG_SHIFT``, so that every rank reads every rank's flag with
        the counts, not with the frames once they arrive: no second read back in a step."""
        header = xp.gather(counts, self._twice)
        return header if flag is None else header + xp.cast(flag, "int64") * self._flag_place

    def write(self, xp, values, indices, counts, flag=None):
        """This rank's frame: ``values`` and ``indices`` hold each segment's ``counts[s]`` (host
        ints) pairs in a row (the indices within their segment); ``flag``: the overflow flag."""
        pieces = {0: xp.split(xp.to_bytes(values), [c * ITEMSIZE[self.dtype] for c in counts])}
        for d in self.kinds:
            pieces[d] = xp.split(xp.to_bytes(xp.cast(indices, d)), [c * ITEMSIZE[d] for c in counts])
        parts = [pieces[0 if i % 2 == 0 else self.dtypes[i]][i // 2] for i in self.order]
        return _padded(xp, parts, self._like, flag)

    def flags(self, counts, ranks: int):
        """The ranks' overflow flags (host ints) from their headers as host ints (``counts``)."""
        width = len(self.dtypes)
        return [counts[(r + 1) * width - 1] >> FLAG_SHIFT for r in range(ranks)]

    def pair_table(self, counts, ranks: int):
        """Where each rank's pairs lie in ``ranks`` frames end to end, from their headers
        (``counts``: host ints), for ``grace.native.sparse_variable_mean``: per (rank, segment),
        the byte of its first value, of its first index, its first pair among the rank's, its
        count, the segment's start and its index width (int64, flat); None where a rank sent
        its dense bucket or the values are not float32."""
        width = len(self.dtypes)
        heads = np.asarray(counts[:ranks * width], np.int64).reshape(ranks, width) & ((1 << FLAG_SHIFT) - 1)
        pairs = heads[:, 0::2]
        if self.dtype != "float32" or any(self.sends_dense(row) for row in pairs.tolist()):
            return None
        ordered = (heads * self._itemsizes)[:, self.order]  # each piece's bytes, frame order
        at = np.empty_like(ordered)
        at[:, self.order] = np.cumsum(ordered, axis=1) - ordered  # each piece's byte in its frame
        frames = np.asarray([self.size(row) - self.header for row in pairs.tolist()], np.int64)
        at += (np.cumsum(frames) - frames)[:, None]
        shared = np.broadcast_to(np.stack([self._starts, self._itemsizes[1::2]]), (ranks, 2, pairs.shape[1]))
        columns = [at[:, 0::2], at[:, 1::2], np.cumsum(pairs, axis=1) - pairs, pairs, shared[:, 0], shared[:, 1]]
        return np.stack(columns, axis=2).reshape(-1)

    def pieces_bytes(self, head) -> int:
        """The bytes of a rank's pieces in its frame (``head``: its header's counts, host ints)."""
        return sum(c * ITEMSIZE[d] for c, d in zip(head, self.dtypes))

    def write_places(self, counts):
        """Where ``write`` lays a rank's pairs (``counts``: its segments', host ints), for one
        native call that writes them: the rank's ``pair_table``, the byte after its pieces (the
        flag's) and its frame's size; None where it sends its dense bucket."""
        head = [c for c in counts for _ in (0, 1)]
        table = self.pair_table(head, 1)
        if table is None:
            return None
        return table, self.pieces_bytes(head), self.size(counts) - self.header

    def write_dense(self, xp, flat, flag=None):
        """This rank's frame where it sends the dense bucket ``flat`` (``sends_dense``)."""
        return _padded(xp, [xp.to_bytes(flat)], self._like, flag)

    def read(self, xp, received, headers, ranks: int, counts=None):
        """The ranks' frames (end to end in ``received``, or a list of them) and their headers
        (end to end in ``headers``, on the device; ``counts``: the same as host ints, where
        read back already): per rank its pairs as (values, indices in the bucket (int64)), or
        ``Dense``; and the ranks' overflow flags (host ints, from the headers), or None. Every
        rank's counts are read back at once; then every sparse frame's pairs come from a few
        joins of whole tensors (``_pairs``), whatever the number of ranks and segments."""
        width = len(self.dtypes)
        counts = xp.host_ints(headers, ranks * width) if counts is None else counts
        frames, start = [], 0
        for r in range(ranks):
            data, pos = (received[r], 0) if isinstance(received, list) else (received, start)
            head = list(counts[r * width:(r + 1) * width])
            head[-1] &= (1 << FLAG_SHIFT) - 1
            if self.sends_dense(head[0::2]):
                end = pos + self.numel * ITEMSIZE[self.dtype]
                frames.append(Dense(xp.from_bytes(data[pos:end], self.dtype)))
                start = pos + self.dense_size() - self.header
            else:
                end = pos + self.pieces_bytes(head)
                frames.append((data[pos:end], head, headers[r * width:(r + 1) * width]))
                start = pos + self.size(head[0::2]) - self.header
        sparse = [f for f in frames if not isinstance(f, Dense)]
        pairs = iter(self._pairs(xp, sparse) if sparse else ())
        return [f if isinstance(f, Dense) else next(pairs) for f in frames], \
            (self.flags(counts, ranks) if self.flagged else None)

    def _pairs(self, xp, frames):
        """Every sparse frame's (values, indices in the bucket), from ``frames``: (its pieces,
        its header as host ints, and as a tensor). The values of all frames are joined in
        (frame, index type, segment) order; each index type's pieces in (frame, segment) order,
        cast, then joined in the values' order; the indices made global by one repeat of the
        segments' starts, their counts gathered from the joined headers on the device."""
        by_piece = []
        for pieces, head, _ in frames:
            sizes = [head[i] * ITEMSIZE[self.dtypes[i]] for i in self.order]
            by_piece.append(dict(zip(self.order, xp.split(pieces, sizes))))
        values = xp.from_bytes(xp.concat([at[2 * s] for at in by_piece for members in self.kinds.values()
                                          for s in members]), self.dtype)
        local, sizes = [], [0] * len(frames)  # per index type, each frame's part; each frame's pairs
        for d, members in self.kinds.items():
            counts = [sum(head[2 * s] for s in members) for _, head, _ in frames]
            joined = xp.cast(xp.from_bytes(xp.concat([at[2 * s + 1] for at in by_piece for s in members]), d), "int64")
            local.append(xp.split(joined, counts))
            sizes = [a + b for a, b in zip(sizes, counts)]
        local = xp.concat([part[f] for f in range(len(frames)) for part in local])
        starts, places = self._spread_of(xp, len(frames))
        counts = xp.gather(xp.concat([header for _, _, header in frames]), places)
        indices = local + xp.repeat(starts, counts, xp.numel(local))
        return list(zip(xp.split(values, sizes), xp.split(indices, sizes)))

    def _spread_of(self, xp, frames: int):
        """For ``frames`` sparse frames read at once, in (frame, index type, segment) order:
        each segment's start (int64, on the device), and where its count lies in the frames'
        headers joined."""
        if frames not in self._spread:
            segments = np.concatenate([np.asarray(m, np.int64) for m in self.kinds.values()])
            own = len(self.dtypes) * np.arange(frames, dtype=np.int64)[:, None]
            self._spread[frames] = (xp.asarray(np.tile(self._starts[segments], frames), like=self._like),
                                    xp.asarray((own + 2 * segments).reshape(-1), like=self._like))
        return self._spread[frames]
