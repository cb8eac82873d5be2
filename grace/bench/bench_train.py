"""Does compression pay? Training throughput, bytes on the wire, quality and time to accuracy,
per method, model and link, with an alpha-beta prediction of every step time.

    sudo .venv/bin/python scripts/bench_train.py                      # everything in the config
    .venv/bin/python scripts/bench_train.py --stage quality           # no root needed
    sudo .venv/bin/python scripts/bench_train.py --stage throughput --links 100mbit --models wide_mlp
    .venv/bin/python scripts/bench_train.py --stage report            # tables and plots from saved runs
    sudo .venv/bin/python scripts/bench_train.py --config configs/bench_train_ddp.yaml \
        --out results/bench_train_ddp                                 # DDP: grace's hook vs PyTorch's

The config's ``engine`` says how gradients travel: ``horovod`` (hvd.DistributedOptimizer; methods
are grace's or Horovod's own none/fp16) or ``ddp`` (DistributedDataParallel over Gloo; methods
are grace's hook or PyTorch's own hooks: no hook, fp16_compress_hook, powerSGD_hook).

Stages (configs/bench_train.yaml says what runs):
  throughput  per link: an emulated cluster (grace.bench.cluster) of `ranks` hosts, its bandwidth
              verified, then one launch per model (horovodrun, or torch.distributed processes in
              the hosts' namespaces) that trains every method in turn:
              median step time after warm-up, bytes per step on the wire, and, for the cost
              model, compute time (no communication), the method's local compression work and
              a tiny allreduce's latency, all measured in the same launch (needs root); with
              the config's throughput 'runs: K', all of it K times, the report taking each
              method's run of median step time and showing the fastest and slowest
  quality     per model, on localhost: every method trained for a fixed number of epochs;
              test accuracy per epoch and the steps needed to reach the target accuracy.
              Time to accuracy on a link = those steps x the step time measured on that link
              (the arithmetic of a step does not depend on the network)
  report      results/bench_train/bench_train.{csv,json} (with configuration and versions),
              report.md, and plots: throughput vs bandwidth, quality vs bytes, predicted vs
              measured step time

Stages merge into results/<out>/{throughput,quality}.json, so a link or model can be rerun alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

import grace
from grace.bench import cost_model
from grace.bench.common import REPO, help_parser, load_config, write_results
from grace.bench.horovodrun import HOROVODRUN
from grace.bench.ddp_baselines import DDPHook
from grace.bench.train import ENGINES, MODEL_KINDS, OWN_MOMENTUM, DigitsRun, build_model, digits

DEFAULT_CONFIG = REPO / "configs" / "bench_train.yaml"


# ---- configuration -------------------------------------------------------------------------
def engine_name(config: dict) -> str:
    """How gradients travel: 'horovod' (the default) or 'ddp'."""
    return config.get("engine", "horovod")


def make_compression(method: dict, config: dict, hvd=None):
    """A method entry of the config -> what the engine's wrap takes: a grace compression,
    Horovod's own compression (hvd: horovod.torch), or a ``DDPHook``."""
    engine = engine_name(config)
    if "horovod" in method:
        if engine != "horovod":
            raise ValueError(f"method {method['name']!r}: a horovod method needs engine: horovod")
        if method["horovod"] not in ("none", "fp16"):
            raise ValueError(f"method {method['name']!r}: horovod must be 'none' or 'fp16', got {method['horovod']!r}")
        return getattr(hvd.Compression, method["horovod"]) if hvd is not None else None
    if "ddp" in method:
        if engine != "ddp":
            raise ValueError(f"method {method['name']!r}: a ddp hook needs engine: ddp")
        return DDPHook(method["ddp"], method.get("rank", 1))
    if "grace" not in method:
        raise ValueError(f"method {method.get('name')!r} needs a 'grace' (from_params dictionary), 'horovod' "
                         "or 'ddp' key")
    if "bucket_cap_mb" in method and engine != "ddp":
        raise ValueError(f"method {method['name']!r}: bucket_cap_mb (DDP's bucket size) needs engine: ddp")
    params = dict(method["grace"])
    if params.get("compressor") == "efsignsgd":
        params.setdefault("lr", config["lr"])  # its memory is in model units
    return grace.from_params(params)


def check_config(config: dict) -> None:
    for key in ("ranks", "links", "batch_size", "lr", "momentum", "throughput", "quality", "models", "methods",
                "target"):
        if key not in config:
            raise ValueError(f"bench_train config: missing key {key!r}")
    if engine_name(config) not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine_name(config)!r}")
    for name, spec in config["models"].items():
        if spec.get("kind") not in MODEL_KINDS:
            raise ValueError(f"model {name!r}: kind must be one of {', '.join(MODEL_KINDS)}, got {spec.get('kind')!r}")
    names = [m.get("name") for m in config["methods"]]
    if len(set(names)) != len(names) or None in names:
        raise ValueError(f"every method needs a unique name, got {names}")
    for method in config["methods"]:
        make_compression(method, config)  # unknown methods and bad settings fail here, before any launch


def method_key(method: dict) -> str:
    return method["grace"]["compressor"] if "grace" in method else method.get("horovod") or method["ddp"]


def baselines(config: dict) -> dict:
    """The methods speed-ups are measured against: {'none': name, 'fp16': name}."""
    default = {"horovod": {"none": "none", "fp16": "fp16 (Horovod)"},
               "ddp": {"none": "DDP", "fp16": "DDP fp16_compress_hook"}}[engine_name(config)]
    return {**default, **config.get("baselines", {})}


# ---- what each rank runs -------------------------------------------------------------------
class Run(DigitsRun):
    """One rank's run of one method of the config (the training loop is train.py's)."""

    def __init__(self, config: dict, model_name: str, method: dict, engine):
        import torch

        torch.manual_seed(config["seed"])
        model = build_model(config["models"][model_name])
        compression = make_compression(method, config, getattr(engine, "hvd", None))
        options = {"bucket_cap_mb": method["bucket_cap_mb"]} if "bucket_cap_mb" in method else {}
        super().__init__(engine, model, compression, lr=config["lr"],
                         momentum=0.0 if method_key(method) in OWN_MOMENTUM else config["momentum"],
                         batch_size=config["batch_size"], seed=config["seed"], **options)

    @property
    def is_grace(self) -> bool:
        return isinstance(self.compression, grace.GradientCompression)

    def bytes_per_step(self) -> int:
        """Bytes this rank handed to the collectives in the last step."""
        if self.is_grace:
            return int(self.engine.stats().last_step_bytes)
        if isinstance(self.compression, DDPHook):
            return self.compression.bytes_per_step()
        per_element = 2 if self.compression.__name__ == "FP16Compressor" else 4
        return per_element * self.parameters


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def codec_seconds(run: Run, ranks: int, repeats: int) -> float:
    """This rank's local compression work in an n-rank step, with no network: memory, compress,
    and decoding n payloads (grace.core.communicator.ReplicaCommunicator); Horovod's fp16: the casts."""
    import torch
    from grace.core.communicator import ReplicaCommunicator
    from grace.core.exchange import Exchange

    grads = {name: p.grad.detach().clone() for name, p in run.model.named_parameters()}
    if not run.is_grace:
        if getattr(run.compression, "__name__", None) != "FP16Compressor":
            return 0.0  # (PyTorch's DDP hooks: their work is in the measured step only)
        return median_seconds(lambda: [g.to(torch.float16).to(torch.float32) for g in grads.values()], repeats)
    exchange = Exchange(run.compression, ReplicaCommunicator(ranks))
    exchange.exchange(grads)  # first use creates the state
    return median_seconds(lambda: exchange.exchange(grads), repeats)


def _slowest(engine, seconds: float) -> float:
    """A step is as slow as its slowest rank."""
    return float(engine.reduce(seconds, "max"))


def _compute_seconds(config: dict, model_name: str, engine, steps: int) -> float:
    """Compute alone: the same model and batches, a local optimizer, every rank at once."""
    import torch

    torch.manual_seed(config["seed"])
    local = build_model(config["models"][model_name])
    local_opt = torch.optim.SGD(local.parameters(), lr=config["lr"], momentum=config["momentum"])
    x = torch.from_numpy(digits(config["seed"])[0][:config["batch_size"]])
    y = torch.zeros(config["batch_size"], dtype=torch.long)

    def local_step():
        local_opt.zero_grad()
        torch.nn.functional.cross_entropy(local(x), y).backward()
        local_opt.step()

    local_step()
    return _slowest(engine, median_seconds(local_step, steps))


def _step_times(run: Run, engine, steps: int, bar, name: str) -> list:
    """Seconds of each of ``steps`` training steps, the ranks started together, epochs repeated as needed."""
    batches = iter(())
    times = []
    for i in range(steps):
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = run.epoch_batches()
            xb, yb = next(batches)
        engine.reduce(0.0, "sum")  # steps start together
        t0 = time.perf_counter()
        run.step(xb, yb)
        times.append(time.perf_counter() - t0)
        bar.update()
        bar.set_postfix(method=name)
    return times


def worker_throughput(config: dict, model_name: str, result: Path) -> None:
    import torch

    engine = ENGINES[engine_name(config)]()
    torch.set_num_threads(1)
    rank, ranks = engine.rank, engine.size
    bench = config["throughput"]

    for i in range(5):
        engine.reduce(0.0, "sum")
    tiny_allreduce = _slowest(engine, median_seconds(lambda: engine.reduce(0.0, "sum"), 20))
    compute = _compute_seconds(config, model_name, engine, bench["steps"])

    rows = []
    total = len(config["methods"]) * (bench["warmup_steps"] + bench["steps"])
    bar = tqdm(total=total, disable=rank != 0, desc=f"{model_name} throughput", file=sys.stdout)
    for method in config["methods"]:
        run = Run(config, model_name, method, engine)
        times = _step_times(run, engine, bench["warmup_steps"] + bench["steps"], bar, method["name"])
        step = _slowest(engine, statistics.median(times[bench["warmup_steps"]:]))
        compressor = run.compression.compressor if run.is_grace else None
        rows.append({
            "model": model_name, "method": method["name"], "ranks": ranks,
            "parameters": run.parameters,
            "samples_per_second": ranks * config["batch_size"] / step,
            "step_s": step,
            "bytes_per_step": run.bytes_per_step(),
            "dense_bytes_per_step": 4 * run.parameters,
            "engine": engine_name(config),
            "collective": run.compression.collective.value if run.is_grace else "allreduce",
            "rounds": 2 if (compressor is not None and compressor.traits.multi_round)
            or getattr(run.compression, "kind", None) == "powersgd" else 1,
            "compute_s": compute,
            "codec_s": _slowest(engine, codec_seconds(run, ranks, bench["codec_repeats"])),
            "tiny_allreduce_s": tiny_allreduce,
        })
        del run
    bar.close()
    if rank == 0:
        result.write_text(json.dumps(rows, indent=2))
    engine.close()


def worker_quality(config: dict, model_name: str, result: Path) -> None:
    import torch

    engine = ENGINES[engine_name(config)]()
    torch.set_num_threads(1)
    epochs = config["quality"]["epochs"]
    rows = []
    bar = None
    for method in config["methods"]:
        run = Run(config, model_name, method, engine)
        if bar is None:
            bar = tqdm(total=len(config["methods"]) * epochs * run.steps_per_epoch, disable=engine.rank != 0,
                       desc=f"{model_name} quality", file=sys.stdout)
        curve = []
        for epoch in range(epochs):
            for xb, yb in run.epoch_batches():
                run.step(xb, yb)
                bar.update()
            curve.append(run.accuracy())
            bar.set_postfix(method=method["name"], accuracy=f"{curve[-1]:.3f}")
        rows.append({
            "model": model_name, "method": method["name"], "epochs": epochs, "steps_per_epoch": run.steps_per_epoch,
            "test_accuracy": curve[-1], "best_accuracy": max(curve), "accuracy_per_epoch": curve,
            "bytes_per_step": run.bytes_per_step(),
        })
        del run
    bar.close()
    if engine.rank == 0:
        result.write_text(json.dumps(rows, indent=2))
    engine.close()


# ---- stages (the driver) -------------------------------------------------------------------
def merge(path: Path, new_rows: list[dict], keys: tuple) -> list[dict]:
    """Rows saved earlier, with those that the new rows remeasure replaced."""
    old = json.loads(path.read_text()) if path.exists() else []
    fresh = {tuple(r.get(k, 0) for k in keys) for r in new_rows}  # (rows of one run have no 'run')
    rows = [r for r in old if tuple(r.get(k, 0) for k in keys) not in fresh] + new_rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2))
    return rows


def worker_cmd(args, stage: str, model: str, result: Path) -> list[str]:
    return [sys.executable, "-m", "grace.bench.bench_train", "--worker", stage, "--config", str(args.config),
            "--models", model, "--result", str(result), *(["--methods", *args.methods] if args.methods else [])]


def stage_throughput(args, config: dict) -> None:
    from grace.bench.cluster import EmulatedCluster, UnverifiedError

    ranks = config["ranks"]
    for run, link in ((run, link) for run in range(config["throughput"].get("runs", 1)) for link in args.links):
        with EmulatedCluster(ranks, preset_name=link, allow_native_latency=True) as cluster:
            try:
                report = cluster.verify()
            except UnverifiedError as e:
                if not config.get("allow_unverified"):
                    raise
                report = e.report
            print(f"[{link}] link {report['status']}: {report['measured_bps'] / 1e6:.1f} Mbit/s measured "
                  f"of {report['configured_bps'] / 1e6:.0f}, one-way latency "
                  f"{report['latency']['measured_one_way_s'] * 1e6:.0f} us ({report['latency']['status']})",
                  flush=True)
            link_info = {"link": link, "configured_bps": report["configured_bps"],
                         "measured_bps": report["measured_bps"], "link_status": report["status"],
                         "latency_status": report["latency"]["status"],
                         "one_way_latency_s": report["latency"]["measured_one_way_s"]}
            rows = []
            for model in args.models:
                with tempfile.TemporaryDirectory() as tmp:
                    result = Path(tmp) / "rows.json"
                    os.chmod(tmp, 0o777)
                    launcher = "torchrun" if engine_name(config) == "ddp" else "horovodrun"
                    cluster.run(worker_cmd(args, "throughput", model, result), launcher=launcher, np=ranks,
                                check=True)
                    rows += [{**link_info, **r, "run": run} for r in json.loads(result.read_text())]
        merge(args.out / "throughput.json", rows, ("link", "model", "method", "run"))


def stage_quality(args, config: dict) -> None:
    ranks = config["ranks"]
    bin_ = Path(sys.executable).parent
    if engine_name(config) == "ddp":
        launch = [str(bin_ / "torchrun"), "--standalone", "--nproc-per-node", str(ranks)]
    else:
        launch = [*HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", sys.executable]
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "rows.json"
            subprocess.run([*launch, *worker_cmd(args, "quality", model, result)[1:]], check=True)
            rows += json.loads(result.read_text())
    merge(args.out / "quality.json", rows, ("model", "method"))


def predicted_step(row: dict) -> float:
    link = cost_model.Link(alpha=cost_model.alpha_from_allreduce(row["tiny_allreduce_s"], row["ranks"]),
                           bandwidth=row["measured_bps"] / 8)
    return cost_model.step_seconds(row["compute_s"], row["codec_s"], row["collective"], row["bytes_per_step"],
                                   row["ranks"], link, row["rounds"])


def steps_to_target(q: dict, target: float):
    """Steps until the test accuracy, checked after every epoch, first reaches the target."""
    epoch = next((e for e, a in enumerate(q["accuracy_per_epoch"]) if a >= target), None)
    return None if epoch is None else (epoch + 1) * q["steps_per_epoch"]


def over_runs(throughput: list[dict]) -> list[dict]:
    """One row per (link, model, method): the run of median step time, with every run's step
    times ('runs_step_s') where the config's throughput 'runs' repeated the stage."""
    groups: dict = {}
    for r in throughput:
        groups.setdefault((r["link"], r["model"], r["method"]), []).append(r)
    rows = []
    for sel in groups.values():
        sel = sorted(sel, key=lambda r: r["step_s"])
        rows.append({**sel[(len(sel) - 1) // 2], "runs_step_s": [r["step_s"] for r in sel]})
    return rows


def combine(throughput: list[dict], quality: list[dict], target: float, names: dict) -> list[dict]:
    """One row per (link, model, method): throughput, prediction, speed-ups, quality, time to
    accuracy (``names``: the baselines', see ``baselines``)."""
    by_method = {(q["model"], q["method"]): q for q in quality}
    baseline = {(r["link"], r["model"], r["method"]): r["samples_per_second"] for r in throughput}
    rows = []
    for r in throughput:
        q = by_method.get((r["model"], r["method"]), {})
        row = {k: r[k] for k in ("link", "model", "method", "link_status", "measured_bps", "parameters",
                                 "samples_per_second", "step_s", "bytes_per_step", "dense_bytes_per_step",
                                 "compute_s", "codec_s", "runs_step_s")}
        row["predicted_step_s"] = predicted_step(r)
        row["prediction_error"] = row["predicted_step_s"] / r["step_s"] - 1
        for base, column in ((names["none"], "speedup_vs_none"), (names["fp16"], "speedup_vs_fp16")):
            b = baseline.get((r["link"], r["model"], base))
            row[column] = r["samples_per_second"] / b if b else None
        row["test_accuracy"] = q.get("test_accuracy")
        row["steps_to_target"] = steps_to_target(q, target) if q else None
        row["time_to_target_s"] = None if row["steps_to_target"] is None else row["steps_to_target"] * r["step_s"]
        rows.append(row)
    return rows


def markdown(rows: list[dict], config: dict) -> str:
    target = config["quality"]["target_accuracy"]
    lines = []
    for link in dict.fromkeys(r["link"] for r in rows):
        for model in dict.fromkeys(r["model"] for r in rows if r["link"] == link):
            sel = [r for r in rows if r["link"] == link and r["model"] == model]
            mbit = sel[0]["measured_bps"] / 1e6
            lines += [f"### {model} ({sel[0]['parameters'] / 1e6:.2f}M parameters), {link} "
                      f"(measured {mbit:.0f} Mbit/s, {sel[0]['link_status']}), {config['ranks']} ranks", "",
                      f"| method | samples/s | vs none | vs fp16 | bytes/step | step ms | runs: ms, fastest-slowest "
                      f"| predicted ms | accuracy | time to {target:.0%} |", "|---" * 10 + "|"]
            for r in sel:
                def fmt(v, spec):
                    return "-" if v is None else format(v, spec)
                ttt = "not reached" if r["test_accuracy"] is not None and r["time_to_target_s"] is None \
                    else fmt(r["time_to_target_s"], ".1f") + (" s" if r["time_to_target_s"] is not None else "")
                lines.append(f"| {r['method']} | {r['samples_per_second']:.0f} | {fmt(r['speedup_vs_none'], '.2f')}x | "
                             f"{fmt(r['speedup_vs_fp16'], '.2f')}x | {r['bytes_per_step']:,} | {1e3 * r['step_s']:.0f} | "
                             f"{len(r['runs_step_s'])}: "
                             f"{1e3 * r['runs_step_s'][0]:.0f}-{1e3 * r['runs_step_s'][-1]:.0f} | "
                             f"{1e3 * r['predicted_step_s']:.0f} | {fmt(r['test_accuracy'], '.4f')} | {ttt} |")
            lines.append("")
    return "\n".join(lines)


def claims(rows: list[dict], config: dict) -> list[str]:
    """The product's claims (config 'target'), each with the measured figure and PASS / FAIL, and,
    at the fastest link, the methods that lose to no compression."""
    out = []
    t = config["target"]
    for r in rows:
        if (r["link"], r["model"], r["method"]) == (t["link"], t["model"], t["method"]):
            if r["speedup_vs_none"] is None or r["speedup_vs_fp16"] is None:  # (a run of some methods only)
                out.append(f"NOT CHECKED: {r['method']} on {r['model']} at {r['link']}: "
                           f"no run of {baselines(config)['none']} and {baselines(config)['fp16']} to compare with")
                continue
            ok = r["speedup_vs_none"] >= t["vs_none"] and r["speedup_vs_fp16"] >= t["vs_fp16"]
            out.append(f"{'PASS' if ok else 'FAIL'}: {r['method']} on {r['model']} at {r['link']}: "
                       f"{r['speedup_vs_none']:.2f}x uncompressed (target >= {t['vs_none']}), "
                       f"{r['speedup_vs_fp16']:.2f}x {baselines(config)['fp16']} (target >= {t['vs_fp16']})")
    errors = sorted(abs(r["prediction_error"]) for r in rows)
    if errors:
        worst = max(rows, key=lambda r: abs(r["prediction_error"]))
        out.append(f"cost model: median |predicted / measured - 1| = {statistics.median(errors):.0%} over "
                   f"{len(errors)} runs; worst {worst['prediction_error']:+.0%} ({worst['method']}, {worst['model']}, "
                   f"{worst['link']})")
    fastest = config["links"][-1]
    for model in config["models"]:
        sel = [r for r in rows if r["link"] == fastest and r["model"] == model]
        losers = [f"{r['method']} ({r['speedup_vs_none']:.2f}x)" for r in sel
                  if r["speedup_vs_none"] is not None and r["speedup_vs_none"] < 1]
        if sel:
            out.append(f"at {fastest} ({sel[0]['link_status']}), {model}: slower than no compression: "
                       + (", ".join(losers) if losers else "none"))
    return out


def plot(rows: list[dict], quality: list[dict], out: Path, names: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    paths = []

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for method in methods:
            sel = sorted((r for r in rows if r["model"] == model and r["method"] == method),
                         key=lambda r: r["measured_bps"])
            style = "--" if method in names.values() else "-"
            ax.plot([r["measured_bps"] / 1e6 for r in sel], [r["samples_per_second"] for r in sel], style,
                    marker="o", label=method)
        ax.set(xscale="log", yscale="log", xlabel="link bandwidth, measured (Mbit/s)", ylabel="samples/s",
               title=f"{model}: training throughput")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    paths.append(out / "throughput_vs_bandwidth.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for q in (q for q in quality if q["model"] == model):
            ax.scatter(q["bytes_per_step"], q["test_accuracy"])
            ax.annotate(q["method"], (q["bytes_per_step"], q["test_accuracy"]), fontsize=7)
        ax.set(xscale="log", xlabel="bytes per step per rank", ylabel="test accuracy",
               title=f"{model}: quality vs bytes")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    paths.append(out / "quality_vs_bytes.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for model in models:
        sel = [r for r in rows if r["model"] == model]
        ax.scatter([r["step_s"] for r in sel], [r["predicted_step_s"] for r in sel], label=model, s=14)
    lo = min(min(r["step_s"], r["predicted_step_s"]) for r in rows) / 1.5
    hi = max(max(r["step_s"], r["predicted_step_s"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
    ax.set(xscale="log", yscale="log", xlabel="measured step time (s)", ylabel="predicted step time (s)",
           title="alpha-beta cost model")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    paths.append(out / "predicted_vs_measured.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def stage_report(args, config: dict) -> list[dict]:
    throughput = json.loads((args.out / "throughput.json").read_text()) if (args.out / "throughput.json").exists() else []
    quality = json.loads((args.out / "quality.json").read_text()) if (args.out / "quality.json").exists() else []
    if not throughput:
        raise SystemExit(f"no throughput results in {args.out}; run --stage throughput first (as root)")
    rows = combine(over_runs(throughput), quality, config["quality"]["target_accuracy"], baselines(config))
    lines = claims(rows, config)
    write_results(rows, args.out, "bench_train", config, claims=lines, quality=quality)
    report = markdown(rows, config) + "\n" + "\n".join(f"- {c}" for c in lines) + "\n"
    (args.out / "report.md").write_text(report)
    paths = plot(rows, quality, args.out, baselines(config))
    print(report)
    print("wrote", args.out / "bench_train.csv", args.out / "report.md", *paths)
    return rows


def parse_args(argv=None):
    parser = help_parser(__doc__)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the YAML configuration")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "bench_train",
                        help="where the runs, tables and plots go")
    parser.add_argument("--stage", default="all", choices=["all", "throughput", "quality", "report"],
                        help="throughput (the emulated links: root), quality, report (from saved runs), or all")
    parser.add_argument("--links", nargs="+", help="link presets (default: the config's)")
    parser.add_argument("--models", nargs="+", help="models (default: the config's)")
    parser.add_argument("--methods", nargs="+", help="methods by name (default: the config's); the stages merge "
                                                     "their rows into what earlier runs saved")
    parser.add_argument("--worker", choices=["throughput", "quality"], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config = load_config(args.config)
    check_config(config)
    args.links = args.links or list(config["links"])
    args.models = args.models or list(config["models"])
    unknown = [m for m in args.models if m not in config["models"]]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; the config has {list(config['models'])}")
    if args.methods:
        names = [m["name"] for m in config["methods"]]
        unknown = [m for m in args.methods if m not in names]
        if unknown:
            raise SystemExit(f"unknown method(s) {unknown}; the config has {names}")
        config["methods"] = [m for m in config["methods"] if m["name"] in args.methods]
    if args.worker:
        worker = worker_throughput if args.worker == "throughput" else worker_quality
        return worker(config, args.models[0], args.result)
    if args.stage in ("all", "quality"):
        stage_quality(args, config)
    if args.stage in ("all", "throughput"):
        stage_throughput(args, config)
    if args.stage in ("all", "report"):
        return stage_report(args, config)


if __name__ == "__main__":
    main()
