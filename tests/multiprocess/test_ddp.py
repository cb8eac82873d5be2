"""grace as PyTorch DDP's communication hook: real processes (torchrun, Gloo), no Horovod.

Every variant DDP can express must give, on every rank, what the all-rank reference computes
(gradients, bytes on the wire, final memory and state), and what Horovod's optimizer gives for
the same inputs. The variants include DDP's own features: gradient accumulation with
``no_sync()``, parameters unused on one rank (``find_unused_parameters=True``),
``gradient_as_bucket_view``, ``static_graph``, a process group other than the default, and a
checkpoint round trip of the hook state into a new model.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.multiprocess.conftest import assert_reference_result, tolerance
from tests.multiprocess.workers.common import DDP_VARIANTS, VARIANTS


@pytest.mark.parametrize("label", list(DDP_VARIANTS))
@pytest.mark.parametrize("run", ["torch-ddp-gloo-np2", "torch-ddp-gloo-np3"])
def test_every_rank_gets_the_reference_result(run, label, run_dir):
    assert_reference_result(run, label, DDP_VARIANTS[label], run_dir(run))


@pytest.mark.parametrize("label", [label for label in DDP_VARIANTS if label in VARIANTS])
def test_ddp_and_horovod_give_the_same_gradients(label, run_dir):
    for rank in range(3):
        ddp = np.load(run_dir("torch-ddp-gloo-np3") / f"{label}.rank{rank}.npz")
        horovod = np.load(run_dir("torch-horovod-gloo-np3") / f"{label}.rank{rank}.npz")
        keys = [k for k in horovod.files if k.startswith(("grad/", "memory/", "state/", "bytes/"))]
        assert keys and sorted(keys) == sorted(k for k in ddp.files if not k.startswith("calls/"))
        for key in keys:
            np.testing.assert_allclose(ddp[key], horovod[key], **tolerance(label), err_msg=f"{label} rank {rank} {key}")


def test_the_variants_cover_every_method():
    methods = {type(variant.make().compressor).__name__ for variant in DDP_VARIANTS.values()}
    assert len(methods) >= 18, sorted(methods)
