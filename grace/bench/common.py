"""What every benchmark script shares: its YAML configuration, the versions it ran with, and
results written as CSV (one row per measurement) and JSON (rows + configuration + versions)."""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the source checkout (grace is installed editable)
PACKAGES = ["grace", "torch", "horovod", "tensorflow-cpu", "numpy", "mpi4py"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The script's docstring as written, and each flag's default after its help (where the help
    does not say it, and the flag has a value)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS) \
                or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def help_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark script's argument parser: its docstring, every flag's help and default."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def load_config(path: Path | str) -> dict:
    import yaml  # here: the device machine's Python may lack it, and needs no configuration

    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level")
    return config


def environment() -> dict:
    """Versions and machine, read without importing the toolkits (importing horovod.torch into
    a TensorFlow program would change its behaviour)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit, "python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "versions": versions}


def write_results(rows: list[dict], out: Path, name: str, config: dict, **extra) -> Path:
    """out/name.csv and out/name.json; returns the JSON path."""
    out.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"config": config, "environment": environment(), **extra, "rows": rows}, indent=2))
    return path
