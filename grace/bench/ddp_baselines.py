"""PyTorch's own DDP communication hooks, the baselines grace's DDP hook is measured against
(scripts/bench_train.py, scripts/bench_ddp_step.py)."""
from __future__ import annotations

import math


class DDPHook:
    """One of PyTorch's own DDP communication hooks, registered on a DDP model for comparison:
    'allreduce' (DDP without a hook), 'fp16' (fp16_compress_hook) or 'powersgd'
    (powerSGD_hook with error feedback and warm start, at ``rank``; PowerSGD from the third
    step, its first two being DDP's dense allreduce)."""

    KINDS = ("allreduce", "fp16", "powersgd")

    def __init__(self, kind: str, rank: int = 1):
        if kind not in self.KINDS:
            raise ValueError(f"ddp must be one of {', '.join(self.KINDS)}, got {kind!r}")
        self.kind, self.rank = kind, rank
        self.shapes = []

    @property
    def ddp_options(self) -> dict:
        """DistributedDataParallel arguments the hook needs: PowerSGD's hook hangs over Gloo as
        soon as a model has two buckets (its callbacks, on Gloo's two worker threads, wait for
        further collectives that need those threads), so it gets a single bucket."""
        return {"bucket_cap_mb": 2**14} if self.kind == "powersgd" else {}

    def __call__(self, model) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        if self.kind == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.kind == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=self.rank,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def bytes_per_step(self) -> int:
        """What the hook hands to allreduce per step, by its rule: fp16 halves every element;
        PowerSGD sends P and Q, (n + m) x rank floats, for each n x m matrix at least twice that
        size (min_compression_rate 2), and every other tensor dense."""
        total = 0
        for shape in self.shapes:
            numel = math.prod(shape)
            if self.kind == "fp16":
                total += 2 * numel
            elif self.kind == "powersgd" and len(shape) > 1:
                n, m = shape[0], numel // shape[0]
                total += 4 * ((n + m) * self.rank if 2 * (n + m) * self.rank < numel else numel)
            else:
                total += 4 * numel
        return total
