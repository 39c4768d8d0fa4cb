#!/usr/bin/env python3
"""Per kernel of a CUDA object: SASS instructions, and how ptxas wrote its moves, adds and shifts.

ptxas writes a register move, an integer add or a left shift either in an IMAD form (FMA pipe:
IMAD.MOV, IMAD.IADD, IMAD.SHL, ...) or in an ALU form (MOV, IADD3, SHF.L), and chooses for the
kernel as a whole: code that never runs can flip the choice in the hot loops (sm90_notes.md, probe
172). Compare these counts before reading a variant's timing as its own cost.

  python3 scripts/sass_forms.py OBJECT... [-k REGEX]

OBJECT: a cubin, object file or executable with device code. Needs cuobjdump (on PATH, in
$CUOBJDUMP, or from `pip install triton`).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

# VIADD counts with the IMAD forms: ptxas trades it for IADD3 as it trades IMAD.IADD.
IMAD_FORMS = {"IMAD.MOV", "IMAD.MOV.U32", "IMAD.U32", "IMAD.SHL.U32", "IMAD.IADD", "VIADD"}
ALU_FORMS = {"MOV", "IADD3", "SHF.L.U32"}


def find_tool(name, env, caller):
    """The path of a CUDA binary tool: $env, else PATH, else the one in the triton wheel."""
    path = os.environ.get(env) or shutil.which(name)
    if path:
        return path
    try:
        import triton  # its wheel ships cuobjdump and nvdisasm
    except ImportError:
        sys.exit("%s: %s not found (set %s or pip install triton)" % (caller, name, env))
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def kernel_pattern(text, caller):
    """The -k argument compiled, or a clear error."""
    try:
        return re.compile(text)
    except re.error as e:
        sys.exit("%s: -k expects a regular expression, got %r (%s)" % (caller, text, e))


def kernels(sass):
    """(name, [opcode, ...]) for each function of cuobjdump -sass output."""
    name, ops = None, []
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            if name:
                yield name, ops
            name, ops = m.group(1), []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if name and m:
            ops.append(m.group(1))
    if name:
        yield name, ops


def count_forms(ops):
    """(IMAD forms, ALU forms) among the opcodes."""
    return sum(op in IMAD_FORMS for op in ops), sum(op in ALU_FORMS for op in ops)


def demangle(names):
    """The names through c++filt where it exists, else as they are."""
    tool = shutil.which("c++filt")
    if not tool or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines() if len(out.splitlines()) == len(names) else names


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("objects", nargs="+")
    ap.add_argument("-k", "--kernel", default="",
                    help="only kernels whose name (mangled or not) matches REGEX")
    args = ap.parse_args()
    pattern = kernel_pattern(args.kernel, "sass_forms")
    tool = find_tool("cuobjdump", "CUOBJDUMP", "sass_forms")
    print("%8s %6s %6s  %s" % ("instrs", "imad", "alu", "kernel"))
    for obj in args.objects:
        run = subprocess.run([tool, "-sass", obj], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit("sass_forms: cuobjdump -sass %s failed: %s" % (obj, run.stderr.strip()))
        sass = run.stdout
        found = list(kernels(sass))
        for (mangled, ops), name in zip(found, demangle([name for name, _ in found])):
            if not (pattern.search(mangled) or pattern.search(name)):
                continue
            imad, alu = count_forms(ops)
            print("%8d %6d %6d  %s" % (len(ops), imad, alu, name))


if __name__ == "__main__":
    main()
