"""Hard threshold vs top-k, both with error feedback, at the same total communication volume.

The logistic-regression experiment of Sahu et al. 2021 (Fig. 1) on synthetic data:

    python scripts/threshold_vs_topk.py                       # 8 workers, 5000 features
    python scripts/threshold_vs_topk.py --workers 16 --ratio 0.005 --json out.json

The n workers are simulated in one process. Each has its own shard of the data and its own
error-feedback memory (``grace.memories.ResidualMemory``). Per step every worker computes a
minibatch gradient g on its shard, p = g + e, sends C(p) with grace's own ``Threshold`` or ``TopK``
compressor on the NumPy backend, keeps e = p - C(p), and the model takes a plain SGD step (fixed
lr) with the mean of everybody's C(p) (``compressor.aggregate``).

Threshold units: grace's memory is in gradient units and this script thresholds p = g + e
directly, with lambda in gradient units. With a fixed learning rate that is exactly the paper's
lr * C_lambda(p / lr) with the memory in model units (docs/methods.md, "Where the papers'
printed formulas need care").

Volume = number of (value, index) pairs sent, summed over workers and steps. Top-k sends
ceil(ratio * d) per worker per step; lambda is tuned (full runs, secant on log lambda vs log
volume, kept inside a bracket) until the threshold run sends top-k's total within --tolerance.
The claim checked: at equal volume hard threshold reaches a lower training loss than top-k and
its error-feedback norm stays smaller (the paper: top-k piles up error early because it may send
only k per step; threshold spends its budget when the gradient is large, i.e. early).

Data: rows are Gaussian, columns scaled by log-normal factors exp(scale_sigma * N(0, 1)), so
gradient magnitudes differ between coordinates; true weights are drawn on a random support
(``active`` of the features); labels are drawn from the logistic model (not separable); the
data is scaled so that the full loss is 1-smooth (lr = 1 is 1/L). Defaults: top-k density 0.2%
(k = 10 of 5000 per worker, as the paper's 0.17% of gisette's 5000), mildly heterogeneous scales.

Where the claim holds: threshold wins when many coordinates matter and the gradient is large
early and small late, so that a fixed lambda spends most of the budget in the first steps while
top-k, capped at k per step, piles the rest up in its memory. Strongly skewed column scales
(--scale-sigma 1 or more) remove that: a few large columns dominate, top-k sends them every
step anyway, and the two methods end up level. At long horizons top-k, still sending k per step
after the model has converged, drains its memory below threshold's floor (|e_j| < lambda for
every j), so the final EF norm favours top-k then (e.g. --steps 600) while the mean and peak do
not.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

import grace
from grace.backends import get_backend
from grace.bench.common import help_parser
from grace.core.compressor import TensorInfo
from grace.memories import ResidualMemory

XP = get_backend("numpy")


# --- the problem -------------------------------------------------------------------------------

@dataclass
class Problem:
    X: np.ndarray  # (workers, samples per worker, features): worker i's shard is X[i]
    y: np.ndarray  # (workers, samples per worker), labels in {0, 1}
    l2: float      # ridge term: the loss is strongly convex with a unique minimizer, as in the paper

    @property
    def workers(self) -> int:
        return self.X.shape[0]

    @property
    def features(self) -> int:
        return self.X.shape[2]


def make_problem(workers: int, features: int, samples_per_worker: int, seed: int, scale_sigma: float,
                 active: float, l2: float = 1e-3, margin_std: float = 3.0) -> Problem:
    """Synthetic logistic regression, float32 (the dtype gradients travel in)."""
    rng = np.random.default_rng(seed)
    n = workers * samples_per_worker
    scales = np.exp(scale_sigma * rng.standard_normal(features)).astype(np.float32)
    X = rng.standard_normal((n, features), dtype=np.float32) * scales
    w_true = np.zeros(features, dtype=np.float32)
    support = rng.choice(features, max(1, round(active * features)), replace=False)
    w_true[support] = rng.standard_normal(support.size)
    margin = X @ w_true
    margin *= margin_std / margin.std()  # informative labels, far from separable
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-margin))).astype(np.float32)
    # scale X so that L = |X|_2^2 / (4n) = 1: then lr is in units of 1/L
    v = rng.standard_normal(features).astype(np.float32)
    for _ in range(15):  # power iteration on X^T X
        v = X.T @ (X @ v)
        v /= np.linalg.norm(v)
    X /= np.linalg.norm(X @ v) / math.sqrt(4 * n)
    return Problem(X.reshape(workers, samples_per_worker, features), y.reshape(workers, -1), l2)


def loss(problem: Problem, w: np.ndarray) -> float:
    """Training loss over all shards: mean logistic loss + l2/2 |w|^2."""
    z = (problem.X @ w).astype(np.float64)
    return float(np.mean(np.logaddexp(0.0, z) - problem.y * z) + 0.5 * problem.l2 * float(w @ w))


def gradients(problem: Problem, w: np.ndarray, step: int, batch: int) -> np.ndarray:
    """Every worker's minibatch gradient at once, shape (workers, features).

    Minibatches are consecutive slices of each shard (views, no copies), cycling through it: the
    rows are i.i.d., so this is SGD over one fixed shuffle, and every method sees the same batches.
    """
    m = problem.X.shape[1]
    start = (step * batch) % m
    Xb, yb = problem.X[:, start:start + batch], problem.y[:, start:start + batch]
    r = 0.5 + 0.5 * np.tanh(0.5 * np.matmul(Xb, w)) - yb  # sigmoid - y, (workers, b); tanh: no overflow
    return np.matmul(r[:, None, :], Xb)[:, 0, :] / Xb.shape[1] + problem.l2 * w


# --- one training run --------------------------------------------------------------------------

@dataclass
class Trace:
    name: str
    volume: List[int]      # cumulative (value, index) pairs sent by all workers, after each step
    ef_norm: List[float]   # mean over workers of |e_i|_2 after each step (0 without memory)
    loss_steps: List[int]  # steps at which the training loss was evaluated (the model before that step)
    loss: List[float]

    @property
    def total_volume(self) -> int:
        return self.volume[-1]


def train(problem: Problem, compression: grace.GradientCompression, name: str, steps: int, lr: float,
          batch: int, eval_every: int) -> Trace:
    """SGD with the mean of the workers' compressed, error-compensated gradients."""
    comp, memory = compression.compressor, compression.memory
    n = problem.workers
    w = np.zeros(problem.features, dtype=problem.X.dtype)
    states = [memory.init(XP, w) for _ in range(n)]  # residuals: zeros (None without memory)
    trace = Trace(name, [], [], [], [])
    sent = 0
    for t in range(steps):
        if t % eval_every == 0:
            trace.loss_steps.append(t)
            trace.loss.append(loss(problem, w))
        payloads = []
        for i, g in enumerate(gradients(problem, w, t, batch)):
            p = memory.compensate(XP, g, states[i])
            payload, ctx = comp.compress(XP, p, TensorInfo("w", t, n, i))
            if memory.needs_feedback:
                states[i] = memory.update(XP, p, comp.decompress(XP, payload, ctx), states[i])
            sent += payload[0].size
            payloads.append(payload)
        w -= lr * comp.aggregate(XP, payloads, ctx)
        trace.volume.append(sent)
        trace.ef_norm.append(0.0 if states[0] is None else float(np.mean([np.linalg.norm(e) for e in states])))
    trace.loss_steps.append(steps)
    trace.loss.append(loss(problem, w))
    return trace


def with_residual(compressor) -> grace.GradientCompression:
    return grace.GradientCompression(compressor, ResidualMemory())


def tune_threshold(problem: Problem, target: int, steps: int, lr: float, batch: int, eval_every: int,
                   tolerance: float, max_runs: int = 20) -> Tuple[float, Trace, List[Tuple[float, int]]]:
    """lambda whose full run sends ``target`` elements in total, within ``tolerance`` (relative).

    Volume falls with lambda, roughly as a power of it, so each guess is the secant step on
    (log lambda, log volume); it is kept strictly inside the bracket found so far (bisection
    otherwise), so the search cannot run away. Returns (lambda, its run, [(lambda, volume)]).
    """
    history: List[Tuple[float, int]] = []
    # first guess: the lambda at which the first step alone would send the average budget
    g0 = np.abs(gradients(problem, np.zeros_like(problem.X[0, 0]), 0, batch))
    lam = float(np.quantile(g0, 1 - target / (steps * g0.size)))
    lo, hi = 0.0, math.inf  # lambdas known to send too much / too little
    for _ in range(max_runs):
        trace = train(problem, with_residual(grace.threshold(lam).compressor), "threshold",
                      steps, lr, batch, eval_every)
        v = trace.total_volume
        if abs(v - target) <= tolerance * target:
            history.append((lam, v))
            return lam, trace, history
        if v > target:
            lo = max(lo, lam)
        else:
            hi = min(hi, lam)
        if history and history[-1][1] != v:
            prev_lam, prev_v = history[-1]
            slope = math.log(max(v, 1) / max(prev_v, 1)) / math.log(lam / prev_lam)
            guess = lam * (target / max(v, 1)) ** (1 / slope) if slope < 0 else math.nan
        else:
            guess = lam * v / target  # no slope yet: assume volume ~ 1 / lambda
        history.append((lam, v))
        if not lo < guess < hi:  # the secant left the bracket: bisect (double or halve while open)
            guess = math.sqrt(lo * hi) if lo > 0 and hi < math.inf else (lam * 2 if v > target else lam / 2)
        lam = guess
    raise RuntimeError(f"lambda search did not reach {target} within {tolerance:.0%}: {history}")


# --- the comparison ------------------------------------------------------------------------------

@dataclass
class Result:
    config: dict
    threshold: float                # tuned lambda (gradient units)
    k_per_worker: int
    volume: Dict[str, int]          # total (value, index) pairs sent, per method
    final_loss: Dict[str, float]    # training loss after the last step
    ef_norm_mean: Dict[str, float]  # mean over steps of the mean-over-workers |e|
    ef_norm_max: Dict[str, float]
    ef_norm_final: Dict[str, float]
    total_error: Dict[str, float]   # ~ the paper's total error: sum over steps of that EF norm squared
    tuning: List[Tuple[float, int]]  # (lambda, volume) of every tuning run
    seconds: float
    traces: Dict[str, Trace] = field(repr=False)

    @property
    def volume_ratio(self) -> float:
        return self.volume["threshold"] / self.volume["topk"]


def compare(workers: int = 8, features: int = 5000, steps: int = 300, ratio: float = 0.002, lr: float = 1.0,
            batch: int = 32, samples_per_worker: int = 256, seed: int = 0, scale_sigma: float = 0.25,
            active: float = 0.2, tolerance: float = 0.02, eval_every: int = 10) -> Result:
    """Uncompressed SGD, top-k(ratio) and hard threshold tuned to top-k's total volume."""
    if samples_per_worker % batch:
        raise ValueError(f"batch ({batch}) must divide samples_per_worker ({samples_per_worker})")
    start = time.perf_counter()
    config = dict(workers=workers, features=features, steps=steps, ratio=ratio, lr=lr, batch=batch,
                  samples_per_worker=samples_per_worker, seed=seed, scale_sigma=scale_sigma,
                  active=active, tolerance=tolerance)
    problem = make_problem(workers, features, samples_per_worker, seed, scale_sigma, active)
    run = dict(steps=steps, lr=lr, batch=batch, eval_every=eval_every)
    sgd = train(problem, grace.none(), "sgd", **run)
    topk = train(problem, with_residual(grace.topk(ratio).compressor), "topk", **run)
    lam, thr, tuning = tune_threshold(problem, topk.total_volume, tolerance=tolerance, **run)
    traces = {"sgd": sgd, "topk": topk, "threshold": thr}
    ef = {k: np.asarray(traces[k].ef_norm) for k in ("topk", "threshold")}
    return Result(
        config=config, threshold=lam, k_per_worker=topk.volume[0] // workers,
        volume={k: t.total_volume for k, t in traces.items()},
        final_loss={k: t.loss[-1] for k, t in traces.items()},
        ef_norm_mean={k: float(e.mean()) for k, e in ef.items()},
        ef_norm_max={k: float(e.max()) for k, e in ef.items()},
        ef_norm_final={k: float(e[-1]) for k, e in ef.items()},
        total_error={k: float(np.sum(e ** 2)) for k, e in ef.items()},
        tuning=tuning, seconds=time.perf_counter() - start, traces=traces)


# --- reporting -----------------------------------------------------------------------------------

def print_table(result: Result, rows: int = 10) -> None:
    sgd, topk, thr = (result.traces[k] for k in ("sgd", "topk", "threshold"))
    last = len(thr.loss_steps) - 1
    print(f"{'step':>6} | {'loss sgd':>9} {'loss topk':>9} {'loss thr':>9} | {'EF topk':>8} {'EF thr':>8} |"
          f" {'vol topk':>9} {'vol thr':>9}")
    for j in sorted({round(i * last / rows) for i in range(rows + 1)}):
        s = thr.loss_steps[j]
        i = max(s, 1) - 1  # EF norm and volume after s steps (after the first one for row 0)
        print(f"{s:>6} | {sgd.loss[j]:>9.4f} {topk.loss[j]:>9.4f} {thr.loss[j]:>9.4f} |"
              f" {topk.ef_norm[i]:>8.3f} {thr.ef_norm[i]:>8.3f} | {topk.volume[i]:>9} {thr.volume[i]:>9}")


def print_summary(result: Result) -> None:
    c = result.config
    print(f"\n{c['workers']} workers, {c['features']} features, {c['steps']} steps, lr {c['lr']}, "
          f"batch {c['batch']} per worker, scale_sigma {c['scale_sigma']}, seed {c['seed']}")
    print(f"top-k ratio {c['ratio']}: k = {result.k_per_worker} per worker per step")
    print(f"tuned lambda        {result.threshold:.6g} (gradient units, {len(result.tuning)} tuning runs)")
    print(f"volume              top-k {result.volume['topk']}  threshold {result.volume['threshold']}"
          f"  (ratio {result.volume_ratio:.4f}; uncompressed {result.volume['sgd']})")
    print("final training loss " + "  ".join(f"{k} {v:.5f}" for k, v in result.final_loss.items()))
    for k in ("topk", "threshold"):
        print(f"EF norm {k:<11} mean {result.ef_norm_mean[k]:.4f}  max {result.ef_norm_max[k]:.4f}"
              f"  final {result.ef_norm_final[k]:.4f}  total error {result.total_error[k]:.1f}")
    print(f"({result.seconds:.1f} s)")


def plot(result: Result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    labels = {"sgd": "SGD, uncompressed", "topk": f"top-k, ratio {result.config['ratio']}",
              "threshold": f"hard threshold, lambda {result.threshold:.3g}"}
    colors = {"sgd": "black", "topk": "tab:blue", "threshold": "tab:orange"}  # the same in both panels
    fig, (ax_loss, ax_ef) = plt.subplots(1, 2, figsize=(11, 4))
    for k, t in result.traces.items():
        ax_loss.plot(t.loss_steps, t.loss, label=labels[k], color=colors[k])
        if k != "sgd":
            ax_ef.plot(np.arange(1, len(t.ef_norm) + 1), t.ef_norm, label=labels[k], color=colors[k])
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="training loss")
    ax_ef.set(xlabel="step", ylabel="mean over workers of |e|", title="error-feedback norm")
    for ax in (ax_loss, ax_ef):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result.config['workers']} workers; top-k and threshold send the same volume "
                 f"({result.volume['topk']} vs {result.volume['threshold']} elements)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def to_json(result: Result) -> dict:
    out = asdict(result)  # nested dataclasses (the traces) become dicts too
    out["volume_ratio"] = result.volume_ratio
    return out


def parse_args(argv=None):
    parser = help_parser(__doc__)
    parser.add_argument("--workers", type=int, default=8, help="workers simulated")
    parser.add_argument("--features", type=int, default=5000, help="features of the regression")
    parser.add_argument("--steps", type=int, default=300, help="SGD steps")
    parser.add_argument("--ratio", type=float, default=0.002, help="top-k: fraction of elements sent per step")
    parser.add_argument("--lr", type=float, default=1.0, help="in units of 1/L of the full loss")
    parser.add_argument("--batch", type=int, default=32, help="minibatch size per worker")
    parser.add_argument("--samples-per-worker", type=int, default=256, help="training samples each worker holds")
    parser.add_argument("--scale-sigma", type=float, default=0.25, help="spread of the log-normal column scales")
    parser.add_argument("--active", type=float, default=0.2, help="fraction of features with a true weight")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative volume mismatch allowed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the draws")
    parser.add_argument("--out", type=Path, default=Path("results/threshold_vs_topk"), help="plot directory")
    parser.add_argument("--json", type=Path, help="write the result, curves included, here")
    return parser.parse_args(argv)


def main(argv=None) -> Result:
    args = parse_args(argv)
    result = compare(workers=args.workers, features=args.features, steps=args.steps, ratio=args.ratio,
                     lr=args.lr, batch=args.batch, samples_per_worker=args.samples_per_worker, seed=args.seed,
                     scale_sigma=args.scale_sigma, active=args.active, tolerance=args.tolerance)
    print_table(result)
    print_summary(result)
    png = args.out / "threshold_vs_topk.png"
    plot(result, png)
    print(f"plot: {png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(result), indent=1))
        print(f"json: {args.json}")
    return result


if __name__ == "__main__":
    main()
