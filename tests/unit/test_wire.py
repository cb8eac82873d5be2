"""Every method hands Horovod its ideal payload (docs/methods.md), within 1% plus a fixed header."""
from __future__ import annotations

import pytest

import grace
from grace.core import registry
from grace.core.wire import wire_report
from tests.unit.conftest import METHODS

HEADER_BYTES = 64  # the exchange's lengths of variable payloads: 8 bytes per payload tensor

# each method in its default configuration (settings without a default chosen as in docs/methods.md);
# a method not listed here (a new one, a test fixture) in its main example (grace/core/registry.py)
DEFAULTS = {
    **{name: METHODS[name] for name in registry.methods(None)},
    "none": grace.none, "fp16": grace.fp16, "u8bit": grace.u8bit, "onebit": grace.onebit,
    "signsgd": grace.signsgd, "signum": grace.signum, "efsignsgd": lambda: grace.efsignsgd(0.1),
    "qsgd": grace.qsgd, "qsgd_3_levels": lambda: grace.qsgd(3), "qsgd_bucketed": lambda: grace.qsgd(7, bucket_size=512),
    "natural": grace.natural, "terngrad": grace.terngrad, "inceptionn": grace.inceptionn,
    "randomk": lambda: grace.randomk(0.01), "topk": lambda: grace.topk(0.01),
    "threshold": lambda: grace.threshold(2.5), "dgc": lambda: grace.dgc(0.01), "adaq": grace.adaq,
    "sketchml": grace.sketchml, "powersgd": grace.powersgd,
}


def test_every_method_is_measured():
    measured = {type(make().compressor) for make in DEFAULTS.values()}
    assert {type(METHODS[name]().compressor) for name in registry.methods(None)} <= measured


@pytest.mark.parametrize("method", DEFAULTS)
def test_bytes_on_the_wire_are_the_ideal_within_one_percent(method):
    report = wire_report(DEFAULTS[method](), (1024, 1024))
    assert 8 * report.payload_bytes >= report.ideal_bits, "fewer bits than the ideal: the formula is wrong"
    assert 8 * report.payload_bytes <= 1.01 * report.ideal_bits, f"{report.excess:.2%} over the ideal"
    assert 0 <= report.header_bytes <= HEADER_BYTES
