"""The house's size rules, checked: files, functions, nesting, and the method contract.

    python scripts/code_sizes.py            # every breach, then a summary; exit 1 where any

Rules: no Python file in grace/core, grace/native, grace/torch or grace/tensorflow over 400 lines;
no function in grace/ over 60 lines or nested over 4 deep; no C++/CUDA source over 1,200 lines;
``Compressor`` and ``Memory`` each with at most 12 public methods and properties.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("grace/core", "grace/native", "grace/torch", "grace/tensorflow")
FILE_LINES, FUNCTION_LINES, NESTING, NATIVE_LINES, CONTRACT = 400, 60, 4, 1200, 12
BLOCKS = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith, ast.Match)


def _depth(node: ast.AST, level: int = 0) -> int:
    """The deepest nesting of blocks inside ``node`` (functions inside it counted apart)."""
    deepest = level
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        inner = level + 1 if isinstance(child, BLOCKS) else level
        if isinstance(child, ast.If) and isinstance(node, ast.If) and node.orelse == [child]:
            inner = level  # an elif is not a level deeper
        deepest = max(deepest, _depth(child, inner))
    return deepest


def python_breaches():
    for path in sorted((ROOT / "grace").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = text.count("\n")
        if rel.startswith(LAYERS) and lines > FILE_LINES:
            yield f"{rel}: {lines} lines (at most {FILE_LINES})"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    yield f"{rel}:{node.lineno} {node.name}: {length} lines (at most {FUNCTION_LINES})"
                depth = _depth(node)
                if depth > NESTING:
                    yield f"{rel}:{node.lineno} {node.name}: nested {depth} deep (at most {NESTING})"


def native_breaches():
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix in (".cpp", ".cu", ".h", ".cuh"):
            lines = path.read_text().count("\n")
            if lines > NATIVE_LINES:
                yield f"{path.relative_to(ROOT).as_posix()}: {lines} lines (at most {NATIVE_LINES})"


def contract_breaches():
    sys.path.insert(0, str(ROOT))
    from grace.core.compressor import Compressor
    from grace.core.memory import Memory
    for cls in (Compressor, Memory):
        public = [name for name in dir(cls) if not name.startswith("_")]
        if len(public) > CONTRACT:
            yield f"{cls.__name__}: {len(public)} public members (at most {CONTRACT}): {', '.join(public)}"


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    groups = {"python": list(python_breaches()), "native": list(native_breaches()),
              "contract": list(contract_breaches())}
    for breaches in groups.values():
        for line in breaches:
            print(line)
    print("breaches: " + ", ".join(f"{name} {len(found)}" for name, found in groups.items()))
    return 1 if any(groups.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
