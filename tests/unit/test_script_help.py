"""Every benchmark script's ``--help``: its whole docstring, a help text for every flag, and the
default of every flag that has one."""
from __future__ import annotations

import argparse
import importlib
import sys

import pytest

from grace.bench.common import HelpFormatter

SCRIPTS = ["bench_compress", "bench_ddp_step", "bench_horovod_step", "bench_ops", "bench_step", "bench_train",
           "threshold_vs_topk", "train", "train_methods", "wire_sizes"]


class Parsed(Exception):
    """Raised in place of parsing: the parser the script built is in ``args[0]``."""


def parser_of(script: str, monkeypatch) -> argparse.ArgumentParser:
    module = importlib.import_module(f"grace.bench.{script}")

    def caught(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(sys, "argv", [script])
    with pytest.raises(Parsed) as parsed:
        module.main()
    return parsed.value.args[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_says_what_it_does_and_its_default(script, monkeypatch):
    parser = parser_of(script, monkeypatch)
    module = sys.modules[f"grace.bench.{script}"]
    assert parser.formatter_class is HelpFormatter
    assert parser.description == module.__doc__  # (not its first line alone)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        flag = "/".join(action.option_strings)
        assert action.help, f"{script} {flag}: no help text"
        shown = formatter._get_help_string(action) % {"default": action.default}
        if action.nargs != 0 and action.default is not None:
            assert "default" in shown, f"{script} {flag}: its default {action.default!r} is not shown"
    parser.format_help()  # (a help text that does not format fails here)
