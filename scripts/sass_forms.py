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


def find_cuobjdump():
    path = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if path:
        return path
    try:
        import triton  # its wheel ships cuobjdump
    except ImportError:
        sys.exit("sass_forms: cuobjdump not found (set CUOBJDUMP or pip install triton)")
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


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
    try:
        re.compile(args.kernel)
    except re.error as e:
        sys.exit("sass_forms: -k expects a regular expression, got %r (%s)" % (args.kernel, e))
    tool = find_cuobjdump()
    print("%8s %6s %6s  %s" % ("instrs", "imad", "alu", "kernel"))
    for obj in args.objects:
        run = subprocess.run([tool, "-sass", obj], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit("sass_forms: cuobjdump -sass %s failed: %s" % (obj, run.stderr.strip()))
        sass = run.stdout
        found = list(kernels(sass))
        for (mangled, ops), name in zip(found, demangle([name for name, _ in found])):
            if not (re.search(args.kernel, mangled) or re.search(args.kernel, name)):
                continue
            imad, alu = count_forms(ops)
            print("%8d %6d %6d  %s" % (len(ops), imad, alu, name))


if __name__ == "__main__":
    main()
