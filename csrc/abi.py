"""The C ABI written once: grace/native/_abi.py generated from csrc/include/grace_native.h.

    python csrc/abi.py            # (re)write grace/native/_abi.py from the header
    python csrc/abi.py --check    # exit 1 where grace/native/_abi.py is out of date

The header is the one description of the native functions. This reads its GRACE_NATIVE_ABI and
its prototypes (``ret grace_<cpu|cuda>_<name>(type a, type* b, ...);``, over several lines if
need be, comments anywhere) and writes, for ctypes, each library's functions as
``name -> (restype, argtypes)`` in the header's order: ``CPU`` (grace_cpu_*), ``CUDA``
(grace_cuda_*, argtypes as declared, the caller's trailing ``void* stream`` included) and
``CUDA_STREAM``, the CUDA functions whose last argument is that stream. Types: any pointer is
c_void_p (a returned ``const char*`` is c_char_p: a string), ``void`` returns None, and the
scalars map as in ``SCALARS``; any other type is an error, not a guess.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "include" / "grace_native.h"
OUTPUT = ROOT / "grace" / "native" / "_abi.py"
KINDS = ("cpu", "cuda")
BANNER = ("# Generated from csrc/include/grace_native.h by `python csrc/abi.py`: do not edit "
          "(change the header, rerun it).")
WIDTH = 120  # the house's line length, which the generated module keeps too

# C scalar type -> the alias the generated module gives its ctypes type
SCALARS = {"int": "_I", "int64_t": "_L", "uint32_t": "_U", "float": "_F", "double": "_D"}
ALIASES = (("_P", "c_void_p", "any pointer"), ("_S", "c_char_p", "a returned const char*: a string"),
           ("_I", "c_int", "int"), ("_L", "c_int64", "int64_t"), ("_U", "c_uint32", "uint32_t"),
           ("_F", "c_float", "float"), ("_D", "c_double", "double"))

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_ABI = re.compile(r"^\s*#\s*define\s+GRACE_NATIVE_ABI\s+(\d+)\s*$", re.M)
_NAME = re.compile(r"\bgrace_(cpu|cuda)_(\w+)\s*\(")
_PROTOTYPE = re.compile(r"(?P<ret>[A-Za-z_][\w\s*]*?)\s*\bgrace_(?P<kind>cpu|cuda)_(?P<name>\w+)\s*"
                        r"\((?P<params>[^()]*)\)\s*;")
_PARAM = re.compile(r"^(?P<type>[\w\s*]*?[\w*])\s*\b(?P<name>[A-Za-z_]\w*)$")


class HeaderError(ValueError):
    """The header holds something this generator does not read (it says what, and where)."""


def _ctype(ctype: str, where: str, returned: bool = False) -> str:
    """The alias of C type ``ctype`` (whitespace normalized), e.g. 'const float*' -> '_P'."""
    if "*" in ctype:
        return "_S" if returned and ctype.replace(" ", "") == "constchar*" else "_P"
    scalar = " ".join(word for word in ctype.split() if word != "const")
    if returned and scalar == "void":
        return "None"
    if scalar not in SCALARS:
        raise HeaderError(f"{where}: C type {ctype!r} has no ctypes mapping in csrc/abi.py (SCALARS)")
    return SCALARS[scalar]


def _params(params: str, where: str):
    """[(alias, name)] of a parameter list; 'void' or nothing: []."""
    params = " ".join(params.split())
    if params in ("", "void"):
        return []
    out = []
    for param in params.split(","):
        match = _PARAM.match(param.strip())
        if match is None:
            raise HeaderError(f"{where}: cannot read parameter {param.strip()!r} (expected 'type name')")
        out.append((_ctype(match["type"], f"{where}, parameter {match['name']}"), match["name"]))
    return out


def parse(text: str):
    """(ABI, {'cpu': {name: (restype, [(argtype, argname)])}, 'cuda': {...}}) of the header's text,
    types as the generated module's aliases; HeaderError on anything not understood."""
    abi = _ABI.search(text)
    if abi is None:
        raise HeaderError("no '#define GRACE_NATIVE_ABI <number>' in the header")
    code = _COMMENT.sub(" ", text)
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
    tables = {kind: {} for kind in KINDS}
    for match in _PROTOTYPE.finditer(code):
        kind, name = match["kind"], match["name"]
        where = f"grace_{kind}_{name}"
        if name in tables[kind]:
            raise HeaderError(f"{where} is declared twice")
        ret = _ctype(" ".join(match["ret"].split()), f"{where}, return type", returned=True)
        tables[kind][name] = (ret, _params(match["params"], where))
    declared = [f"grace_{kind}_{name}" for kind, name in _NAME.findall(code)]
    read = {f"grace_{kind}_{name}" for kind in KINDS for name in tables[kind]}
    missed = [name for name in declared if name not in read]
    if missed or len(declared) != len(read):
        raise HeaderError(f"prototypes not understood (expected 'ret grace_<cpu|cuda>_<name>(type a, ...);'): "
                          f"{', '.join(missed) or 'a name declared twice'}")
    return int(abi[1]), tables


def _wrapped(head: str, items, tail: str, indent: int):
    """``head + ', '.join(items) + tail`` in lines of at most WIDTH columns, continuation lines
    starting at column ``indent``."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else tail)
        if len(line) + len(piece.rstrip()) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = " " * indent
        line += piece
    if not items:
        line += tail
    lines.append(line)
    return lines


def _table(title: str, functions) -> list:
    lines = [f"# {title}", f"{title.split()[0]} = {{"]
    for name, (ret, params) in functions.items():
        head = f'    "{name}": ({ret}, ['
        lines += _wrapped(head, [alias for alias, _ in params], "]),", len(head))
    return lines + ["}"]


def render(abi: int, tables) -> str:
    """The text of grace/native/_abi.py for parse()'s result."""
    streamed = [name for name, (_, params) in tables["cuda"].items() if params[-1:] == [("_P", "stream")]]
    imports = ", ".join(sorted(ctype for _, ctype, _ in ALIASES))
    lines = [
        BANNER,
        '"""The C ABI of the native libraries for ctypes, as csrc/include/grace_native.h declares it.',
        "",
        "name -> (restype, argtypes) of grace_cpu_<name> (CPU) and grace_cuda_<name> (CUDA; the argtypes",
        "end with the caller's stream, a void*, for the functions in CUDA_STREAM), in the header's order.",
        '"""',
        f"from ctypes import {imports}",
        "",
        *(f"{alias} = {ctype}  # {what}" for alias, ctype, what in ALIASES),
        "",
        f"ABI = {abi}  # GRACE_NATIVE_ABI",
        "",
        *_table("CPU (grace_cpu_*)", tables["cpu"]),
        "",
        *_table("CUDA (grace_cuda_*)", tables["cuda"]),
        "",
        "# the CUDA functions whose last argument is the caller's stream (void* stream)",
        "CUDA_STREAM = frozenset({",
        *_wrapped("    ", [f'"{name}"' for name in streamed], ",", 4),
        "})",
    ]
    return "\n".join(lines) + "\n"


def generate(header: Path = HEADER) -> str:
    """The text grace/native/_abi.py should hold for ``header``."""
    return render(*parse(header.read_text()))


def _shown(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:  # (not under the repository: a test's file)
        return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where the generated module is out of date")
    args = parser.parse_args(argv)
    try:
        text = generate()
    except HeaderError as exc:
        print(f"csrc/abi.py: {_shown(HEADER)}: {exc}", file=sys.stderr)
        return 2
    current = OUTPUT.read_text() if OUTPUT.is_file() else ""
    if not args.check:
        if current != text:
            OUTPUT.write_text(text)
        print(f"{_shown(OUTPUT)}: {'written' if current != text else 'up to date'}")
        return 0
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "committed", "generated", lineterm="", n=1)
    print(f"{_shown(OUTPUT)} is out of date with {_shown(HEADER)}: "
          f"run python csrc/abi.py and commit the result", file=sys.stderr)
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
