"""``grace.from_params`` takes the parameter dictionaries GRACE's own documents and helpers use,
with GRACE's key names and the defaults its helper gives keys left out, or refuses one with a
``ValueError`` that names the key. Each case says where GRACE uses the dictionary (the
sands-lab/grace repository: README.md, TRAINING.md, grace_dl/*/helper.py)."""
from __future__ import annotations

import inspect
import pydoc

import pytest

import grace

# (dictionary, where GRACE uses it, (compressor, its settings), memory, communicator)
GRACE_DICTIONARIES = [
    ({"compressor": "topk", "memory": "residual", "communicator": "allgather"},
     "README.md, the helper example (ratio: the helper's default 0.3)",
     ("TopK", {"ratio": 0.3}), "ResidualMemory", "allgather"),
    ({}, "examples (params = {}): the helper's defaults, no compression",
     ("NoneCompressor", {}), "NoMemory", "allreduce"),
    ({"compressor": "none", "memory": "none", "communicator": "allreduce"},
     "examples, the uncompressed baseline", ("NoneCompressor", {}), "NoMemory", "allreduce"),
    ({"compressor": "topk", "compress_ratio": 0.01, "memory": "residual", "communicator": "allgather",
      "world_size": 8}, "examples, with Horovod's world size", ("TopK", {"ratio": 0.01}), "ResidualMemory",
     "allgather"),
    ({"compressor": "qsgd", "memory": "none", "communicator": "allgather", "quantum_num": 64},
     "helper.py (TensorFlow: quantum_num 64)", ("QSGD", {"levels": 64}), "NoMemory", "allgather"),
    ({"compressor": "randomk", "memory": "residual", "communicator": "allreduce"},
     "helper.py (ratio 0.3)", ("RandomK", {"ratio": 0.3}), "ResidualMemory", "allreduce"),
    ({"compressor": "dgc", "memory": "dgc", "communicator": "allgather", "compress_ratio": 0.01,
      "momentum": 0.9, "gradient_clipping": False}, "helper.py (dgc memory: momentum, gradient_clipping)",
     ("DGC", {"ratio": 0.01}), "DGCMemory", "allgather"),
    ({"compressor": "dgc", "memory": "dgc", "communicator": "allgather"},
     "helper.py, PyTorch: ratio 0.3", ("DGC", {"ratio": 0.3}), "DGCMemory", "allgather"),
    ({"compressor": "topk", "compress_ratio": 0.01},
     "examples: memory and communicator left out (grace keeps the method's own)", ("TopK", {"ratio": 0.01}),
     "ResidualMemory", "allgather"),
    ({"compressor": "efsignsgd", "memory": "efsignsgd", "communicator": "allgather", "lr": 0.1},
     "helper.py (TensorFlow: the efsignsgd memory)", ("EFSignSGD", {"lr": 0.1}), "EFSignSGDMemory", "allgather"),
    ({"compressor": "signsgd", "memory": "none", "communicator": "allgather"}, "helper.py",
     ("SignSGD", {}), "NoMemory", "allgather"),
    ({"compressor": "signum", "memory": "none", "communicator": "allgather", "momentum": 0.9}, "helper.py",
     ("Signum", {"momentum": 0.9}), "NoMemory", "allgather"),
    ({"compressor": "onebit", "memory": "residual", "communicator": "allgather"}, "helper.py",
     ("OneBit", {}), "ResidualMemory", "allgather"),
    ({"compressor": "terngrad", "memory": "none", "communicator": "allgather"}, "helper.py",
     ("TernGrad", {}), "NoMemory", "allgather"),
    ({"compressor": "natural", "memory": "none", "communicator": "allgather"}, "helper.py",
     ("Natural", {}), "NoMemory", "allgather"),
    ({"compressor": "fp16", "memory": "none", "communicator": "allreduce"}, "helper.py",
     ("FP16", {}), "NoMemory", "allreduce"),
    ({"compressor": "threshold", "memory": "residual", "communicator": "allgather", "threshold": 0.01},
     "helper.py (TensorFlow: 0.01)", ("Threshold", {"threshold": 0.01}), "ResidualMemory", "allgather"),
    ({"compressor": "threshold", "memory": "residual", "communicator": "allgather"},
     "helper.py (PyTorch: 256)", ("Threshold", {"threshold": 256.0}), "ResidualMemory", "allgather"),
    ({"compressor": "powersgd", "memory": "powersgd", "communicator": "allreduce", "compress_rank": 1},
     "helper.py (powersgd memory: compress_rank)", ("PowerSGD", {"rank": 1}), "PowerSGDMemory", "allreduce"),
    ({"compressor": "adaq", "memory": "residual", "communicator": "allgather", "compress_ratio": 0.01},
     "helper.py (TensorFlow)", ("AdaQ", {"ratio": 0.01}), "ResidualMemory", "allgather"),
    ({"compressor": "sketch", "memory": "residual", "communicator": "allgather"},
     "helper.py (TensorFlow: 'sketch')", ("SketchML", {"buckets": 256}), "ResidualMemory", "allgather"),
    ({"compressor": "sketch", "memory": "none", "communicator": "allgather", "quantiles": 16},
     "helper.py (TensorFlow: quantiles)", ("SketchML", {"buckets": 16}), "NoMemory", "allgather"),
    ({"compressor": "inceptionn", "memory": "none", "communicator": "allgather", "error_bound": 2e-10},
     "helper.py (TensorFlow: error_bound 2e-10)", ("Inceptionn", {"error_bound": 2e-10}), "NoMemory", "allgather"),
    ({"compressor": "u8bit", "memory": "none", "communicator": "allgather"}, "helper.py (TensorFlow)",
     ("U8Bit", {}), "NoMemory", "allgather"),
    ({"compressor": "topk", "memory": "residual", "communicator": "broadcast", "compress_ratio": 0.01},
     "helper.py (the broadcast communicator)", ("TopK", {"ratio": 0.01}), "ResidualMemory", "broadcast"),
]


@pytest.mark.parametrize("params, where, want, memory, communicator", GRACE_DICTIONARIES,
                         ids=[f"{i}-{d.get('compressor', 'empty')}" for i, (d, *_) in enumerate(GRACE_DICTIONARIES)])
def test_grace_dictionaries_build_the_method_grace_means(params, where, want, memory, communicator):
    compression = grace.from_params(params)
    compressor, settings = want
    assert type(compression.compressor).__name__ == compressor, where
    for name, value in settings.items():
        assert getattr(compression.compressor, name) == value, (where, name)
    assert type(compression.memory).__name__ == memory, where
    assert compression.collective.value == communicator, where


def test_grace_dgc_memory_settings_reach_grace_memory():
    memory = grace.from_params({"compressor": "dgc", "memory": "dgc", "compress_ratio": 0.01, "momentum": 0.5}).memory
    assert memory.momentum == 0.5
    assert grace.from_params({"compressor": "dgc", "memory": "dgc"}).memory.momentum == 0.9  # grace's default


@pytest.mark.parametrize("params, message", [
    ({"compressor": "dgc", "memory": "dgc", "gradient_clipping": True}, "gradient_clipping=True"),
    ({"compressor": "powersgd", "memory": "powersgd", "momentum_factor": 0.9}, "momentum_factor=0.9"),
    ({"compressor": "qsgd", "quantum_num": 256}, "quantum_num=256"),
    ({"compressor": "topk", "compress_ratio": 0.01, "quantum_num": 4},
     "topk does not take parameter 'quantum_num'; it takes bucket_mb, communicator, compress_ratio"),
    ({"compressor": "bogus"}, "unknown compression method 'bogus'"),
    # GRACE's helper gives efsignsgd lr 0.3; it must be the optimizer's, so grace asks for it
    ({"compressor": "efsignsgd", "memory": "efsignsgd"}, "efsignsgd needs 'lr' in the dictionary"),
    # GRACE's PyTorch efsignsgd with a gradient-unit residual sums the signs over lr: grace keeps EF-signSGD's
    # error feedback in model units
    ({"compressor": "efsignsgd", "memory": "residual", "lr": 0.1}, "efsignsgd works in model units"),
    ({"compressor": "topk", "communicator": "allreduce"}, "allreduce"),
])
def test_what_grace_cannot_take_is_refused_by_name(params, message):
    with pytest.raises(ValueError, match=message):
        grace.from_params(params)


def test_help_shows_every_argument_a_method_takes():
    for name in grace.methods():
        method = getattr(grace, name)
        text = pydoc.render_doc(method, renderer=pydoc.plaintext)
        assert {"bucket_mb", "scope", "communicator"} <= set(inspect.signature(method).parameters), name
        assert "bucket_mb" in text and "scope" in text, name
