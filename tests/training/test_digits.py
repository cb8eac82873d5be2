"""4 real ranks train on scikit-learn's digits with Keras's model.fit: top-k(0.01) with residual
memory must match uncompressed training within 2 points of test accuracy while sending >= 20x
fewer bytes. (PyTorch: tests/training/test_every_method.py, which trains every method.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

TRAIN = Path(__file__).parents[2] / "scripts" / "train.py"
EPOCHS = 30


def train(tmp_path, framework, compressor, *args):
    out = tmp_path / f"{framework}-{compressor}.json"
    launch("horovodrun", 4, TRAIN, "--framework", framework, "--compressor", compressor, *args,
           "--epochs", EPOCHS, "--no-progress", "--json", out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("framework", ["tensorflow"])
def test_topk_matches_uncompressed_accuracy_with_20x_fewer_bytes(framework, tmp_path):
    baseline = train(tmp_path, framework, "none")
    topk = train(tmp_path, framework, "topk", "--ratio", 0.01)
    report = f"\nuncompressed: {json.dumps(baseline, indent=1)}\ntopk(0.01): {json.dumps(topk, indent=1)}"
    assert baseline["ranks_agree"] and topk["ranks_agree"], report
    assert baseline["test_accuracy"] > 0.9, report  # the baseline itself learned
    assert topk["test_accuracy"] >= baseline["test_accuracy"] - 0.02, report
    assert baseline["bytes_per_step"] >= 20 * topk["bytes_per_step"], report
    assert topk["bytes_per_step"] == topk["dense_bytes_per_step"] / topk["compression_ratio"], report
