"""Data-parallel training on scikit-learn's digits with a grace compression method.

    horovodrun -np 4 -H localhost:4 --gloo python scripts/train.py --compressor topk --ratio 0.01
    horovodrun -np 4 -H localhost:4 --gloo python scripts/train.py --framework tensorflow
    mpirun -np 2 python scripts/train.py --compressor threshold --threshold 0.01 --epochs 10
    torchrun --standalone --nproc-per-node 4 scripts/train.py --engine ddp --compressor topk

Each rank trains on its shard of the training set; gradients travel compressed through
``hvd.DistributedOptimizer`` (PyTorch), PyTorch DDP with grace's communication hook
(``--engine ddp``: Gloo, no Horovod), or Keras's ``hvd.DistributedOptimizer``
and ``model.fit`` (TensorFlow, Keras 2). Rank 0 shows progress and prints a summary (test accuracy, bytes sent
per step against uncompressed float32, steps per second); ``--json`` saves it.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import grace
from grace.bench.common import help_parser


def parse_args(argv=None):
    parser = help_parser(__doc__)
    parser.add_argument("--framework", default="torch", choices=["torch", "tensorflow"], help="the toolkit")
    parser.add_argument("--engine", default="horovod", choices=["horovod", "ddp"],
                        help="PyTorch: Horovod's DistributedOptimizer, or DDP with grace's hook (torchrun)")
    parser.add_argument("--compressor", default="topk", choices=grace.methods(), help="the method")
    parser.add_argument("--ratio", type=float, default=0.01, help="topk, randomk, dgc, adaq: fraction sent")
    parser.add_argument("--threshold", type=float, default=0.01, help="threshold: |x| >= threshold is sent")
    parser.add_argument("--levels", type=int, default=127, help="qsgd: quantization levels")
    parser.add_argument("--rank", type=int, default=1, help="powersgd: rank of the approximation")
    parser.add_argument("--memory", default=None, help="'residual' or 'none' (default: the method's own)")
    parser.add_argument("--communicator", default=None,
                        choices=["allreduce", "allgather", "broadcast", "alltoall", "auto"],
                        help="how payloads travel (default: the method's own: 'auto' for the allgather methods)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="the learning rate")
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="the optimizer's, or, for dgc and signum, the method's own")
    parser.add_argument("--hidden", type=int, default=128, help="the MLP's hidden units")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the weights and the batches")
    parser.add_argument("--json", type=Path, help="write the summary here (rank 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


# method: {GRACE parameter: the command-line argument that sets it}
METHOD_ARGS = {
    "topk": {"compress_ratio": "ratio"}, "randomk": {"compress_ratio": "ratio"},
    "adaq": {"compress_ratio": "ratio"}, "dgc": {"compress_ratio": "ratio", "momentum": "momentum"},
    "threshold": {"threshold": "threshold"}, "qsgd": {"quantum_num": "levels"},
    "powersgd": {"matrix_approximation_rank": "rank"}, "efsignsgd": {"lr": "lr"}, "signum": {"momentum": "momentum"},
}
OWN_MOMENTUM = {"dgc", "signum"}  # the method applies the momentum; the optimizer runs without


def make_compression(args) -> grace.GradientCompression:
    params = {"compressor": args.compressor}
    for key, arg in METHOD_ARGS.get(args.compressor, {}).items():
        params[key] = getattr(args, arg)
    if args.memory is not None:
        params["memory"] = args.memory
    if args.communicator is not None:
        params["communicator"] = args.communicator
    return grace.from_params(params)


def digits(seed: int):
    """Standardised 8x8 digit images: (x_train, y_train, x_test, y_test), the same on every rank."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5).astype(np.float32)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def main(argv=None):
    args = parse_args(argv)
    compression = make_compression(args)  # bad arguments fail before Horovod starts
    if args.engine == "ddp" and args.framework != "torch":
        raise SystemExit("--engine ddp trains with PyTorch (--framework torch)")
    train = train_keras if args.framework == "tensorflow" else train_torch
    result = train(args, compression)
    stats = result["stats"]
    summary = {
        "framework": args.framework,
        "engine": args.engine,
        "compression": repr(compression),
        "error_feedback": compression.memory.needs_feedback,
        "ranks": result["size"],
        "rank": result["rank"],
        "epochs": args.epochs,
        "steps": stats.steps,
        "test_accuracy": result["accuracy"],
        "bytes_per_step": stats.bytes_sent / stats.steps,
        "dense_bytes_per_step": stats.dense_bytes / stats.steps,
        "compression_ratio": stats.compression_ratio,
        "steps_per_second": result["steps"] / result["elapsed"],
        "ranks_agree": result["ranks_agree"],  # every rank ended with the same model
        "plans": sorted(getattr(stats, "plans", {}).values()),  # how each bucket travelled ('auto''s choice)
    }
    if summary["rank"] == 0:
        print(f"\n{summary['compression']} on {summary['ranks']} ranks ({args.framework}, {args.engine}), {args.epochs} epochs:\n"
              f"  test accuracy     {summary['test_accuracy']:.4f}\n"
              f"  bytes per step    {summary['bytes_per_step']:.0f} "
              f"(uncompressed float32: {summary['dense_bytes_per_step']:.0f}, "
              f"{summary['compression_ratio']:.1f}x fewer)\n"
              f"  steps per second  {summary['steps_per_second']:.1f}\n"
              f"  ranks agree       {summary['ranks_agree']}")
        if summary["plans"]:
            print(f"  buckets           {', '.join(summary['plans'])}")
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2))
    return summary


class HorovodEngine:
    """Horovod's DistributedOptimizer (grace's compression, or Horovod's own)."""

    def __init__(self):
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def wrap(self, model, optimizer, compression):
        optimizer = self.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                  compression=compression)
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.stats = lambda: optimizer.grace_stats
        return model, optimizer

    def reduce(self, value, op: str):
        """``value`` (a number) reduced over the ranks by ``op``: 'min', 'max' or 'sum'."""
        import torch

        ops = {"min": self.hvd.Min, "max": self.hvd.Max, "sum": self.hvd.Sum}
        return self.hvd.allreduce(torch.tensor(value), op=ops[op], name=f"train.{op}").item()

    def gather(self, tensor):
        return self.hvd.allgather(tensor[None])

    def close(self) -> None:
        """(Horovod shuts itself down at exit.)"""


class DDPEngine:
    """PyTorch DistributedDataParallel (launched by torchrun) with grace's communication hook,
    or with what ``compression(model)`` registers when it is not a grace compression."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        if not dist.is_initialized():  # (train_methods.py trains one method after another)
            dist.init_process_group("gloo")
            atexit.register(self._teardown)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def _teardown(self) -> None:
        """The process group torn down while the interpreter is whole: Gloo's threads can abort
        its own teardown (terminate called without an active exception) while DDP models and
        hook states, kept alive by reference cycles, still hold the group."""
        gc.collect()
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def close(self) -> None:
        """At the end of a run that went well: every rank done with its collectives, then torn down."""
        self.dist.barrier()
        self._teardown()

    def wrap(self, model, optimizer, compression, **ddp_options):
        import grace.torch.ddp
        from torch.nn.parallel import DistributedDataParallel

        # (broadcasts rank 0's parameters)
        model = DistributedDataParallel(model, **{**getattr(compression, "ddp_options", {}), **ddp_options})
        if isinstance(compression, grace.GradientCompression):
            state = grace.torch.ddp.register(model, compression)
            self.stats = lambda: state.stats
        else:
            compression(model)
        return model, optimizer

    def reduce(self, value, op: str):
        import torch

        value = torch.tensor(value)
        self.dist.all_reduce(value, op=getattr(self.dist.ReduceOp, op.upper()))
        return value.item()

    def gather(self, tensor):
        import torch

        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.dist.all_gather(out, tensor)
        return torch.stack(out)


ENGINES = {"horovod": HorovodEngine, "ddp": DDPEngine}


MODEL_KINDS = ("mlp", "cnn", "resnet")


def build_model(spec: dict):
    """A model for 8x8 digits: ``{"kind": "mlp", "hidden": [...]}``, ``{"kind": "cnn", "channels":
    c, "layers": n, "upsample": f}``, or ``{"kind": "resnet", "channels": c, "blocks": n}``:
    n residual blocks of two 3x3 convolutions with batch norm, many small tensors as in a
    ResNet (6 per block)."""
    import torch.nn as nn

    if spec["kind"] == "resnet":
        c = spec["channels"]

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                          nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

            def forward(self, x):
                return nn.functional.relu(x + self.body(x))

        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, c, 3, padding=1, bias=False),
                             nn.BatchNorm2d(c), nn.ReLU(), *[Block() for _ in range(spec["blocks"])],
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    if spec["kind"] == "mlp":
        sizes = [64, *spec["hidden"], 10]
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    c = spec["channels"]
    layers, width = [nn.Unflatten(1, (1, 8, 8))], 1
    if spec.get("upsample", 1) > 1:  # more pixels: more compute per parameter
        layers.append(nn.Upsample(scale_factor=spec["upsample"]))
    for _ in range(spec["layers"]):
        layers += [nn.Conv2d(width, c, 3, padding=1), nn.ReLU()]
        width = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(c * 64, 10))


class DigitsRun:
    """One rank's model, its shard of the digits and its distributed optimizer (through an
    engine): the training loop of train.py and of the benchmarks."""

    def __init__(self, engine, model, compression, *, lr: float, momentum: float, batch_size: int, seed: int,
                 **ddp_options):
        import torch

        self.engine, self.compression = engine, compression
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        self.model, self.optimizer = engine.wrap(model, optimizer, compression, **ddp_options)
        x_train, x_test, y_train, y_test = digits(seed)
        rank, size = engine.rank, engine.size
        self.x, self.y = torch.from_numpy(x_train[rank::size]), torch.from_numpy(y_train[rank::size])
        self.x_test, self.y_test = torch.from_numpy(x_test), y_test
        self.batch = batch_size
        # every rank takes as many steps per epoch, or the collectives would not pair up
        self.steps_per_epoch = int(engine.reduce(len(self.x) // self.batch, "min"))
        self.rng = np.random.default_rng(seed + rank)

    def epoch_batches(self):
        import torch

        order = torch.from_numpy(self.rng.permutation(len(self.x)))
        for s in range(self.steps_per_epoch):
            idx = order[s * self.batch:(s + 1) * self.batch]
            yield self.x[idx], self.y[idx]

    def step(self, x, y):
        """One step; the loss."""
        import torch.nn.functional as F

        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss

    def accuracy(self) -> float:
        import torch

        with torch.no_grad():
            return float((self.model(self.x_test).argmax(1).numpy() == self.y_test).mean())

    def ranks_agree(self) -> bool:
        """Whether every rank holds the same model."""
        import torch

        checksum = self.engine.gather(torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]))
        return bool(torch.allclose(checksum, checksum[0:1].expand_as(checksum)))

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def train_torch(args, compression):
    import torch

    engine = ENGINES[args.engine]()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = build_model({"kind": "mlp", "hidden": [args.hidden]})
    run = DigitsRun(engine, model, compression, lr=args.lr,
                    momentum=0.0 if args.compressor in OWN_MOMENTUM else args.momentum,
                    batch_size=args.batch_size, seed=args.seed)
    total = args.epochs * run.steps_per_epoch
    bar = tqdm(total=total, disable=engine.rank != 0 or args.no_progress, desc=repr(compression.compressor))
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for x, y in run.epoch_batches():
            loss = run.step(x, y)
            bar.update()
        bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - start
    bar.close()
    return dict(accuracy=run.accuracy(), stats=engine.stats(), rank=engine.rank, size=engine.size, steps=total,
                elapsed=elapsed, ranks_agree=run.ranks_agree())


def train_keras(args, compression):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Horovod's Keras support needs Keras 2
    import tensorflow as tf
    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = digits(args.seed)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(args.hidden, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    momentum = 0.0 if args.compressor in OWN_MOMENTUM else args.momentum
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.lr, momentum=momentum),
                                         compression=compression)
    model.compile(optimizer, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    # Every rank takes the same number of steps per epoch, or the collectives would not pair up.
    steps_per_epoch = int(hvd_tf.allreduce(tf.constant(len(x_train) // args.batch_size), op=hvd_tf.Min))
    data = (tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=args.seed + hvd.rank())
            .batch(args.batch_size, drop_remainder=True).repeat())
    start = time.perf_counter()
    model.fit(data, epochs=args.epochs, steps_per_epoch=steps_per_epoch,
              verbose=2 if hvd.rank() == 0 and not args.no_progress else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    elapsed = time.perf_counter() - start

    accuracy = float((model.predict(x_test, verbose=0).argmax(1) == y_test).mean())
    weights = tf.concat([tf.reshape(w, (-1,)) for w in model.trainable_weights], 0)
    checksum = hvd_tf.allgather(weights[None]).numpy()
    return dict(accuracy=accuracy, stats=optimizer.grace.stats, rank=hvd.rank(), size=hvd.size(),
                steps=args.epochs * steps_per_epoch, elapsed=elapsed,
                ranks_agree=bool(np.allclose(checksum, checksum[:1])))


if __name__ == "__main__":
    main()
