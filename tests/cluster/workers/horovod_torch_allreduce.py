"""Horovod (PyTorch) allreduce over the emulated cluster; rank 0 prints a JSON line.

Checks the sum of a small tensor and times the allreduce of --mb MB of float32.
"""
import argparse
import json
import socket
import time

import torch
import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--mb", type=float, default=4.0)
parser.add_argument("--reps", type=int, default=2)
args = parser.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
small = hvd.allreduce(torch.full((10,), float(rank + 1)), op=hvd.Sum, name="small")
ok = bool(torch.all(small == size * (size + 1) / 2))
n = int(args.mb * 1e6 / 4)
big = torch.full((n,), float(rank + 1))
times = []
for i in range(args.reps):
    hvd.allreduce(torch.zeros(1), name=f"barrier{i}")
    t0 = time.perf_counter()
    out = hvd.allreduce(big, op=hvd.Sum, name=f"big{i}")
    times.append(time.perf_counter() - t0)
ok = ok and bool(torch.all(out == size * (size + 1) / 2))
info = hvd.allgather_object({"rank": rank, "hostname": socket.gethostname(), "ok": ok,
                             "local_rank": hvd.local_rank(), "local_size": hvd.local_size()})
times = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name="times").tolist()
if rank == 0:
    print("RESULT " + json.dumps({"size": size, "bytes": 4 * n, "seconds": times, "ranks": info,
                                  "controller": "mpi" if hvd.mpi_enabled() and hvd.mpi_built() and
                                  not hvd.gloo_enabled() else "gloo"}), flush=True)
hvd.shutdown()
