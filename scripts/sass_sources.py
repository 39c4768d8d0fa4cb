#!/usr/bin/env python3
"""Where a kernel's SASS instructions come from: counts per chain of inlined source functions.

Code size costs the Hopper kernels time (sm90_notes.md, probe 172g and variant 173): this shows
which source functions a kernel's instructions belong to, the outermost caller first, e.g.
`sm90_decode_kernel > consumer_pv > epilogue > store_rows` with its instruction count and the
address range it spans.

  python3 scripts/sass_sources.py OBJECT [-k REGEX] [--depth N] [--top N]

OBJECT: a cubin, or an object file or executable with device code, built with -lineinfo (the
CMake build adds it). Needs nvdisasm, and cuobjdump for objects that are not cubins (on PATH, in
$NVDISASM / $CUOBJDUMP, or from `pip install triton`). Functions are named from the `__device__`
and `__global__` heads of the source files the line table names; lines of files that cannot be
read count under the file's name.
"""
import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_forms import find_tool, kernel_pattern  # noqa: E402

EM_CUDA = 190  # ELF e_machine of a cubin
HEAD = re.compile(r"(?:__device__|__global__)\s[^;{]*?\b((?!__launch_bounds__\b)\w+)\s*\(")
FRAME = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+\S")
SECTION = re.compile(r"^\.text\.(\S+):")


def function_heads(source):
    """[(line, name)] of the __device__ / __global__ functions defined in the source text."""
    return [(source.count("\n", 0, m.start()) + 1, m.group(1)) for m in HEAD.finditer(source)]


class Namer:
    """Names a (file, line) after the function around it; files it cannot read by their name."""

    def __init__(self):
        self.heads = {}

    def __call__(self, path, line):
        if path not in self.heads:
            try:
                with open(path) as f:
                    self.heads[path] = function_heads(f.read())
            except OSError:
                self.heads[path] = []
        name = os.path.basename(path)
        for head_line, head in self.heads[path]:
            if head_line > line:
                break
            name = head
        return name


def attribute(listing, name_of, kernel_filter=lambda name: True):
    """{kernel: Counter({chain: count})} and {kernel: {chain: (low, high address)}} from
    `nvdisasm -gi` output; a chain is the tuple of function names, outermost first."""
    counts, spans = {}, {}
    kernel, frames, chain = None, [], ()
    for line in listing.splitlines():
        m = SECTION.match(line)
        if m:
            kernel = m.group(1) if kernel_filter(m.group(1)) else None
            frames, chain = [], ()
            if kernel:
                counts.setdefault(kernel, collections.Counter())
                spans.setdefault(kernel, {})
            continue
        if kernel is None:
            continue
        m = FRAME.match(line)
        if m:
            frames.append(name_of(m.group(1), int(m.group(2))))
            continue
        m = INSTRUCTION.match(line)
        if m:
            if frames:  # innermost frame first in the listing
                chain = tuple(dict.fromkeys(reversed(frames)))
                frames = []
            address = int(m.group(1), 16)
            counts[kernel][chain] += 1
            low, high = spans[kernel].get(chain, (address, address))
            spans[kernel][chain] = (min(low, address), max(high, address))
    return counts, spans


def cut(chains, spans, depth):
    """The counts and address spans with every chain cut after `depth` functions."""
    counts, ranges = collections.Counter(), {}
    for chain, n in chains.items():
        key = chain[:depth]
        counts[key] += n
        low, high = spans[chain]
        old = ranges.get(key, (low, high))
        ranges[key] = (min(old[0], low), max(old[1], high))
    return counts, ranges


def cubins(obj, workdir):
    """OBJECT itself if it is a cubin, else the cubins cuobjdump extracts from it."""
    try:
        with open(obj, "rb") as f:
            head = f.read(20)
    except OSError as e:
        sys.exit("sass_sources: cannot read %s (%s)" % (obj, e.strerror))
    if head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == EM_CUDA:
        return [obj]
    run = subprocess.run([find_tool("cuobjdump", "CUOBJDUMP", "sass_sources"), "-xelf", "all",
                          os.path.abspath(obj)], cwd=workdir, capture_output=True, text=True)
    found = sorted(glob.glob(os.path.join(workdir, "*.cubin")))
    if run.returncode != 0 or not found:
        sys.exit("sass_sources: no device code in %s (%s)" % (obj, run.stderr.strip() or
                                                              "cuobjdump found no cubin"))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("object")
    ap.add_argument("-k", "--kernel", default="", help="only kernels whose mangled name matches")
    ap.add_argument("--depth", type=int, default=0,
                    help="cut chains after N functions (0: whole chains)")
    ap.add_argument("--top", type=int, default=30, help="chains listed a kernel (default 30)")
    args = ap.parse_args()
    pattern = kernel_pattern(args.kernel, "sass_sources")
    if args.depth < 0 or args.top < 1:
        sys.exit("sass_sources: --depth expects N >= 0 and --top N >= 1, got %d and %d" %
                 (args.depth, args.top))
    with tempfile.TemporaryDirectory() as workdir:
        found = cubins(args.object, workdir)
        nvdisasm = find_tool("nvdisasm", "NVDISASM", "sass_sources")
        for cubin in found:
            run = subprocess.run([nvdisasm, "-gi", cubin], capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit("sass_sources: nvdisasm -gi %s failed: %s" % (cubin, run.stderr.strip()))
            counts, spans = attribute(run.stdout, Namer(), lambda k: pattern.search(k))
            for kernel, chains in counts.items():
                ranges = spans[kernel]
                if args.depth:
                    chains, ranges = cut(chains, ranges, args.depth)
                total = sum(chains.values())
                print("%s: %d instructions" % (kernel, total))
                for chain, n in chains.most_common(args.top):
                    low, high = ranges[chain]
                    print("%8d %5.1f%%  %6x-%6x  %s" % (n, 100.0 * n / total, low, high,
                                                     " > ".join(chain) or "(no line info)"))


if __name__ == "__main__":
    main()
