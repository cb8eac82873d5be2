"""What the exchange is told of a model's gradients before the first step."""
from __future__ import annotations

from typing import Iterable, List


def gradient_specs(named: Iterable[tuple]) -> List[tuple]:
    """The ``(name, shape, dtype, device)`` of each named parameter's gradient, as
    ``Exchange.plan`` and ``Exchange.expect`` take them."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), str(p.device)) for name, p in named]
