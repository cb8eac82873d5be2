"""grace.torch.ddp in a world of one (Gloo, real DistributedDataParallel), in fresh processes.

Multi-process behaviour (np 2 and 3 against the all-rank reference and against Horovod) is in
tests/multiprocess/test_ddp.py; here: what registration refuses, that no Horovod module is
imported, and that the hook's state follows DDP's bucket rebuild, a checkpoint and an overflow.
"""
from __future__ import annotations

import textwrap

import pytest

from tests.conftest import run_snippet

PRELUDE = """
import atexit, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import grace, grace.torch.ddp
from grace.core.communicator import LocalCommunicator
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
atexit.register(dist.destroy_process_group)

def leave():
    # A snippet that ran to its end leaves without the interpreter's teardown, where DDP's and
    # Gloo's threads still alive can abort the process after every check has passed
    # ("terminate called without an active exception", a PyTorch race). One that raised exits as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    dist.destroy_process_group()
    os._exit(0)

def model(cap_mb=0.002, **kwargs):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(40, 40) for _ in range(6)]  # 1640 floats each: several buckets
    return DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=cap_mb, **kwargs)

def backward(ddp, step, poison=False):
    ddp.zero_grad()
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(step))
    loss = ddp(x).square().mean()
    (loss * float("inf") if poison else loss).backward()
    return {name: p.grad.clone() for name, p in ddp.module.named_parameters()}

def local_gradients(ddp, step):
    \"\"\"The same step's local gradients, without DDP.\"\"\"
    m = ddp.module
    m.zero_grad()
    m(torch.randn(8, 40, generator=torch.Generator().manual_seed(step))).square().mean().backward()
    return {name: p.grad.clone() for name, p in m.named_parameters()}
"""


def run(code: str) -> str:
    return run_snippet(PRELUDE, textwrap.dedent(code) + "\nleave()\n")


def test_importing_the_hook_imports_no_horovod():
    out = run("""
    import grace.torch
    grace.torch.ddp.register(model(), grace.topk(0.1))
    print(sorted(m for m in sys.modules if m.split(".")[0] == "horovod"))
    """)
    assert out.strip() == "[]"


def test_what_cannot_work_is_refused_at_registration():
    out = run("""
    cases = [
        (model().module, grace.topk(0.1)),
        (model(), "topk"),
        (model(), grace.topk(0.1, bucket_mb=0)),
        (model(), grace.signum(0.5, scope="bucket")),
        (DistributedDataParallel(torch.nn.Embedding(10, 3, sparse=True)), grace.topk(0.1)),
    ]
    for ddp, compression in cases:
        try:
            grace.torch.ddp.register(ddp, compression)
            print("accepted")
        except (TypeError, ValueError) as e:
            print(type(e).__name__, e)
    """)
    lines = out.strip().splitlines()
    assert len(lines) == 5 and not any(line == "accepted" for line in lines), out
    assert "DistributedDataParallel model" in lines[0]
    assert "grace compression" in lines[1]
    assert "bucket_cap_mb" in lines[2]
    assert "scope='tensor'" in lines[3]
    assert "sparse" in lines[4]


@pytest.mark.parametrize("method", ["grace.randomk(0.1)", "grace.topk(0.05)", "grace.signum(0.5)",
                                    "grace.powersgd(2)", "grace.dgc(0.05, sample_ratio=0.5)"])
def test_state_follows_ddp_bucket_rebuild(method):
    """DDP rebuilds its buckets after the first step (other members, other order). The hook's
    memory, state and step counters are per parameter name, so every step equals an exchange
    of the same gradients that never saw a bucket rebuild (per tensor, bucket_mb=0)."""
    out = run(f"""
    ddp = model()
    state = grace.torch.ddp.register(ddp, {method})
    ref = grace.Exchange({method[:-1]}, bucket_mb=0), LocalCommunicator())
    layouts = set()
    for step in range(4):
        got = backward(ddp, step)
        want = ref.exchange(local_gradients(ddp, step))
        layouts.add(tuple(sorted(state.exchange._buckets)))
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"step {{step}} {{name}}")
    steps = state.state_dict()["steps"]
    print(len(layouts), len(steps), set(int(v) for v in steps.values()))
    """)
    layouts, names, steps = out.split(maxsplit=2)
    assert int(layouts) >= 2, "DDP did not rebuild its buckets: the test would prove nothing"
    assert int(names) == 12 and steps.strip() == "{4}"


def test_checkpoint_loads_into_a_model_with_other_buckets():
    """Save after 2 steps, load into a new DDP model with another bucket size: steps 3 and 4
    equal those of the run that never stopped."""
    out = run("""
    ddp = model()
    state = grace.torch.ddp.register(ddp, grace.randomk(0.1))
    straight = [backward(ddp, s) for s in range(4)]
    ddp = model()
    state = grace.torch.ddp.register(ddp, grace.randomk(0.1))
    for s in range(2):
        backward(ddp, s)
    saved = state.state_dict()
    ddp = model(cap_mb=25)
    state = grace.torch.ddp.register(ddp, grace.randomk(0.1))
    state.load_state_dict(saved)
    for s in (2, 3):
        got = backward(ddp, s)
        for name in got:
            torch.testing.assert_close(got[name], straight[s][name], rtol=0, atol=0)
    print("ok", len(saved["memory"]))
    """)
    assert out.split() == ["ok", "12"]


@pytest.mark.parametrize("method", ["grace.topk(0.05)", "grace.powersgd(1)", "grace.signum(0.5)"])
def test_a_pickled_state_round_trips_as_pytorchs_hook_states_do(method, tmp_path):
    """torch.save(state) after 2 steps, torch.load(..., weights_only=False), bound to a new DDP
    model (another bucket size) with register(model, state): steps 3 and 4 equal those of the run
    that never stopped. Unbound, the loaded state says what to do instead of exchanging."""
    out = run(f"""
    path = {str(tmp_path / "state.pt")!r}
    ddp = model()
    grace.torch.ddp.register(ddp, {method})
    straight = [backward(ddp, s) for s in range(4)]
    ddp = model()
    state = grace.torch.ddp.register(ddp, {method})
    for s in range(2):
        backward(ddp, s)
    torch.save(state, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded) is grace.torch.ddp.GraceState and loaded.stats.bytes_sent == 0
    ddp = model(cap_mb=25)
    ddp.register_comm_hook(loaded, grace.torch.ddp.hook)
    try:
        backward(ddp, 2)
    except Exception as exc:
        print("unbound:", "state.attach(model)" in str(exc))
    ddp = model(cap_mb=25)
    grace.torch.ddp.register(ddp, torch.load(path, weights_only=False))
    for s in (2, 3):
        got = backward(ddp, s)
        for name in got:
            torch.testing.assert_close(got[name], straight[s][name], rtol=0, atol=0)
    print("ok")
    """)
    assert out.split() == ["unbound:", "True", "ok"]


@pytest.mark.parametrize("method", ["grace.topk(0.05)", "grace.powersgd(1)", "grace.signum(0.5)"])
def test_an_overflow_costs_one_step_and_leaves_no_trace(method):
    out = run(f"""
    import copy
    ddp = model()
    state = grace.torch.ddp.register(ddp, {method})
    backward(ddp, 0)
    before = copy.deepcopy(state.state_dict())
    poisoned = backward(ddp, 1, poison=True)
    after = state.state_dict()
    assert all(not torch.isfinite(g).any() for g in poisoned.values())
    for table in ("memory", "state", "steps"):
        assert before[table].keys() == after[table].keys(), table
        for name in before[table]:
            a, b = before[table][name], after[table][name]
            for x, y in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]):
                assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), (table, name)
    print("ok", all(torch.isfinite(g).all() for g in backward(ddp, 1).values()))
    """)
    assert out.split() == ["ok", "True"]


@pytest.mark.parametrize("method", ["grace.none()", "grace.fp16()", "grace.efsignsgd(0.1)", "grace.qsgd(15)",
                                    "grace.topk(0.05)"])
def test_a_flat_bucket_result_lands_in_ddp_buffer(method):
    """On an accelerator (forced here) a bucket is exchanged as one flat tensor, whose result
    is written into DDP's bucket buffer in one copy: the gradients equal the per-tensor
    exchange's, an overflow's NaN reaches every gradient, and the next step is clean."""
    out = run(f"""
    from grace.backends.torch_backend import TorchBackend
    TorchBackend.on_accelerator = lambda self, x: True
    ddp = model()
    state = grace.torch.ddp.register(ddp, {method})
    ref = grace.Exchange({method[:-1]}{", " if method[-2] != "(" else ""}bucket_mb=0), LocalCommunicator())
    for step in range(3):
        got = backward(ddp, step)
        want = ref.exchange(local_gradients(ddp, step))
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"step {{step}} {{name}}")
    whole = sum(plan.flat_memory for plan in state.exchange.bucket_plans().values())
    poisoned = backward(ddp, 3, poison=True)
    print(whole, all(not torch.isfinite(g).any() for g in poisoned.values()),
          all(torch.isfinite(g).all() for g in backward(ddp, 3).values()))
    """)
    whole, nan, clean = out.split()
    assert int(whole) >= 2 and nan == "True" and clean == "True", out
