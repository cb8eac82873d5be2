"""Compress + decompress latency per method and tensor size (GRACE, Xu et al. 2021, §V-D, Fig. 8).

    python scripts/bench_compress.py --config configs/bench_compress.yaml [--out results/bench_compress] [--quick]

For every configured method (a display name and a ``grace.from_params`` dictionary), tensor
size, backend and device, on standard-normal float32 tensors, one rank's side of a step with
``ranks`` ranks (config, default 4), timed phase by phase inside ``grace.core.exchange.Exchange``
(``grace.core.phases``): the path training runs, fused kernels included, in a world whose
ranks all send what this one sends (``ReplicaCommunicator``: no network, n payloads to decode):

  compress_ms    memory compensate + compress (with the method's per-tensor state) and framing;
                 where a native kernel fuses compensate, compress and memory update, all of it
  decompress_ms  what the rank does with what the collective hands back: reading the ranks'
                 frames and aggregating them (allgather/broadcast), or decompressing the summed
                 payload / ranks (allreduce). PowerSGD (multi-round): compress is its rounds up
                 to the last payload, decompress what follows the last sum (P Q^T)
  total_ms       compress_ms + decompress_ms (GRACE's Fig. 8); total_min_ms: the fastest repeat's
                 compress + decompress (less sensitive to other jobs on a shared machine)
  feedback_ms    error feedback outside a fused kernel: decompress of the rank's own payload +
                 memory update (0 for methods without it, or with a fused kernel)
  pipeline_ms    one whole step through Exchange in a world of one (LocalCommunicator):
                 compensate, compress, feedback, collective, decompress
  bytes          what this rank hands to the collectives per step, by grace's own accounting
                 (Exchange.stats, lengths of variable payloads included; a rank sends the same
                 whatever the number of ranks), from the first step (zero memory), as
                 grace.core.wire.wire_report counts it; ratio = dense float32 bytes / bytes

Each timed step starts from the state after the first step (method state, step counter) with
the memory zeroed again: the same gradient, sent again and again, would pile up in the memory.
Times are medians of ``repeats`` (fewer once ``time_budget_s`` is spent, at least
min(repeats, 3)), after a warm-up call (two when the first is fast); wall-clock, with
torch.cuda.synchronize() around each timed part on cuda. Freed memory stays in the heap
(bench_ops.keep_freed_memory: steady state, as in training). The compressors run as the
library runs them: the torch backend dispatches to the native kernels (grace.native) when they
are built. Tensors are flat, except for methods with ``shape: matrix`` (PowerSGD compresses
matrices only: a vector travels uncompressed), shaped (rows, cols) as square as the size allows.

--sizes, --repeats, --backends, --devices, --threads and --methods override the config (after
--quick). A bad config exits with status 2 and a message naming the entry at fault.

Writes OUT/bench_compress.{csv,json} (grace.bench.common) and OUT/latency_vs_size.png
(log-log total latency against size, one line per method, a panel per backend and device), and
prints the table.
"""
from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time
from pathlib import Path


import numpy as np
import yaml

import grace
from grace.bench.common import REPO, help_parser, load_config, write_results
from grace.backends import get_backend
from grace.core.communicator import LocalCommunicator, ReplicaCommunicator
from grace.core.exchange import Exchange
from grace.core.phases import PhaseClock

NAME = "bench_compress"
BACKENDS = ("torch", "numpy", "tensorflow")
DEVICES = ("cpu", "cuda")
SHAPES = ("flat", "matrix")
DEFAULTS = {"ranks": 4, "repeats": 10, "time_budget_s": 10.0, "backends": ["torch"], "devices": ["cpu"],
            "seed": 0, "threads": None, "quick": {}}
REQUIRED = ("methods", "sizes")
TOP_KEYS = set(REQUIRED) | set(DEFAULTS)
METHOD_KEYS = {"name", "grace", "shape"}
TENSOR = "bench"  # the tensor's name (it seeds the random methods)


class ConfigError(ValueError):
    pass


# --- configuration -----------------------------------------------------------------------------
def parse_size(value, where: str) -> int:
    """An element count: an integer, or '2^k' / '2**k'."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected an element count such as 1048576 or '2^20', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and re.fullmatch(r"\s*2\s*(\^|\*\*)\s*\d+\s*", value):
        n = 2 ** int(re.split(r"\^|\*\*", value)[1])
    else:
        raise ConfigError(f"{where}: expected an element count such as 1048576 or '2^20', got {value!r}")
    if n < 1:
        raise ConfigError(f"{where}: sizes must be at least 1 element, got {value!r}")
    return n


def _string_list(config: dict, key: str, allowed) -> list:
    value = config[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"'{key}' must be a non-empty list of {', '.join(allowed)}, got {value!r}")
    unknown = [v for v in value if v not in allowed]
    if unknown:
        raise ConfigError(f"'{key}': unknown {', '.join(map(repr, unknown))}; known: {', '.join(allowed)}")
    return list(dict.fromkeys(value))


def _with_defaults(raw: dict, quick: bool) -> dict:
    """The raw config's keys checked, the defaults filled in and the quick overrides applied."""
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(TOP_KEYS))}")
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise ConfigError(f"missing key(s) {', '.join(map(repr, missing))} (see configs/bench_compress.yaml)")
    config = {**DEFAULTS, **raw}
    overrides = config["quick"] if config["quick"] is not None else {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"'quick' must be a mapping of keys to override with --quick, got {overrides!r}")
    bad = sorted(set(overrides) - (TOP_KEYS - {"quick"}))
    if bad:
        raise ConfigError(f"'quick': unknown key(s) {', '.join(map(repr, bad))}")
    if quick:
        config.update(overrides)
    return config


def _check_settings(config: dict) -> None:
    """Sizes, counts, budget, threads, seed, backends and devices checked (sizes and lists normalised in place)."""
    sizes = config["sizes"]
    if not isinstance(sizes, list) or not sizes:
        raise ConfigError(f"'sizes' must be a non-empty list of element counts, got {sizes!r}")
    config["sizes"] = sorted(set(parse_size(s, f"sizes[{i}]") for i, s in enumerate(sizes)))
    for key, lowest in (("ranks", 1), ("repeats", 1)):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ConfigError(f"'{key}' must be an integer >= {lowest}, got {value!r}")
    budget = config["time_budget_s"]
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ConfigError(f"'time_budget_s' must be a positive number of seconds, got {budget!r}")
    threads = config["threads"]
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"'threads' must be null (the toolkits' defaults) or an integer >= 1, got {threads!r}")
    if isinstance(config["seed"], bool) or not isinstance(config["seed"], int):
        raise ConfigError(f"'seed' must be an integer, got {config['seed']!r}")
    config["backends"] = _string_list(config, "backends", BACKENDS)
    config["devices"] = _string_list(config, "devices", DEVICES)


def _checked_method(i: int, entry, names: set) -> dict:
    """methods[i] checked, its name added to ``names`` (used twice is an error), its compression built."""
    where = f"methods[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping {{name: ..., grace: {{compressor: ...}}}}, got {entry!r}")
    label = f"{where} ({entry['name']!r})" if "name" in entry else where
    missing = [key for key in ("name", "grace") if key not in entry]
    if missing:
        raise ConfigError(f"{label}: missing key(s) {', '.join(map(repr, missing))}")
    unknown = sorted(set(entry) - METHOD_KEYS)
    if unknown:
        raise ConfigError(f"{label}: unknown key(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(sorted(METHOD_KEYS))}")
    name = entry["name"]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    if name in names:
        raise ConfigError(f"{label}: the name {name!r} is used twice")
    names.add(name)
    params = entry["grace"]
    if not isinstance(params, dict):
        raise ConfigError(f"{label}: 'grace' must be a grace.from_params dictionary such as "
                          f"{{compressor: topk, compress_ratio: 0.01}}, got {params!r}")
    shape = entry.get("shape", "flat")
    if shape not in SHAPES:
        raise ConfigError(f"{label}: 'shape' must be one of {', '.join(SHAPES)}, got {shape!r}")
    try:
        compression = grace.from_params(params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{label}: {exc}") from None
    if compression.auto and "communicator" not in params:  # (the codec on its own collective, N payloads decoded)
        compression = compression.via(compression.collective)
    return {"name": name, "grace": dict(params), "shape": shape, "compression": compression}


def validate(raw: dict, quick: bool = False) -> dict:
    """Defaults filled in, the quick overrides applied (``quick``), every entry checked; each
    method entry gains 'compression' (built by grace.from_params). Raises ConfigError."""
    config = _with_defaults(raw, quick)
    _check_settings(config)
    methods = config["methods"]
    if not isinstance(methods, list) or not methods:
        raise ConfigError("'methods' must be a non-empty list of {name: ..., grace: {compressor: ..., ...}}")
    names = set()
    config["methods"] = [_checked_method(i, entry, names) for i, entry in enumerate(methods)]
    return config


# --- measurement -------------------------------------------------------------------------------
def matrix_shape(n: int) -> tuple:
    rows = math.isqrt(n)
    while n % rows:
        rows -= 1
    return rows, n // rows


def size_label(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


class Toolkit:
    """One (backend, device): its backend object, tensor conversion and synchronisation."""

    def __init__(self, backend: str, device: str, threads=None):
        self.backend, self.device = backend, device
        self.xp = get_backend(backend)
        if backend == "torch":
            import torch

            self._torch = torch
            if threads:
                torch.set_num_threads(threads)
        elif backend == "tensorflow":
            import tensorflow as tf

            self._tf = tf
            if threads:
                try:
                    tf.config.threading.set_intra_op_parallelism_threads(threads)
                except RuntimeError:  # TensorFlow already initialised: keeps its threads
                    pass
        if threads:
            import grace.native as gn

            gn.set_num_threads(threads)

    def tensor(self, array: np.ndarray):
        if self.backend == "torch":
            return self._torch.from_numpy(array).to(self.device)
        if self.backend == "tensorflow":
            with self._tf.device("/CPU:0"):
                return self._tf.constant(array)
        return array

    def sync(self) -> None:
        if self.device == "cuda":
            self._torch.cuda.synchronize()

    def describe(self) -> str:
        if self.backend == "torch" and self.device == "cuda":
            return self._torch.cuda.get_device_name()
        if self.backend == "torch":
            import grace.native as gn

            lib = gn.library("cpu")
            native = lib.get_num_threads() if lib is not None else "unavailable"
            return f"torch threads {self._torch.get_num_threads()}, native threads {native}"
        if self.backend == "tensorflow":
            return f"tensorflow intra-op threads {self._tf.config.threading.get_intra_op_parallelism_threads() or 'default'}"
        return self.backend


def combos(config: dict):
    """(backend, device) pairs to run, and notes on those skipped."""
    out, skipped = [], []
    for backend in config["backends"]:
        for device in config["devices"]:
            if device == "cuda" and backend != "torch":
                skipped.append(f"{backend}/cuda (only the torch backend is timed on cuda)")
                continue
            if device == "cuda":
                import torch

                if not torch.cuda.is_available():
                    skipped.append("torch/cuda (no CUDA device)")
                    continue
            out.append((backend, device))
    return out, skipped


def warm_up(fn) -> None:
    """One call; a second when the first was fast (first-call costs: allocation, dispatch)."""
    t0 = time.perf_counter()
    fn()
    if time.perf_counter() - t0 < 0.2:
        fn()


def repeat(fn, repeats: int, budget_s: float) -> list:
    """``fn()`` returns a tuple of seconds; the tuples of up to ``repeats`` calls."""
    times, start = [], time.perf_counter()
    for _ in range(repeats):
        times.append(fn())
        if len(times) >= min(repeats, 3) and time.perf_counter() - start > budget_s:
            break
    return times


def measure(tk: Toolkit, method: dict, size: int, x_np, config: dict) -> dict:
    shape = matrix_shape(size) if method["shape"] == "matrix" else (size,)
    x = tk.tensor(x_np.reshape(shape))
    compression = method["compression"]

    def steady(exchange: Exchange):
        """``exchange``'s first step, then a step that starts each time from the state after it
        (method state, step counter) with the memory zeroed again: the same gradient, sent
        again and again, would pile up in the memory."""
        exchange.exchange({TENSOR: x})
        after_first = exchange.state_dict()
        if TENSOR in after_first["memory"]:
            after_first["memory"][TENSOR] = compression.memory.init(tk.xp, x)

        def step():
            exchange.load_state_dict(after_first)  # every timed step: the same work
            exchange.exchange({TENSOR: x})

        return step

    # one rank's local work in a world of `ranks` that all send what it sends (no network)
    phased = Exchange(compression, ReplicaCommunicator(config["ranks"]))
    phased.phases = clock = PhaseClock(tk.sync)
    phased_step = steady(phased)

    def phases():
        clock.reset()
        phased_step()
        seconds = clock.reset()
        return seconds["compress"], seconds["decompress"], seconds["feedback"]

    warm_up(phases)
    times = repeat(phases, config["repeats"], config["time_budget_s"])
    compress_s, decompress_s, feedback_s = (statistics.median(t[i] for t in times) for i in range(3))

    local = Exchange(compression, LocalCommunicator())
    local_step = steady(local)  # its first step, zero memory: its bytes are what wire_report counts
    nbytes, dense = local.stats.last_step_bytes, local.stats.last_step_dense_bytes

    def whole_step():
        tk.sync()
        t0 = time.perf_counter()
        local_step()
        tk.sync()
        return (time.perf_counter() - t0,)

    warm_up(whole_step)
    pipeline = repeat(whole_step, config["repeats"], config["time_budget_s"])
    return {
        "method": method["name"], "compressor": method["grace"]["compressor"],
        "params": json.dumps(method["grace"], sort_keys=True), "backend": tk.backend, "device": tk.device,
        "size": size, "shape": "x".join(map(str, shape)), "ranks": config["ranks"],
        "collective": compression.collective.value, "repeats": len(times),
        "compress_ms": 1e3 * compress_s, "decompress_ms": 1e3 * decompress_s,
        "total_ms": 1e3 * (compress_s + decompress_s), "total_min_ms": 1e3 * min(t[0] + t[1] for t in times),
        "feedback_ms": 1e3 * feedback_s,
        "pipeline_ms": 1e3 * statistics.median(t[0] for t in pipeline),
        "bytes": nbytes, "dense_bytes": dense, "ratio": dense / nbytes if nbytes else float("inf"),
        "bits_per_element": 8 * nbytes / size,
    }


def gradient(size: int, seed: int):
    """Standard normal float32 from default_rng(seed), as wire_report draws it."""
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def run(config: dict, progress: bool = True):
    from tqdm import tqdm

    pairs, skipped = combos(config)
    if not pairs:
        raise ConfigError(f"nothing to run: {'; '.join(skipped)}")
    methods, sizes = config["methods"], config["sizes"]
    rows, devices = [], {}
    bar = tqdm(total=len(pairs) * len(sizes) * len(methods), disable=not progress, desc=NAME, unit="case")
    for backend, device in pairs:
        tk = Toolkit(backend, device, config["threads"])
        devices[f"{backend}/{device}"] = tk.describe()
        for size in sizes:
            x_np = gradient(size, config["seed"])
            for method in methods:
                bar.set_postfix_str(f"{backend}/{device} {method['name']} {size_label(size)}")
                try:
                    rows.append(measure(tk, method, size, x_np, config))
                except Exception as exc:
                    bar.close()
                    raise RuntimeError(f"{method['name']} ({backend}/{device}, {size} elements) failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
                bar.update()
            del x_np
    bar.close()
    return rows, skipped, devices


# --- output -----------------------------------------------------------------------------------
def table(rows) -> str:
    lines = []
    width = max(len(r["method"]) for r in rows)
    groups = dict.fromkeys((r["backend"], r["device"], r["size"]) for r in rows)
    for backend, device, size in groups:
        group = [r for r in rows if (r["backend"], r["device"], r["size"]) == (backend, device, size)]
        lines.append(f"\n{backend}/{device}, {size_label(size)} = {size} float32 elements, "
                     f"{group[0]['ranks']} ranks (medians)")
        header = (f"{'method':<{width}} {'compress ms':>12} {'decompress ms':>14} {'total ms':>10} "
                  f"{'(fastest)':>10} {'feedback ms':>12} {'pipeline ms':>12} {'bytes/rank':>12} {'ratio':>8}")
        lines += [header, "-" * len(header)]
        for r in group:
            lines.append(f"{r['method']:<{width}} {r['compress_ms']:>12.3f} {r['decompress_ms']:>14.3f} "
                         f"{r['total_ms']:>10.3f} {r['total_min_ms']:>10.3f} {r['feedback_ms']:>12.3f} {r['pipeline_ms']:>12.3f} "
                         f"{r['bytes']:>12d} {r['ratio']:>7.1f}x")
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["backend"], r["device"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + 2.5, 5.5), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    styles = ("o-", "s--", "^-.", "D:")
    for ax, (backend, device) in zip(axes[0], panels):
        for i, method in enumerate(methods):
            pts = sorted((r["size"], r["total_ms"]) for r in rows
                         if (r["method"], r["backend"], r["device"]) == (method, backend, device))
            if pts:
                ax.plot(*zip(*pts), styles[i % len(styles)], color=colors[i % len(colors)], label=method,
                        markersize=4, linewidth=1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (float32 elements)")
        ax.set_ylabel("compress + decompress latency (ms, median)")
        ax.set_title(f"{backend} / {device}, {rows[0]['ranks']} ranks' payloads aggregated")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def native_status() -> dict:
    try:
        import grace.native as gn
    except Exception as exc:  # pragma: no cover - the package always imports
        return {"error": repr(exc)}
    return {device: gn.available(device) or f"unavailable: {gn.load_error(device)}" for device in DEVICES}


def parse_args(argv=None):
    parser = help_parser(__doc__)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "bench_compress.yaml",
                        help="the YAML configuration")
    parser.add_argument("--out", type=Path, default=REPO / "results" / NAME, help="where the tables and plots go")
    parser.add_argument("--quick", action="store_true", help="apply the config's 'quick' overrides (small sizes)")
    parser.add_argument("--sizes", nargs="+", help="override the sizes: element counts or 2^k")
    parser.add_argument("--repeats", type=int, help="override the repeats")
    parser.add_argument("--backends", nargs="+", help=f"override the backends ({', '.join(BACKENDS)})")
    parser.add_argument("--devices", nargs="+", help=f"override the devices ({', '.join(DEVICES)})")
    parser.add_argument("--threads", type=int, help="override the CPU threads (config 'threads')")
    parser.add_argument("--methods", nargs="+", help="only these configured methods (display names)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        raw = load_config(args.config)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"{NAME}: cannot read the config: {exc}", file=sys.stderr)
        return 2
    try:
        config = validate(raw, quick=args.quick)
        if args.sizes:  # the command line wins over the config and its quick overrides
            config["sizes"] = sorted(set(parse_size(int(s) if s.isdigit() else s, "--sizes") for s in args.sizes))
        if args.repeats is not None:
            if args.repeats < 1:
                raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
            config["repeats"] = args.repeats
        for key in ("backends", "devices", "threads"):
            if getattr(args, key) is not None:
                config[key] = validate({**raw, key: getattr(args, key)})[key]
        if args.methods:
            known = [m["name"] for m in config["methods"]]
            unknown = [m for m in args.methods if m not in known]
            if unknown:
                raise ConfigError(f"--methods: not in the config: {', '.join(map(repr, unknown))}; "
                                  f"configured: {', '.join(known)}")
            config["methods"] = [m for m in config["methods"] if m["name"] in args.methods]
        from grace.bench.bench_ops import keep_freed_memory

        keep_freed_memory()  # steady state, as in a training loop (see grace.bench.bench_ops)
        rows, skipped, devices = run(config, progress=not args.no_progress)
    except ConfigError as exc:
        print(f"{NAME}: {args.config}: {exc}", file=sys.stderr)
        return 2
    for note in skipped:
        print(f"# skipped {note}")
    print(table(rows))
    saved = {key: value for key, value in config.items() if key != "methods"}
    saved["methods"] = [{k: v for k, v in m.items() if k != "compression"} for m in config["methods"]]
    path = write_results(rows, args.out, NAME, saved, quick=args.quick, skipped=skipped, devices=devices,
                         native=native_status())
    plot(rows, args.out / "latency_vs_size.png")
    print(f"\nwrote {path}, {args.out / (NAME + '.csv')} and {args.out / 'latency_vs_size.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
