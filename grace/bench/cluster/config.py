"""Link presets and defaults, read from configs/cluster/links.yaml (or a file given instead).

There is no built-in copy of them: a missing file, or defaults that lack a key, is an error.
"""
from __future__ import annotations

from pathlib import Path

from grace.bench.common import REPO

from .errors import ClusterError

CONFIG = REPO / "configs" / "cluster" / "links.yaml"
_DEFAULTS = ("hosts", "mtu", "queue", "subnet_pool")
_VERIFY_DEFAULTS = ("seconds", "warmup", "tolerance", "attempts")


def load_config(path: Path | str | None = None) -> dict:
    """{'presets': {name: {...}}, 'defaults': {...}} from ``path`` (default: configs/cluster/links.yaml)."""
    import yaml  # PyYAML: grace's `bench` extra

    path = Path(path) if path else CONFIG
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ClusterError(f"no link configuration at {path}: the emulated cluster takes its presets and "
                           f"defaults from there (the repository's is {CONFIG})") from None
    if not isinstance(cfg, dict):
        raise ClusterError(f"{path}: expected a YAML mapping with `presets` and `defaults`")
    defaults = cfg.get("defaults") or {}
    missing = [k for k in _DEFAULTS if k not in defaults]
    missing += [f"verify.{k}" for k in _VERIFY_DEFAULTS if k not in (defaults.get("verify") or {})]
    if missing:
        raise ClusterError(f"{path}: `defaults` lacks {', '.join(missing)}")
    return {"presets": cfg.get("presets") or {}, "defaults": defaults}


def preset(name: str, config: dict | None = None) -> dict:
    config = config or load_config()
    try:
        return dict(config["presets"][name])
    except KeyError:
        raise ValueError(f"unknown link preset {name!r}; known: {', '.join(config['presets'])}") from None
