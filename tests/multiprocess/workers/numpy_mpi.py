"""Reference worker: grace's pipeline on NumPy over mpi4py (no toolkit, no Horovod).

    mpirun -np 3 python numpy_mpi.py --out DIR
"""
from common import (ALLTOALL_VARIANTS, AUTO_VARIANTS, BROADCAST_VARIANTS, PARAMS, STEPS, VARIANTS, backward_order,
                    local_input, names, parse_args, save, state_arrays)

from grace import Exchange
from grace.mpi import MPICommunicator


def run(label, variant, comm):
    exchange = Exchange(variant.make(), comm, average=variant.op == "average")
    keys = names(variant)
    results = {}
    for step in range(STEPS):
        grads = {keys[i]: local_input(variant, comm.rank, step, i) for i in range(len(PARAMS))}
        for name, g_hat in exchange.exchange(backward_order(grads)).items():
            results[f"grad/{name}/{step}"] = g_hat
        results[f"bytes/{step}"] = exchange.stats.last_step_bytes
        if step == variant.checkpoint_after:  # a fresh exchange restored from the saved state
            state = exchange.state_dict()
            exchange = Exchange(variant.make(), comm, average=variant.op == "average")
            exchange.load_state_dict(state)
    results.update(state_arrays(exchange.state_dict(), lambda a: a))
    return results


def main():
    args = parse_args()
    comm = MPICommunicator()
    for label in args.variants:
        variant = {**VARIANTS, **BROADCAST_VARIANTS, **ALLTOALL_VARIANTS, **AUTO_VARIANTS}[label]
        save(args.out, label, comm.rank, run(label, variant, comm))


if __name__ == "__main__":
    main()
