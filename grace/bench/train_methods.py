"""Every method on the 4-rank digits model: accuracy, bytes per step and steps per second.

    horovodrun -np 4 -H localhost:4 --gloo python scripts/train_methods.py --out results/train_methods
    torchrun --standalone --nproc-per-node 4 scripts/train_methods.py --engine ddp --out results/train_methods_ddp
    horovodrun -np 8 -H localhost:8 --gloo python scripts/train_methods.py --communicators allgather alltoall

One launch trains each method in turn (scripts/train.py, same seed and data) and rank 0
writes the table as CSV, JSON and Markdown. Methods with error feedback are expected within
3 points of uncompressed; GRACE (Xu et al. 2021, §V) reports how the others fare.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import grace
from grace.bench import train
from grace.bench.common import help_parser
from grace.core import registry

# command-line settings per method (the rest, and every setting of a method not listed, are
# train.py's defaults)
SETTINGS = {
    "none": [], "fp16": [], "u8bit": [], "onebit": [], "efsignsgd": [],
    # each step moves every weight by lr; majority-vote signSGD is best near 0.001 on digits at 4 and 8 ranks
    "signsgd": ["--lr", "0.001"], "signum": ["--lr", "0.005"],
    "qsgd": ["--levels", "127"], "natural": [], "terngrad": [], "inceptionn": [],
    "randomk": ["--ratio", "0.1"], "topk": ["--ratio", "0.01"], "threshold": ["--threshold", "0.01"],
    "dgc": ["--ratio", "0.01"], "adaq": ["--ratio", "0.01"], "sketchml": [], "powersgd": ["--rank", "1"],
}
COLUMNS = ["method", "communicator", "settings", "error_feedback", "test_accuracy", "bytes_per_step",
           "compression_ratio", "steps_per_second", "ranks_agree"]


def parse_args(argv=None):
    parser = help_parser(__doc__)
    parser.add_argument("--methods", nargs="+", default=grace.methods(), choices=grace.methods(),
                        help="the methods trained, one after another (default: every one)")
    parser.add_argument("--communicators", nargs="+", default=["default"],
                        choices=["default", "allgather", "alltoall", "auto"],
                        help="train each allgather method under each of these ('default': none named, which is "
                             "'auto'; the methods that sum their payloads always take theirs); default: default")
    parser.add_argument("--epochs", type=int, default=30, help="epochs per method")
    parser.add_argument("--engine", default="horovod", choices=["horovod", "ddp"],
                        help="Horovod's DistributedOptimizer, or DDP with grace's hook (torchrun)")
    parser.add_argument("--out", type=Path, default=Path("results/train_methods"),
                        help="where the table goes (CSV, JSON, Markdown)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rows = []
    for method in args.methods:
        settings = SETTINGS.get(method, [])
        for communicator in _communicators(method, args.communicators):
            chosen = [] if communicator == "default" else ["--communicator", communicator]
            summary = train.main(["--engine", args.engine, "--compressor", method, "--epochs", str(args.epochs),
                                  "--no-progress", *settings, *chosen])
            rows.append({"method": method, "communicator": communicator, "settings": " ".join(settings), **summary})
    if rows and summary["rank"] == 0:
        write(rows, args.out, args.epochs)
        compare(rows)
    return rows


def _communicators(method: str, asked):
    """The communicators ``method`` trains under: those asked, where it allgathers; else its own."""
    made = next(iter(registry.examples(method=method).values()))()
    if made.collective is not grace.Collective.ALLGATHER:
        return ["default"]
    return list(dict.fromkeys(asked))


def compare(rows) -> None:
    """Each method's accuracy under the two phases against uncompressed and against its allgather."""
    accuracy = {(r["method"], r["communicator"]): r["test_accuracy"] for r in rows}
    dense = accuracy.get(("none", "default"))
    for (method, communicator), value in accuracy.items():
        if communicator != "alltoall":
            continue
        allgather = accuracy.get((method, "allgather"))
        parts = [f"{method}: alltoall {value:.4f}"]
        if dense is not None:
            parts.append(f"{100 * (value - dense):+.2f} points vs uncompressed")
        if allgather is not None:
            parts.append(f"{100 * (value - allgather):+.2f} points vs allgather")
        print(", ".join(parts))


def write(rows, out: Path, epochs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "table.json").write_text(json.dumps({"grace": grace.__version__, "epochs": epochs, "runs": rows}, indent=2))
    lines = ["| method | communicator | settings | error feedback | test accuracy | bytes/step | fewer bytes "
             "| steps/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['communicator']} | {r['settings'] or '-'} | "
                     f"{'yes' if r['error_feedback'] else 'no'} | "
                     f"{r['test_accuracy']:.4f} | {r['bytes_per_step']:.0f} | {r['compression_ratio']:.1f}x | "
                     f"{r['steps_per_second']:.1f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
