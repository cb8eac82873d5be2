"""What compression costs per training step on real models' gradients, per-tensor and bucketed.

    python scripts/bench_step.py [--models mlp48 resnet50 transformer] [--methods topk dgc ...]
                                 [--device cpu|cuda] [--iters 10] [--world 4] [--bucket-mb 25]
                                 [--bucketed-only] [--profile-top N] [--accelerator-path]
                                 [--shrink N] [--out results/bench_step]

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
  floor        on a CPU, bucketed work over the floor its target is set against, and the target:
               error-feedback methods 2x error feedback's floor, none / fp16 / signsgd 1.5x a
               read plus a write of the gradients, the passes timed between the method's steps, one
               of each after each step (the line below each table names the methods over their target)
  bytes        bytes this rank hands to the collectives per step
  plans        the plans the buckets took (``Exchange.plan_of``: per-gradient, flat, segmented, ...)
On a CPU a line above each table times plain torch passes over the model's gradients (read,
write, g + e into a third buffer): what any error-feedback method pays before it compresses.
Threshold's lambda is the magnitude that 1% of the model's gradient elements exceed (printed).
--accelerator-path (CPU, buckets only): run the code path a GPU takes (segment-wise and whole
buckets) to count its operations and host waits where no GPU is at hand, two ways: "native", a
GPU with grace's CUDA library (each grace.native call counted at the kernels and memsets its
CUDA code launches and the waits it makes, ``Kernel.launches``), and "fallback", a GPU without
it (the tensor-op code; a segmented bucket's two phases fused by torch.compile, as on a GPU:
each of inductor's C++ kernels counted as one launch, standing in for its Triton kernel). Ops
are the operations a GPU launches kernels for (views, allocations, copies that copy nothing
and the stand-in collectives' own left out), also per bucket (and round, for multi-round
plans), against the limits below the table. Its times are a CPU's.
--shrink N: every gradient about N times smaller (its dimensions above 1 divided alike, each at
least 1; the bucket cap as much as the total: as many buckets), its name and rank kept: the steps then
time what does not grow with the elements (Python, calls, kernel launches), the part a model of
hundreds of small tensors pays on every step (no CPU targets then: the floor is tiny too).
The phase clock syncs the device at each phase boundary, which a GPU pays for per tensor: the
JSON also holds ``exchange_free_ms``, whole steps timed with no clock (work and the stand-in
collectives, as training runs them).
Times are medians over ``--iters`` steps after three warm-up steps (a GPU without grace's CUDA
library compiles its fused phases in the third; threshold's mean once two pairs are selected),
with a device sync around each. The fallback's counts are those of a step whose fused calls all
ran compiled (none a first call, none compiling).
torchvision's ResNet-50 is used where torchvision imports; otherwise the same layers, defined
here (25.6M parameters in 161 tensors either way).
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

import numpy as np
import torch
from torch import nn

import grace
import grace.native
from grace.core import draws
from grace.backends import torch_fusion
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
#: the share of a model's gradient elements that threshold's lambda lets pass on the step's own
#: gradients, as top-k's, random-k's and DGC's ratio does: a fixed lambda sends most of one model
#: (0.01: 70% of ResNet-50 here) and almost none of another, where a user tunes it to a density
THRESHOLD_DENSITY = 0.01
DEFAULT_METHODS = ["none", "fp16", "topk", "randomk", "threshold", "signsgd", "efsignsgd", "onebit", "terngrad",
                   "natural", "qsgd", "dgc", "powersgd"]


def arguments(method: str, grads: dict) -> dict:
    """The arguments ``method`` is benchmarked with on ``grads``: ``METHODS``', but threshold's
    lambda, the magnitude that THRESHOLD_DENSITY of the gradients' elements exceed."""
    if method != "threshold":
        return METHODS[method]
    magnitudes = torch.cat([g.detach().abs().flatten() for g in grads.values()])
    passing = max(1, int(THRESHOLD_DENSITY * magnitudes.numel()))
    return {"threshold": float(magnitudes.kthvalue(magnitudes.numel() - passing).values)}


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
STAND_IN = "grace.bench::collective"  # a stand-in collective's profiler range


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
            with torch.profiler.record_function(STAND_IN):  # (the network's work, not grace's: not counted)
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


class FloorPasses:
    """On a CPU, plain torch passes over the gradients, one gradient at a time: reading them (a
    sum), writing as much (zeros), and g + e into a third buffer, which error feedback cannot
    avoid where a skipped step must find the old memory e unchanged. With the dense result
    written over the gradients, ``feedback_floor_ms``: what an error-feedback method pays before
    it selects or codes anything (a floor for torch code, not for hand-written loops).

    ``sample`` times each pass once, as ``measure`` times a step: just after backward's stand-in
    wrote the gradients (copied them in), so the floor finds the caches as the methods do;
    ``measure`` samples them after each of a method's steps, so that the work and the floor it
    is held to are timed in the same seconds of a shared machine (whose load moves the floor by
    more than the targets' margins from one second to the next). ``sample(warm=True)``: the
    passes repeated over data they left in the caches, kept as ``warm_*`` (on a machine whose
    cache holds the gradients alone but not with their source, those read from the cache where
    the methods' steps read from memory)."""

    PASSES = ("read", "write", "compensate")

    def __init__(self, grads: dict):
        self.sources = list(grads.values())
        self.gs = [g.clone() for g in self.sources]
        self.es, self.outs = [torch.rand_like(g) for g in self.gs], [torch.zeros_like(g) for g in self.gs]
        self.times = collections.defaultdict(list)

    def backward(self):
        for g, source in zip(self.gs, self.sources):
            g.copy_(source)

    def _run(self, name: str):
        if name == "read":
            return [g.sum() for g in self.gs]
        if name == "write":
            return [o.zero_() for o in self.outs]
        return [torch.add(g, e, out=o) for g, e, o in zip(self.gs, self.es, self.outs)]

    def sample(self, warm: bool = False):
        prefix = "warm_" if warm else ""
        for name in self.PASSES:
            if not warm:
                self.backward()
            start = time.perf_counter()
            self._run(name)
            self.times[prefix + name].append(time.perf_counter() - start)

    def medians(self) -> dict:
        """ms of each pass sampled (medians), and the floors they make; the samples then cleared."""
        ms = {f"{key}_ms": 1e3 * statistics.median(times) for key, times in self.times.items()}
        for prefix in dict.fromkeys(key[:-len("read_ms")] for key in ms if key.endswith("read_ms")):
            ms[f"{prefix}feedback_floor_ms"] = ms[f"{prefix}compensate_ms"] + ms[f"{prefix}write_ms"]
        self.times.clear()
        return ms


def memory_passes(grads: dict, iters: int) -> dict:
    """``FloorPasses``' medians over ``iters`` samples after two (and as many over warm data)."""
    floor = FloorPasses(grads)
    for warm in (False, True):
        for i in range(2 + iters):
            floor.sample(warm)
    for times in floor.times.values():
        del times[:2]  # (warm-up)
    return floor.medians()


def shrunk(grads: dict, factor: float) -> dict:
    """``--shrink``: each gradient about ``factor`` times smaller (its dimensions above 1 divided
    alike), of the same rank (random values)."""
    def shape(dims):
        per = factor ** (1 / max(1, sum(d > 1 for d in dims)))
        return tuple(max(1, round(d / per)) if d > 1 else d for d in dims)
    return {name: torch.randn(shape(g.shape), device=g.device) for name, g in grads.items()}


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
    "as_strided", "lift_fresh", "empty", "empty_like", "empty_strided", "unflatten", "detach_", "numpy_T",
    "resolve_conj", "resolve_neg")}


class AcceleratorPath:
    """From here on, the code path a GPU takes, on this CPU: the backend told that its tensors
    are on an accelerator, counted two ways (``mode``):

      native    a GPU with grace's CUDA library: every grace.native call that has a CUDA kernel
                runs here (the CPU library's, or a stand-in where only the GPU has it) and counts
                as the launches and host waits its CUDA code makes (``Kernel.cuda_cost``);
      fallback  a GPU without it: no native call, the tensor-op code runs.

    ``waits`` counts the reads back a GPU would wait for (``host_ints``); a copy of host data to
    the device (``asarray`` of a step's table or words) counts as the one copy a GPU launches."""

    def __init__(self):
        self.waits, self.native = 0, True
        TorchBackend.on_accelerator = lambda backend, x: True
        import torch._inductor.config  # (its kernels' profiler ranges: counted as launches)
        torch._inductor.config.cpp.enable_kernel_profile = True
        kernel, read = grace.native.kernels.kernel, TorchBackend.host_ints
        grace.native.kernel = grace.native.kernels.kernel = lambda name, like: self._kernel(kernel, name, like)

        def host_ints(backend, x, count: int):
            self.waits += 1
            return read(backend, x, count)

        TorchBackend.host_ints = host_ints
        to_device = TorchBackend.asarray

        def asarray(backend, data, like=None):
            if like is None:
                return to_device(backend, data)
            with torch.profiler.record_function(COPY_TO_DEVICE):
                return to_device(backend, data, like)

        TorchBackend.asarray = asarray

    @contextlib.contextmanager
    def mode(self, mode: str):
        saved, self.native = self.native, mode == "native"
        fusing, torch_fusion.ON_CPU = torch_fusion.ON_CPU, mode == "fallback"  # (as on a GPU without it)
        try:
            yield
        finally:
            self.native, torch_fusion.ON_CPU = saved, fusing

    def _kernel(self, kernel, name: str, like):
        entry = grace.native.KERNELS[name]
        function = (kernel(name, like) or STAND_INS.get(name)) if self.native and entry.cuda else None
        if function is None:
            return None

        def call(*args, **kwargs):
            launched, waits = entry.cuda_cost(*args, **kwargs)
            with torch.profiler.record_function(f"{NATIVE_CALL}{name}|{launched}|{waits}"):
                return function(*args, **kwargs)

        return call


NATIVE_CALL = "grace.native::"  # a native call's profiler range: grace.native::<name>|<launches>|<waits>
COPY_TO_DEVICE = "grace.bench::copy_to_device"  # host data copied to the (stand-in) device: one copy
FUSED_KERNEL = "_cpp_fused_"  # an inductor C++ kernel's profiler range (cpp.enable_kernel_profile)


def _hash_keys_here(counts, words, out):
    """hash_keys_segments as its CUDA kernel makes them (the CPU library has no such kernel)."""
    keys = [np.int64(s) << 32 | draws.draw_hashes(np.arange(n, dtype=np.int64), w)
            for s, (n, w) in enumerate(zip(counts, words))]
    out.copy_(torch.from_numpy(np.concatenate(keys) if keys else np.zeros(0, np.int64)))
    return out


STAND_INS = {"hash_keys_segments": _hash_keys_here}


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


# copies only where needed: a GPU launches nothing for these when no child op copies
COPIES_IF_NEEDED = {"aten::to", "aten::contiguous", "aten::type_as", "aten::reshape"}


def _launched_here(event) -> bool:
    """Whether a top-level torch op on this CPU would launch a kernel on a GPU."""
    if event.name in NO_KERNEL:
        return False
    return event.name not in COPIES_IF_NEEDED or bool(event.cpu_children)


def _top_level(event) -> bool:
    """An op or native call not made from within another."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", NATIVE_CALL, STAND_IN, COPY_TO_DEVICE)):
            return False
        parent = parent.cpu_parent
    return True


def accelerator_counts(events) -> dict:
    """{"ops", "waits"} of the accelerator path's profiled events: torch ops that would launch
    kernels plus native calls at their CUDA launches; reads back (a scalar read, a compaction of
    unknown size) plus the native calls' waits."""
    ops = waits = 0
    for event in events:
        if not _top_level(event):
            continue
        if event.name.startswith(NATIVE_CALL):
            launched, waited = event.name.rsplit("|", 2)[1:]
            ops, waits = ops + int(launched), waits + int(waited)
        elif event.name.startswith("aten::"):
            ops += _launched_here(event)
        elif FUSED_KERNEL in event.name or event.name == COPY_TO_DEVICE:  # (a kernel torch.compile made; a copy)
            ops += 1
            waits += event.name in ("aten::_local_scalar_dense", "aten::nonzero")
    return {"ops": ops, "waits": waits}


def launches(fn, device: str, top: int = 0, path: AcceleratorPath = None) -> dict:
    """What one call of ``fn`` launches: {"ops": GPU kernels and copies, "waits": host waits
    for the GPU} on a GPU, {"ops": top-level torch ops} on a CPU, or on the accelerator path
    (``path``) {"ops", "waits"} as ``accelerator_counts`` counts them; with ``top``, also "top":
    the profiler's table of the ``top`` ops that took the most time (the device's, on a GPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = device != "cpu"
    reads_before = path.waits if path else 0
    with profiler_lines_dropped(), profile(activities=[ProfilerActivity.CPU,
                                                       *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        fn()
    events = prof.events()
    table = {"top": prof.key_averages().table(sort_by="self_device_time_total" if gpu else "self_cpu_time_total",
                                              row_limit=top)} if top else {}
    if path is not None:
        counted = accelerator_counts(events)
        return {"ops": counted["ops"], "waits": counted["waits"] + path.waits - reads_before, **table}
    if not gpu:
        return {"ops": sum(1 for e in events if e.cpu_parent is None and e.name.startswith("aten::")), **table}
    return {"ops": sum(1 for e in events if e.device_type == DeviceType.CUDA),
            "waits": sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                         "cudaEventSynchronize", "cudaMemcpy")), **table}


def measure(grads: dict, method: str, kwargs: dict, bucket_mb: float, world: int, device: str, iters: int,
            top: int = 0, path: AcceleratorPath = None, communicator: str = "own", floor: FloorPasses = None) -> dict:
    """One method's row (``kwargs``: its arguments) in one way of exchanging; ``floor``: sampled after each step."""
    def new_exchange():
        compression = grace.create(method, **kwargs, bucket_mb=bucket_mb)
        if compression.collective is grace.Collective.ALLGATHER and bucket_mb:
            compression = compression.via(compression.collective if communicator == "own" else communicator)
        # as the adapters run it: results written over the gradients handed over (on a CPU), so
        # each step gets this step's gradients again first, as backward would write them
        return grace.Exchange(compression, CountingReplica(world), in_place=True)

    exchange = new_exchange()
    comm = exchange.communicator
    inputs = {name: g.clone() for name, g in grads.items()}

    def backward():
        for name, g in inputs.items():
            g.copy_(grads[name])

    # The stand-in collectives (sums and copies of this rank's payload) are the network's part of
    # a step, not grace's: timed phase by phase in the same steps, they are left out of work.
    sync = _sync(device)
    exchange.phases = clock = PhaseClock(sync)
    steps, collectives = [], []
    for i in range(3 + iters):
        backward()
        calls_before = comm.calls
        clock.reset()
        sync()
        start = time.perf_counter()
        exchange.exchange(inputs)
        sync()
        if i >= 3:
            steps.append(time.perf_counter() - start)
            collectives.append(clock.reset()["collective"])
            if floor is not None:
                floor.sample()
    seconds, collective = statistics.median(steps), statistics.median(collectives)
    work = statistics.median(s - c for s, c in zip(steps, collectives))
    calls, nbytes = comm.calls - calls_before, exchange.stats.last_step_bytes
    exchange.phases = None
    free = timed(lambda: exchange.exchange(inputs), device, iters, warmup=0, setup=backward)
    backward()
    row = {"work_ms": 1e3 * work, "exchange_ms": 1e3 * seconds, "collective_ms": 1e3 * collective,
           "exchange_free_ms": 1e3 * free, "calls": calls, "bytes": nbytes, "plans": plans_taken(exchange),
           "buckets": len(exchange.bucket_plans()), **launches(lambda: exchange.exchange(inputs), device, top, path),
           **({"floor": floor.medians()} if floor is not None else {})}
    if path is not None:  # the same step once more without grace's CUDA library (a fresh exchange)
        with path.mode("fallback"):
            fallback = new_exchange()
            for step in range(20):  # op by op, then the fused phases' first calls, then compiling them: counted
                # on a step that made no fused function's first call and compiled none (a threshold's bucket
                # that selects nothing for a few steps makes its first call of pairs later)
                cold = torch_fusion.cold_calls
                backward()
                counted = launches(lambda: fallback.exchange(inputs), device, path=path)
                if step >= 2 and torch_fusion.cold_calls == cold:
                    break
            row.update(fallback_ops=counted["ops"], fallback_waits=counted["waits"], fallback_step=step + 1)
    return row


def plans_taken(exchange) -> str:
    """The plans the exchange's buckets took, with how many took each (``Exchange.plan_of``)."""
    plans = collections.Counter(plan.name for plan in exchange.bucket_plans().values())
    return ", ".join(f"{name} x{count}" for name, count in sorted(plans.items())) or "reference"


def print_model(model: str, args, grads: dict, fwd_bwd: float, passes: dict, kwargs: dict) -> None:
    """The lines above a model's table: its gradients, the memory passes, threshold's lambda
    (``kwargs``: each method's arguments)."""
    params = sum(g.numel() for g in grads.values())
    print(f"\n{model} on {args.device}: {len(grads)} gradient tensors, {params / 1e6:.1f}M parameters, "
          f"fwd+bwd {1e3 * fwd_bwd:.1f} ms; compression work of one rank in a world of {args.world}"
          + (f"; every gradient {args.shrink:g}x smaller (--shrink)" if args.shrink > 1 else ""))
    if passes:
        print(f"memory passes (torch, gradient by gradient, each just after backward's write, as a step): read "
              f"{passes['read_ms']:.2f} ms, write {passes['write_ms']:.2f} ms, g + e into a third buffer "
              f"{passes['compensate_ms']:.2f} ms; error feedback's floor (that and a dense result) "
              f"{passes['feedback_floor_ms']:.2f} ms, {passes['feedback_floor_ms'] / (1e3 * fwd_bwd):.1%} of fwd+bwd"
              f" (each pass repeated over warm data: {passes['warm_read_ms']:.2f}, {passes['warm_write_ms']:.2f}, "
              f"{passes['warm_compensate_ms']:.2f}, floor {passes['warm_feedback_floor_ms']:.2f} ms)")
    if "threshold" in kwargs:
        print(f"threshold's lambda: {kwargs['threshold']['threshold']:.3g}, which "
              f"{THRESHOLD_DENSITY:.0%} of the gradients' elements exceed")


def print_header(accelerator: bool = False) -> None:
    if accelerator:  # the two paths' counts, per step and per bucket (and round: multi-round plans)
        print(f"{'method':<10} {'bucketed ms':>12} {'calls':>6} {'native ops':>11} {'/bucket':>8} {'waits':>6} "
              f"{'fallback ops':>13} {'/bucket':>8} {'waits':>6} {'bytes':>12}  plans")
        return
    print(f"{'method':<10} {'per-tensor ms':>13} {'share':>7} {'calls':>6} {'ops':>6} {'bucketed ms':>12} "
          f"{'share':>7} {'calls':>6} {'ops':>6} {'waits':>6} {'speedup':>8} {'floor':>10} {'bytes':>12} "
          f"{'(collective ms)':>16} {'(no clock ms)':>14}  plans")


def _shown(value: float, spec: str, unit: str = "") -> str:
    """``value`` formatted, or '-' for a part not run (--bucketed-only)."""
    return "-" if value != value else format(value, spec) + unit  # (NaN)


# the CPU targets, relative to the floors of the same run: error-feedback methods' bucketed work
# within 2x error feedback's floor; the methods that only read the gradients and write a result
# within 1.5x a read plus a write of them
FEEDBACK_TARGET, PASS_TARGET = 2.0, 1.5
PASS_METHODS = ("none", "fp16", "signsgd")


def against_floor(method: str, row: dict):
    """(bucketed work over the method's floor, its target), or None for a method without one."""
    if "feedback_floor_ms" not in row:
        return None
    if method in PASS_METHODS:
        return row["bucketed_work_ms"] / (row["read_ms"] + row["write_ms"]), PASS_TARGET
    if grace.create(method, **METHODS[method]).memory.needs_feedback:
        return row["bucketed_work_ms"] / row["feedback_floor_ms"], FEEDBACK_TARGET
    return None


# the most kernel-launching ops per bucket (and round, for multi-round plans) on a GPU with grace's
# CUDA library and without it, and the most host waits per step
LIMITS = {"native": 12, "fallback": 24}
MULTI_ROUND_LIMITS = {"native": 30, "fallback": 60}
WAITS_PER_STEP = 1


def per_bucket(row: dict) -> dict:
    """Each path's ops per bucket (and round) and its limit, from a bucketed row of the accelerator path."""
    buckets = row["bucketed_buckets"]
    multi_round = "multi-round" in row["bucketed_plans"]
    units = row["bucketed_calls"] if multi_round else buckets  # a multi-round bucket: a collective a round
    limits = MULTI_ROUND_LIMITS if multi_round else LIMITS
    return {path: (row[f"bucketed_{key}"] / units, limits[path])
            for path, key in (("native", "ops"), ("fallback", "fallback_ops"))}


def over_limits(row: dict) -> list:
    """What in a bucketed row of the accelerator path is above the limits, in words."""
    over = [f"{path} {ops:.1f} ops per bucket > {limit}" for path, (ops, limit) in per_bucket(row).items()
            if ops > limit]
    return over + [f"{path} {row[key]} waits > {WAITS_PER_STEP}"
                   for path, key in (("native", "bucketed_waits"), ("fallback", "bucketed_fallback_waits"))
                   if row[key] > WAITS_PER_STEP]


def _floor(method: str, row: dict) -> str:
    ratio = against_floor(method, row)
    return "-" if ratio is None else f"{ratio[0]:.2f}x/{ratio[1]:g}"


def print_row(method: str, row: dict, accelerator: bool = False) -> None:
    if accelerator:
        units = per_bucket(row)
        print(f"{method:<10} {row['bucketed_work_ms']:>12.2f} {row['bucketed_calls']:>6} {row['bucketed_ops']:>11} "
              f"{units['native'][0]:>8.1f} {row['bucketed_waits']:>6} {row['bucketed_fallback_ops']:>13} "
              f"{units['fallback'][0]:>8.1f} {row['bucketed_fallback_waits']:>6} {row['bucketed_bytes']:>12}  "
              f"{row['bucketed_plans']}", flush=True)
        return
    print(f"{method:<10} {_shown(row['per_tensor_work_ms'], '.2f'):>13} {_shown(row['per_tensor_share'], '.1%'):>7} "
          f"{row['per_tensor_calls']:>6} {row['per_tensor_ops']:>6} {row['bucketed_work_ms']:>12.2f} "
          f"{row['bucketed_share']:>7.1%} {row['bucketed_calls']:>6} {row['bucketed_ops']:>6} "
          f"{row.get('bucketed_waits', '-'):>6} {_shown(row['speedup'], '.2f', 'x'):>8} {_floor(method, row):>10} "
          f"{row['bucketed_bytes']:>12} "
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
    parser.add_argument("--shrink", type=float, default=1.0, metavar="N",
                        help="every gradient about N times smaller (as many buckets): the cost not growing with size")
    args = parser.parse_args()
    if args.shrink < 1:
        parser.error("--shrink must be at least 1")
    if args.accelerator_path and args.device != "cpu":
        parser.error("--accelerator-path is for a CPU (on a GPU that path runs anyway)")
    return args


def main():
    args = parse_args()
    path = AcceleratorPath() if args.accelerator_path else None
    if args.threads:  # forward and backward, and the compression work, on as many threads
        torch.set_num_threads(args.threads)
        grace.native.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows, profiles = [], []
    for model in args.models:
        net, x, y, loss = build(model, args.device)
        fwd_bwd, grads = gradients(net, x, y, loss, args.device, args.iters)
        bucket_mb = args.bucket_mb
        if args.shrink > 1:  # (the bucket cap shrunk as the gradients did: as many buckets)
            torch.manual_seed(1)
            full, grads = sum(g.numel() for g in grads.values()), shrunk(grads, args.shrink)
            bucket_mb *= sum(g.numel() for g in grads.values()) / full
        params = sum(g.numel() for g in grads.values())
        passes = memory_passes(grads, args.iters) if args.device == "cpu" and args.shrink == 1 else {}
        floor = FloorPasses(grads) if passes and path is None else None
        kwargs = {method: arguments(method, grads) for method in args.methods}
        print_model(model, args, grads, fwd_bwd, passes, kwargs)
        print_header(path is not None)
        for method in args.methods:
            skipped = {"work_ms": float("nan"), "calls": "-", "ops": "-", "waits": "-"}
            per_tensor = skipped if args.bucketed_only or path else measure(grads, method, kwargs[method], 0,
                                                                             args.world, args.device, args.iters)
            bucketed = measure(grads, method, kwargs[method], bucket_mb, args.world, args.device, args.iters,
                               args.profile_top, path, args.communicator, floor)
            if "top" in bucketed:
                profiles.append(f"{model}, {method}, bucketed:\n{bucketed.pop('top')}")
            row = {"model": model, "device": args.device, "method": method, "shrink": args.shrink,
                   "arguments": kwargs[method], "tensors": len(grads),
                   "parameters": params, "fwd_bwd_ms": 1e3 * fwd_bwd,
                   # the model's passes (and their warm repeat), those sampled between the method's steps over them
                   **passes, **bucketed.pop("floor", {}),
                   **{f"per_tensor_{k}": v for k, v in per_tensor.items()},
                   **{f"bucketed_{k}": v for k, v in bucketed.items()},
                   "per_tensor_share": per_tensor["work_ms"] / (1e3 * fwd_bwd),
                   "bucketed_share": bucketed["work_ms"] / (1e3 * fwd_bwd),
                   "speedup": per_tensor["work_ms"] / bucketed["work_ms"]}
            rows.append(row)
            print_row(method, row, path is not None)
        if passes and path is None:
            ratios = {row["method"]: against_floor(row["method"], row) for row in rows if row["model"] == model}
            over = [f"{method} {ratio:.2f}x > {target:g}x" for method, (ratio, target) in
                    ((m, r) for m, r in ratios.items() if r is not None) if ratio > target]
            print(f"CPU targets: bucketed work within {FEEDBACK_TARGET:g}x error feedback's floor (error-feedback "
                  f"methods), {PASS_TARGET:g}x a read plus a write ({', '.join(PASS_METHODS)}). Over them: "
                  f"{'; '.join(over) or 'none'}")
        if path is not None:
            over = [f"{row['method']}: {', '.join(over_limits(row))}" for row in rows
                    if row["model"] == model and over_limits(row)]
            print(f"limits: ops per bucket {LIMITS['native']} native, {LIMITS['fallback']} fallback (multi-round: "
                  f"{MULTI_ROUND_LIMITS['native']}, {MULTI_ROUND_LIMITS['fallback']} per bucket and round); "
                  f"{WAITS_PER_STEP} host wait per step. Over them: {'; '.join(over) or 'none'}")
        print(*profiles, sep="\n\n")
        profiles.clear()
    path = write_results(rows, args.out, f"bench_step_{args.device}", vars(args) | {"out": str(args.out)},
                         methods=METHODS)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
