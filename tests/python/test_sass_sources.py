"""scripts/sass_sources.py: how it reads sources and nvdisasm's listing (no nvdisasm needed)."""
import importlib.util
import os
import pathlib
import subprocess
import sys

_path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sass_sources.py"
_spec = importlib.util.spec_from_file_location("sass_sources", _path)
sass_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_sources)

SOURCE = """struct Cta {
  __device__ static float pick(const float (&v)[4], int j) {
    return v[j & 3];
  }
  template <int kN>
  __device__ __forceinline__ void store(float* out) const {
    out[0] = pick(v, kN);
  }
};
template <int kRows>
__global__ void __launch_bounds__(Config<kRows>::kThreads, 1)
    decode_kernel(const Params p) {
  Cta cta;
  cta.store<2>(p.out);
}
"""


def test_names_device_and_global_function_heads():
    assert sass_sources.function_heads(SOURCE) == [(2, "pick"), (6, "store"), (11, "decode_kernel")]


def _listing(src):
    inl = '        //## File "%s", line %%d inlined at "%s", line %%d' % (src, src)
    top = '        //## File "%s", line %%d' % src
    return "\n".join([
        ".text._Z1kv:",
        top % 13,
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   S2R R0, SR_TID.X ;",
        inl % (3, 7),
        inl % (7, 14),
        top % 14,
        "        /*0020*/                   LDS R2, [R0] ;",
        '        //## File "/no/such/header.h", line 9 inlined at "%s", line 7' % src,
        inl % (7, 14),
        top % 14,
        "        /*0030*/                   FMUL R2, R2, R3 ;",
        inl % (7, 14),
        top % 14,
        "        /*0040*/                   STG.E [R4.64], R2 ;",
        "        /*0050*/                   EXIT ;",
        ".text._Z5otherv:",
        top % 13,
        "        /*0000*/                   EXIT ;",
    ])


def test_counts_instructions_per_inlined_chain(tmp_path):
    src = tmp_path / "kernel.cuh"
    src.write_text(SOURCE)
    counts, spans = sass_sources.attribute(_listing(src), sass_sources.Namer(),
                                           lambda k: k == "_Z1kv")
    assert list(counts) == ["_Z1kv"]
    chains = counts["_Z1kv"]
    assert chains[("decode_kernel",)] == 2
    assert chains[("decode_kernel", "store", "pick")] == 1
    assert chains[("decode_kernel", "store", "header.h")] == 1
    # an instruction without its own line record keeps the chain before it
    assert chains[("decode_kernel", "store")] == 2
    assert spans["_Z1kv"][("decode_kernel", "store")] == (0x40, 0x50)


def test_cut_merges_chains_and_their_spans(tmp_path):
    src = tmp_path / "kernel.cuh"
    src.write_text(SOURCE)
    counts, spans = sass_sources.attribute(_listing(src), sass_sources.Namer())
    cut, ranges = sass_sources.cut(counts["_Z1kv"], spans["_Z1kv"], 2)
    assert cut == {("decode_kernel",): 2, ("decode_kernel", "store"): 4}
    assert ranges[("decode_kernel", "store")] == (0x20, 0x50)


def _run(args):
    return subprocess.run([sys.executable, str(_path), *args], capture_output=True, text=True)


def test_a_bad_kernel_regex_is_a_clear_error(tmp_path):
    run = _run([str(tmp_path), "-k", "(unclosed"])
    assert run.returncode != 0
    assert "-k expects a regular expression, got '(unclosed'" in run.stderr


def test_an_unreadable_object_is_a_clear_error(tmp_path):
    missing = tmp_path / "missing.cubin"
    run = _run([str(missing)])
    assert run.returncode != 0
    assert "cannot read %s" % missing in run.stderr


def test_bad_depth_or_top_is_a_clear_error(tmp_path):
    for flags in (["--depth", "-1"], ["--top", "0"]):
        run = _run([str(tmp_path / "x.cubin"), *flags])
        assert run.returncode != 0
        assert "--depth expects N >= 0 and --top N >= 1" in run.stderr


def test_a_missing_tool_names_the_ways_to_supply_it(tmp_path):
    obj = tmp_path / "host_only.o"
    obj.write_bytes(b"not a cubin")
    # -S: no site packages, so no triton wheel to fall back on; an empty PATH finds no cuobjdump.
    env = dict(os.environ, CUOBJDUMP="", PATH=str(tmp_path))
    run = subprocess.run([sys.executable, "-S", str(_path), str(obj)], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "sass_sources: cuobjdump not found (set CUOBJDUMP or pip install triton)" in run.stderr
