"""What compression costs per training step on real models' gradients, per-tensor and bucketed.

    python scripts/bench_step.py [--models mlp48 resnet50 transformer] [--methods topk dgc ...]
                                 [--device cpu|cuda] [--iters 10] [--world 4] [--bucket-mb 25]
                                 [--bucketed-only] [--profile-top N] [--accelerator-path]
                                 [--out results/bench_step]

For each model (synthetic inputs; see MODELS) it measures, in one run:
  fwd+bwd      median time of forward + backward of one batch
  work         one rank's compression work per step in a world of ``--world`` ranks, without a
               network: memory compensation, compression, error feedback, decoding the world's
               payloads and aggregating them (``Exchange`` over ``ReplicaCommunicator``: every
               rank sends what this one sends), writing results over the gradients as the
               adapters do (``in_place``). Once exchanging each gradient alone
               (``bucket_mb=0``) and once in buckets. The stand-in collectives (the sum or the
               copies of this rank's payload that a network would deliver) are timed apart, with
               ``grace.core.phases``, and left out: exchange = work + collective.
  share        work / fwd+bwd
  calls        collectives per step (each would be one Horovod call)
  ops          what one step launches, from torch's profiler: kernels and copies on a GPU
               (with the host syncs the step waits for), top-level torch ops on a CPU
  waits        host waits for the GPU per step (on a GPU; on a CPU with --accelerator-path,
               the reads back the GPU would wait for)
  bytes        bytes this rank hands to the collectives per step
  plans        the plans the buckets took (``Exchange.plan_of``: per-gradient, flat, segmented, ...)
On a CPU a line above each table times plain torch passes over the model's gradients (read,
write, g + e into a third buffer): what any error-feedback method pays before it compresses.
--accelerator-path (CPU): run the code path a GPU takes (segment-wise and whole buckets, the
tensor ops that stand in for grace.native's CPU-only kernels) to count its operations and host
waits where no GPU is at hand; ops then counts the operations a GPU launches as kernels (views
and allocations left out). Its times are a CPU's, not a GPU's.
The phase clock syncs the device at each phase boundary, which a GPU pays for per tensor: the
JSON also holds ``exchange_free_ms``, whole steps timed with no clock (work and the stand-in
collectives, as training runs them).
Times are medians over ``--iters`` steps after two warm-up steps, with a device sync around
each. torchvision's ResNet-50 is used where torchvision imports; otherwise the same layers,
defined here (25.6M parameters in 161 tensors either way).
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import grace
import grace.native
from grace.backends.torch_backend import TorchBackend
from grace.bench.common import help_parser, write_results
from grace.core.communicator import ReplicaCommunicator
from grace.core.phases import PhaseClock

METHODS = {  # the arguments each method is benchmarked with
    "none": {}, "fp16": {}, "topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01},
    "threshold": {"threshold": 0.01}, "signsgd": {}, "signum": {}, "efsignsgd": {"lr": 0.1}, "onebit": {},
    "terngrad": {}, "natural": {}, "qsgd": {"levels": 127}, "u8bit": {}, "dgc": {"ratio": 0.01},
    "powersgd": {"rank": 1},
}
DEFAULT_METHODS = ["none", "fp16", "topk", "randomk", "threshold", "signsgd", "efsignsgd", "onebit", "terngrad",
                   "natural", "qsgd", "dgc", "powersgd"]


# --- models ------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """ResNet's 1x1 -> 3x3 -> 1x1 block with a projection on the shortcut where shapes change."""

    def __init__(self, inputs: int, width: int, stride: int):
        super().__init__()
        outputs = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs))
        self.shortcut = nn.Identity() if stride == 1 and inputs == outputs else nn.Sequential(
            nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet50(classes: int = 1000) -> nn.Module:
    try:
        import torchvision

        return torchvision.models.resnet50(num_classes=classes)
    except Exception:  # missing, or built for another torch (its C++ ops fail to register)
        pass
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    inputs = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(inputs, width, stride if b == 0 else 1))
            inputs = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes))


class Encoder(nn.Module):
    """A BERT-like encoder: token embeddings, ``layers`` transformer layers, a token classifier."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def build(model: str, device: str):
    """(module, inputs, targets, loss); GPU sizes as in common practice, smaller inputs on a CPU."""
    gpu = device != "cpu"
    if model == "mlp48":  # about 100 tensors: 48 Linear(512, 512), 12.6M parameters
        net = nn.Sequential(*[m for _ in range(48) for m in (nn.Linear(512, 512), nn.ReLU())])
        x, y = torch.randn(64, 512), torch.randn(64, 512)
        return net, x, y, nn.functional.mse_loss
    if model == "resnet50":  # the parameters do not depend on the image size
        net = resnet50()
        batch, side = (64, 224) if gpu else (8, 64)
        return net, torch.randn(batch, 3, side, side), torch.randint(0, 1000, (batch,)), nn.functional.cross_entropy
    if model == "transformer":  # BERT-base sized on a GPU (12 layers, 768 wide), 4 layers of 512 on a CPU
        width, heads, layers, batch, length = (768, 12, 12, 32, 128) if gpu else (512, 8, 4, 8, 64)
        net = Encoder(30522 if gpu else 8192, width, heads, layers)
        vocab = net.head.out_features
        tokens = torch.randint(0, vocab, (batch, length))

        def loss(out, target):
            return nn.functional.cross_entropy(out.reshape(-1, vocab), target.reshape(-1))

        return net, tokens, torch.randint(0, vocab, (batch, length)), loss
    raise ValueError(f"unknown model {model!r}; known: mlp48, resnet50, transformer")


# --- measuring ---------------------------------------------------------------------------
class CountingReplica(ReplicaCommunicator):
    """A world of ranks that all send what this one sends; counts the collectives launched."""

    PRIMITIVES = ("allreduce_async", "grouped_allreduce_async", "allreduce_async_", "grouped_allreduce_async_",
                  "allgather_async", "broadcast_async")

    def __init__(self, size: int):
        super().__init__(size)
        self.calls = 0
        for name in self.PRIMITIVES:
            setattr(self, name, self._counted(getattr(self, name)))

    def _counted(self, primitive):
        def launch(*args):
            self.calls += 1
            return primitive(*args)

        return launch


def _sync(device: str):
    return torch.cuda.synchronize if device != "cpu" else (lambda: None)


def timed(fn, device: str, iters: int, warmup: int = 2, setup=lambda: None) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup``, each after ``setup()``
    (not timed)."""
    sync = _sync(device)
    times = []
    for i in range(warmup + iters):
        setup()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_passes(grads: dict, iters: int) -> dict:
    """On a CPU, ms of plain torch passes over the gradients, one gradient at a time: reading
    them (a sum), writing as much (zeros), and g + e into a third buffer, which error feedback
    cannot avoid where a skipped step must find the old memory e unchanged. With the dense result
    written over the gradients, ``feedback_floor_ms``: what an error-feedback method pays before
    it selects or codes anything (a floor for torch code, not for hand-written loops)."""
    gs = list(grads.values())
    es, outs = [torch.rand_like(g) for g in gs], [torch.empty_like(g) for g in gs]
    read = timed(lambda: [g.sum() for g in gs], "cpu", iters)
    write = timed(lambda: [o.zero_() for o in outs], "cpu", iters)
    compensate = timed(lambda: [torch.add(g, e, out=o) for g, e, o in zip(gs, es, outs)], "cpu", iters)
    return {"read_ms": 1e3 * read, "write_ms": 1e3 * write, "compensate_ms": 1e3 * compensate,
            "feedback_floor_ms": 1e3 * (compensate + write)}


def gradients(net, x, y, loss, device: str, iters: int):
    """(fwd+bwd seconds, the gradients in backward order: last parameter first)."""
    net, x, y = net.to(device), x.to(device), y.to(device)

    def step():
        net.zero_grad(set_to_none=True)
        loss(net(x), y).backward()

    seconds = timed(step, device, iters)
    named = [(n, p.grad.detach().clone()) for n, p in net.named_parameters() if p.grad is not None]
    return seconds, dict(reversed(named))


# what a GPU launches no kernel for (views, metadata, allocation), left out of --accelerator-path's ops
NO_KERNEL = {f"aten::{name}" for name in (
    "view", "_unsafe_view", "reshape", "flatten", "view_as", "slice", "select", "narrow", "split", "split_with_sizes",
    "unbind", "detach", "alias", "expand", "expand_as", "permute", "t", "transpose", "unsqueeze", "squeeze",
    "as_strided", "lift_fresh", "empty", "empty_like", "empty_strided", "unflatten")}


def take_accelerator_path() -> dict:
    """From here on, the code path a GPU takes, on this CPU: the backend told that its tensors
    are on an accelerator and grace.native's CPU-only kernels off (their tensor-op fallbacks
    run, as on a GPU). Returns the counter of the reads back a GPU would wait for ("waits")."""
    counted = {"waits": 0}
    TorchBackend.on_accelerator = lambda self, x: True
    kernel, read = grace.native.kernel, TorchBackend.host_ints
    grace.native.kernel = lambda name, like: kernel(name, like) if grace.native.KERNELS[name].cuda else None

    def host_ints(self, x, count: int):
        counted["waits"] += 1
        return read(self, x, count)

    TorchBackend.host_ints = host_ints
    return counted


# Kineto's line per profiler start and stop ("USDT:<date> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
# profiler_start"), written to stderr whatever its log level
_PROFILER_LINE = re.compile(r"^(USDT|STAGE|INFO):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\]")


@contextlib.contextmanager
def profiler_lines_dropped():
    """The profiler's own stderr lines dropped, so that they do not cut through the tables;
    anything else written to stderr meanwhile still reaches it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            sys.stderr.writelines(line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                                  if not _PROFILER_LINE.match(line))


def launches(fn, device: str, top: int = 0, waits=None) -> dict:
    """What one call of ``fn`` launches: {"ops": GPU kernels and copies, "waits": host waits
    for the GPU} on a GPU, {"ops": top-level torch ops} on a CPU, or where ``waits`` counts the
    accelerator path's reads back (``take_accelerator_path``) {"ops": its top-level operations
    that would launch kernels, "waits": its reads back}; with ``top``, also "top": the
    profiler's table of the ``top`` ops that took the most time (the device's, on a GPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = device != "cpu"
    before = waits["waits"] if waits else 0
    with profiler_lines_dropped(), profile(activities=[ProfilerActivity.CPU,
                                                       *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        fn()
    events = prof.events()
    table = {"top": prof.key_averages().table(sort_by="self_device_time_total" if gpu else "self_cpu_time_total",
                                              row_limit=top)} if top else {}
    if not gpu:
        top_level = [e.name for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
        if waits is None:
            return {"ops": len(top_level), **table}
        # a read back: host_ints, a scalar read, or a compaction of unknown size (a GPU tells its size)
        reads = sum(1 for e in events if e.name in ("aten::_local_scalar_dense", "aten::nonzero"))
        return {"ops": sum(1 for name in top_level if name not in NO_KERNEL),
                "waits": waits["waits"] - before + reads, **table}
    return {"ops": sum(1 for e in events if e.device_type == DeviceType.CUDA),
            "waits": sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                         "cudaEventSynchronize", "cudaMemcpy")), **table}


def measure(grads: dict, method: str, bucket_mb: float, world: int, device: str, iters: int, top: int = 0,
            waits=None, communicator: str = "own") -> dict:
    comm = CountingReplica(world)
    compression = grace.create(method, **METHODS[method], bucket_mb=bucket_mb)
    if compression.collective is grace.Collective.ALLGATHER and bucket_mb:
        compression = compression.via(compression.collective if communicator == "own" else communicator)
    # as the adapters run it: results written over the gradients handed over (on a CPU), so
    # each step gets this step's gradients again first, as backward would write them
    exchange = grace.Exchange(compression, comm, in_place=True)
    inputs = {name: g.clone() for name, g in grads.items()}

    def backward():
        for name, g in inputs.items():
            g.copy_(grads[name])

    # The stand-in collectives (sums and copies of this rank's payload) are the network's part of
    # a step, not grace's: timed phase by phase in the same steps, they are left out of work.
    sync = _sync(device)
    exchange.phases = clock = PhaseClock(sync)
    steps, collectives = [], []
    for i in range(2 + iters):
        backward()
        calls_before = comm.calls
        clock.reset()
        sync()
        start = time.perf_counter()
        exchange.exchange(inputs)
        sync()
        if i >= 2:
            steps.append(time.perf_counter() - start)
            collectives.append(clock.reset()["collective"])
    seconds, collective = statistics.median(steps), statistics.median(collectives)
    work = statistics.median(s - c for s, c in zip(steps, collectives))
    calls, nbytes = comm.calls - calls_before, exchange.stats.last_step_bytes
    exchange.phases = None
    free = timed(lambda: exchange.exchange(inputs), device, iters, warmup=0, setup=backward)
    backward()
    return {"work_ms": 1e3 * work, "exchange_ms": 1e3 * seconds, "collective_ms": 1e3 * collective,
            "exchange_free_ms": 1e3 * free, "calls": calls, "bytes": nbytes, "plans": plans_taken(exchange),
            **launches(lambda: exchange.exchange(inputs), device, top, waits)}


def plans_taken(exchange) -> str:
    """The plans the exchange's buckets took, with how many took each (``Exchange.plan_of``)."""
    plans = collections.Counter(plan.name for plan in exchange.bucket_plans().values())
    return ", ".join(f"{name} x{count}" for name, count in sorted(plans.items())) or "reference"


def print_header() -> None:
    print(f"{'method':<10} {'per-tensor ms':>13} {'share':>7} {'calls':>6} {'ops':>6} {'bucketed ms':>12} "
          f"{'share':>7} {'calls':>6} {'ops':>6} {'waits':>6} {'speedup':>8} {'bytes':>12} "
          f"{'(collective ms)':>16} {'(no clock ms)':>14}  plans")


def _shown(value: float, spec: str, unit: str = "") -> str:
    """``value`` formatted, or '-' for a part not run (--bucketed-only)."""
    return "-" if value != value else format(value, spec) + unit  # (NaN)


def print_row(method: str, row: dict) -> None:
    print(f"{method:<10} {_shown(row['per_tensor_work_ms'], '.2f'):>13} {_shown(row['per_tensor_share'], '.1%'):>7} "
          f"{row['per_tensor_calls']:>6} {row['per_tensor_ops']:>6} {row['bucketed_work_ms']:>12.2f} "
          f"{row['bucketed_share']:>7.1%} {row['bucketed_calls']:>6} {row['bucketed_ops']:>6} "
          f"{row.get('bucketed_waits', '-'):>6} {_shown(row['speedup'], '.2f', 'x'):>8} {row['bucketed_bytes']:>12} "
          f"{row['bucketed_collective_ms']:>16.2f} {row['bucketed_exchange_free_ms']:>14.2f}  "
          f"{row['bucketed_plans']}", flush=True)


def parse_args():
    parser = help_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["mlp48", "resnet50", "transformer"],
                        help="the models whose gradients are exchanged")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=sorted(METHODS),
                        help="the methods timed")
    parser.add_argument("--device", default="cpu", help="a torch device: cpu, cuda, cuda:1 ...")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per method")
    parser.add_argument("--world", type=int, default=4,
                        help="the world one rank's work is timed in (the other ranks' payloads are this one's)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="the bucket cap, in MB")
    parser.add_argument("--communicator", default="own", choices=["own", "auto", "allgather", "alltoall"],
                        help="how the allgather methods' buckets travel (default: their own allgather, the one-phase "
                             "exchange whose per-tensor and bucketed forms this compares; 'auto' is grace's default)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's and grace's native threads on a CPU (0: their defaults)")
    parser.add_argument("--bucketed-only", action="store_true", help="skip the per-tensor exchange")
    parser.add_argument("--out", type=Path, default=Path("results/bench_step"), help="where the results go")
    parser.add_argument("--profile-top", type=int, default=0, metavar="N",
                        help="after each model's table, the N ops of a bucketed step that took the most time")
    parser.add_argument("--accelerator-path", action="store_true",
                        help="on a CPU, run (and count the ops and waits of) the code path a GPU takes; CPU times")
    args = parser.parse_args()
    if args.accelerator_path and args.device != "cpu":
        parser.error("--accelerator-path is for a CPU (on a GPU that path runs anyway)")
    return args


def main():
    args = parse_args()
    waits = take_accelerator_path() if args.accelerator_path else None
    if args.threads:  # forward and backward, and the compression work, on as many threads
        torch.set_num_threads(args.threads)
        grace.native.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows, profiles = [], []
    for model in args.models:
        net, x, y, loss = build(model, args.device)
        fwd_bwd, grads = gradients(net, x, y, loss, args.device, args.iters)
        params = sum(g.numel() for g in grads.values())
        print(f"\n{model} on {args.device}: {len(grads)} gradient tensors, {params / 1e6:.1f}M parameters, "
              f"fwd+bwd {1e3 * fwd_bwd:.1f} ms; compression work of one rank in a world of {args.world}")
        passes = memory_passes(grads, args.iters) if args.device == "cpu" else {}
        if passes:
            print(f"memory passes (torch, gradient by gradient): read {passes['read_ms']:.2f} ms, write "
                  f"{passes['write_ms']:.2f} ms, g + e into a third buffer {passes['compensate_ms']:.2f} ms; "
                  f"error feedback's floor (that and a dense result) {passes['feedback_floor_ms']:.2f} ms, "
                  f"{passes['feedback_floor_ms'] / (1e3 * fwd_bwd):.1%} of fwd+bwd")
        print_header()
        for method in args.methods:
            skipped = {"work_ms": float("nan"), "calls": "-", "ops": "-", "waits": "-"}
            per_tensor = skipped if args.bucketed_only else measure(grads, method, 0, args.world, args.device,
                                                                     args.iters, waits=waits)
            bucketed = measure(grads, method, args.bucket_mb, args.world, args.device, args.iters,
                               args.profile_top, waits, args.communicator)
            if "top" in bucketed:
                profiles.append(f"{model}, {method}, bucketed:\n{bucketed.pop('top')}")
            row = {"model": model, "device": args.device, "method": method, "tensors": len(grads),
                   "parameters": params, "fwd_bwd_ms": 1e3 * fwd_bwd, **passes,
                   **{f"per_tensor_{k}": v for k, v in per_tensor.items()},
                   **{f"bucketed_{k}": v for k, v in bucketed.items()},
                   "per_tensor_share": per_tensor["work_ms"] / (1e3 * fwd_bwd),
                   "bucketed_share": bucketed["work_ms"] / (1e3 * fwd_bwd),
                   "speedup": per_tensor["work_ms"] / bucketed["work_ms"]}
            rows.append(row)
            print_row(method, row)
        print(*profiles, sep="\n\n")
        profiles.clear()
    path = write_results(rows, args.out, f"bench_step_{args.device}", vars(args) | {"out": str(args.out)},
                         methods=METHODS)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
