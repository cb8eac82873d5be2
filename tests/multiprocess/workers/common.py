"""What the multi-process workers exchange: the same inputs on every toolkit and launcher.

Every rank builds its own gradients from (rank, step, parameter, backward pass), so the test
process can recompute all ranks' inputs and the expected result without any communication.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable
from unittest import mock

import numpy as np

import grace
import tests.fixtures.methods  # noqa: F401  (registers the fixture methods; tests.conftest.launch sets PYTHONPATH)
from grace.core import registry
from tests.fixtures.own_collective import on_own_collective

# name, shape, scale ("tiny" is below every threshold: that rank sends nothing for it)
PARAMS = [
    ("layer.weight", (6, 10), 1.0),
    ("layer.bias", (10,), 1.0),
    ("scalar", (), 1.0),
    ("one", (1,), 1.0),
    ("big", (3000,), 1.0),
    ("tiny", (20,), 1e-4),
    ("empty", (0,), 1.0),
]
STEPS = 3


@dataclass(frozen=True)
class Variant:
    make: Callable[[], grace.GradientCompression]
    op: str = "average"  # or "sum"
    passes: int = 1  # backward_passes_per_step
    named: bool = True  # False: no named_parameters, Horovod generates the names
    checkpoint_after: int = -1  # save, rebuild and restore the optimizer after this step
    eager: bool = False  # TensorFlow: run the step eagerly instead of inside tf.function
    unused: tuple = ()  # parameters rank 0 does not use (DDP: find_unused_parameters=True)
    ddp: tuple = ()  # DistributedDataParallel options, as (name, value) pairs
    accelerator: bool = False  # PyTorch: an accelerator's plans (segment-wise buckets) for these CPU tensors


VARIANTS = {
    # every example of every registered method (grace/core/registry.py; test fixtures included) ...
    **{label: Variant(make) for label, make in registry.examples().items()},
    # ... some with the settings these inputs call for instead of the example's ...
    "threshold": Variant(lambda: grace.threshold(1.5)),
    "randomk": Variant(lambda: grace.randomk(0.25)),
    "randomk_scaled": Variant(lambda: grace.randomk(0.25, scale=True, memory="none")),
    "inceptionn": Variant(lambda: grace.inceptionn(1e-4)),  # all four tags occur
    "signum": Variant(lambda: grace.signum(0.5)),
    "dgc": Variant(lambda: grace.dgc(0.05, sample_ratio=0.1, clip_norm=5.0)),
    # ... and more ways to run them
    "topk_nomemory": Variant(lambda: grace.topk(0.1, memory="none")),
    "topk_broadcast": Variant(lambda: grace.topk(0.1, communicator="broadcast")),
    "topk_sum": Variant(lambda: grace.topk(0.1), op="sum"),
    "topk_checkpoint": Variant(lambda: grace.topk(0.1), checkpoint_after=1),
    "topk_eager": Variant(lambda: grace.topk(0.1), eager=True),
    # warm-up: two steps by plain allreduce, then the method (TensorFlow: eagerly, as it must)
    "topk_warmup": Variant(lambda: grace.topk(0.1, warmup_steps=2), eager=True),
    "qsgd_warmup_unbucketed": Variant(lambda: grace.qsgd(4, warmup_steps=1, bucket_mb=0), eager=True),
    "threshold_broadcast": Variant(lambda: grace.threshold(1.5, communicator="broadcast")),
    "randomk_passes2": Variant(lambda: grace.randomk(0.25), passes=2),
    "randomk_unnamed": Variant(lambda: grace.randomk(0.25), named=False),
    "qsgd_bucketed_broadcast": Variant(lambda: grace.qsgd(16, bucket_size=50, communicator="broadcast")),
    "dgc_warmup_broadcast": Variant(lambda: grace.dgc(0.01, sparsity_warmup_steps=2, communicator="broadcast")),
    "powersgd_checkpoint": Variant(lambda: grace.powersgd(1), checkpoint_after=1),
    "signum_checkpoint": Variant(lambda: grace.signum(0.5), checkpoint_after=0),
    # every variant above exchanges one 25 MB bucket; these exchange each tensor alone ...
    "topk_per_tensor": Variant(lambda: grace.topk(0.1, bucket_mb=0)),
    "threshold_per_tensor": Variant(lambda: grace.threshold(1.5, bucket_mb=0)),
    "signsgd_per_tensor": Variant(lambda: grace.signsgd(bucket_mb=0)),
    "powersgd_per_tensor": Variant(lambda: grace.powersgd(2, bucket_mb=0)),
    # ... or in two buckets ("big" alone: 12 kB; the rest: 368 bytes) ...
    "topk_small_buckets": Variant(lambda: grace.topk(0.1, bucket_mb=0.005)),
    "powersgd_small_buckets": Variant(lambda: grace.powersgd(2, bucket_mb=0.005)),
    "dgc_small_buckets_checkpoint": Variant(lambda: grace.dgc(0.05, sample_ratio=0.1, bucket_mb=0.005),
                                            checkpoint_after=1),
    # ... or compress each bucket as one tensor
    "topk_bucket_scope": Variant(lambda: grace.topk(0.1, scope="bucket")),
    "randomk_bucket_scope": Variant(lambda: grace.randomk(0.25, scope="bucket")),
    # nearly every element passes: the encoding (6 bytes each) is larger than dense, sent dense
    # (TensorFlow eagerly: a traced step fixes its frame layout, so it never switches to dense)
    "threshold_dense": Variant(lambda: grace.threshold(1e-3), eager=True),
    # about 2 in 3 elements pass: some ranks and steps go dense, others not (residuals non-zero)
    "threshold_sometimes_dense": Variant(lambda: grace.threshold(0.42), eager=True),
    # PyTorch takes an accelerator's plan: each bucket's counts go first, its frame once every
    # bucket's are read back (for the other toolkits, the plain variants once more)
    "threshold_segmented": Variant(lambda: grace.threshold(1.5), accelerator=True),
    "threshold_segmented_small_buckets": Variant(lambda: grace.threshold(1.5, bucket_mb=0.005), accelerator=True),
    "threshold_segmented_sometimes_dense": Variant(lambda: grace.threshold(0.42), eager=True, accelerator=True),
}
# each on its method's own collective (AUTO_VARIANTS below take the default, 'auto')
VARIANTS = {label: replace(variant, make=on_own_collective(variant.make)) for label, variant in VARIANTS.items()}


# What DDP's hook runs: every variant its buckets can express (DDP averages, names parameters
# itself, and sizes its own buckets: one here, as the 25 MB default above), and DDP's options.
DDP_VARIANTS = {
    **{label: variant for label, variant in VARIANTS.items()
       if variant.op == "average" and variant.named and variant.make().bucket_mb == 25 and variant.make().scope == "tensor"},
    "topk_unused": Variant(lambda: grace.topk(0.1), unused=("tiny", "scalar")),
    "signum_unused": Variant(lambda: grace.signum(0.5), unused=("layer.weight",)),
    "topk_bucket_view": Variant(lambda: grace.topk(0.1), ddp=(("gradient_as_bucket_view", True),)),
    "powersgd_static_graph": Variant(lambda: grace.powersgd(2), ddp=(("static_graph", True),)),
    "qsgd_process_group": Variant(lambda: grace.qsgd(4), ddp=(("process_group", "new"),)),
    "dgc_no_sync": Variant(lambda: grace.dgc(0.05, sample_ratio=0.1), passes=3),
}
DDP_VARIANTS = {label: replace(variant, make=on_own_collective(variant.make))
                for label, variant in DDP_VARIANTS.items()}


def _via_broadcast(make):
    compression = make()
    return grace.GradientCompression(compression.compressor, compression.memory, "broadcast")


# Every allgather method once more with communicator='broadcast' (run by the NumPy reference
# worker only: the collective is the same code for every toolkit).
BROADCAST_VARIANTS = {f"{label}_via_broadcast": Variant(lambda make=variant.make: _via_broadcast(make))
                      for label, variant in VARIANTS.items()
                      if variant.make().collective is grace.Collective.ALLGATHER and variant == Variant(variant.make)}


def _via(make, communicator: str):
    """``make()``'s method and buckets, exchanged by ``communicator``."""
    return make().via(communicator)


# Every allgather method once more with communicator='alltoall' (each rank owns a shard of the
# bucket: tests/multiprocess/reference_alltoall.py says what every rank must get).
ALLTOALL_VARIANTS = {f"{label}_via_alltoall": Variant(lambda make=variant.make: _via(make, "alltoall"))
                     for label, variant in VARIANTS.items()
                     if variant.make().collective is grace.Collective.ALLGATHER and variant == Variant(variant.make)
                     and variant.make().bucket_mb and variant.make().scope == "tensor"}
# variable-length frames larger than their dense shard go dense: every shard, every step; or some
ALLTOALL_VARIANTS.update({
    "threshold_dense_via_alltoall": Variant(lambda: grace.threshold(1e-3, communicator="alltoall")),
    "threshold_sometimes_dense_via_alltoall": Variant(lambda: grace.threshold(0.42, communicator="alltoall")),
    # (the method's 256 means; a shard's sketch has fewer: grace.kernels.owners.ShardSketch)
    "sketchml_256_via_alltoall": Variant(lambda: grace.sketchml(256, communicator="alltoall")),
})


# communicator='auto': per bucket, whichever way receives the fewest bytes (grace.core.traffic)
AUTO_VARIANTS = {f"{label}_via_auto": Variant(lambda make=VARIANTS[label].make: _via(make, "auto"))
                 for label in ("qsgd", "topk", "signsgd", "threshold", "onebit")}


# torch_traffic.py: fixed-length methods, whose sizes the traffic model knows exactly
TRAFFIC_METHODS = {"qsgd": lambda c: grace.qsgd(127, communicator=c), "terngrad": lambda c: grace.terngrad(communicator=c),
                   "natural": lambda c: grace.natural(communicator=c),
                   "signsgd": lambda c: grace.signsgd(communicator=c), "onebit": lambda c: grace.onebit(communicator=c),
                   "topk": lambda c: grace.topk(0.01, communicator=c), "u8bit": lambda c: grace.u8bit(communicator=c)}


def plans_for(variant: Variant):
    """Where ``variant.accelerator`` asks: a context in which PyTorch plans CPU tensors' buckets
    as an accelerator's (``grace.core.plans.choose``)."""
    if not variant.accelerator:
        return contextlib.nullcontext()
    from grace.backends.torch_backend import TorchBackend
    return mock.patch.object(TorchBackend, "on_accelerator", lambda self, x: True)


def names(variant: Variant):
    if variant.named:
        return [name for name, _, _ in PARAMS]
    return [f"allreduce.noname.0.{j}" for j in range(len(PARAMS))]  # Horovod's generated names


def gradient(rank: int, step: int, index: int, backward_pass: int = 0) -> np.ndarray:
    _, shape, scale = PARAMS[index]
    rng = np.random.default_rng([rank, step, index, backward_pass])
    return np.asarray(scale * rng.standard_normal(shape), dtype=np.float32)


def backward_order(grads: dict) -> dict:
    """The gradients in the order backward produces them (last parameter first), which is
    the order adapters plan their buckets in."""
    return dict(reversed(list(grads.items())))


def local_input(variant: Variant, rank: int, step: int, index: int) -> np.ndarray:
    """What one rank hands to the exchange: its gradients summed over the backward passes
    (zeros for a parameter rank 0 does not use)."""
    if rank == 0 and PARAMS[index][0] in variant.unused:
        return np.zeros(PARAMS[index][1], np.float32)
    return np.asarray(sum(gradient(rank, step, index, b) for b in range(variant.passes)), dtype=np.float32)


def parse_args(variants=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", nargs="*", default=list(variants or VARIANTS),
                        choices=[*VARIANTS, *BROADCAST_VARIANTS, *ALLTOALL_VARIANTS, *AUTO_VARIANTS, *DDP_VARIANTS])
    return parser.parse_args()


def state_arrays(grace_state: dict, to_numpy) -> dict:
    """'memory/<name>' and 'state/<name>' arrays of an exchange's state_dict; a state made of
    several tensors (DGC's u and v) as '<kind>/<name>/<i>'."""
    out = {}
    for kind in ("memory", "state", "owner"):
        for name, value in grace_state.get(kind, {}).items():
            if isinstance(value, tuple):
                out.update({f"{kind}/{name}/{i}": to_numpy(v) for i, v in enumerate(value)})
            else:
                out[f"{kind}/{name}"] = to_numpy(value)
    return out


def parse_out() -> Path:
    """The ``--out`` folder of a worker that saves one JSON file per rank (``save_json``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args().out


def save_json(out: Path, rank: int, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def save(out: Path, label: str, rank: int, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"{label}.rank{rank}.npz", **results)


# --- elastic training (torch_elastic.py, tensorflow_elastic.py) ------------------------------
ELASTIC_STEPS, FAIL_AT, GROW_AT = 12, 4, 8  # rank 1 dies at FAIL_AT; a host is added at GROW_AT
ELASTIC_METHODS = {"none": grace.none, "topk": lambda: grace.topk(0.25, communicator="allgather"),
                   "topk_alltoall": lambda: grace.topk(0.25, communicator="alltoall"),
                   "randomk": lambda: grace.randomk(0.25)}


def parse_elastic_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hosts", type=Path, required=True)
    parser.add_argument("--grow-host", required=True)
    parser.add_argument("--method", choices=ELASTIC_METHODS, required=True)
    return parser.parse_args()


def shrink_or_grow(state, args, step: int, rank: int, size: int) -> None:
    """At FAIL_AT the second rank's process dies (its host leaves the job); at GROW_AT, with one
    rank left, rank 0 lists another host and waits until Horovod interrupts it to add it."""
    if step == FAIL_AT and size == 2 and rank == 1 and not state.failed_once:
        os._exit(1)
    if step == GROW_AT and size == 1:
        if rank == 0:
            args.hosts.write_text(args.hosts.read_text() + f"{args.grow_host}:1\n")
        while True:
            time.sleep(0.5)
            state.check_host_updates()
