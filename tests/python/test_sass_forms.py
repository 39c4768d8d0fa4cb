"""scripts/sass_forms.py: its reading of cuobjdump's SASS listing (no cuobjdump needed)."""
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

_path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sass_forms.py"
_spec = importlib.util.spec_from_file_location("sass_forms", _path)
sass_forms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_forms)

LISTING = """
        code for sm_90a
                Function : _Z1av
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
                                                                             /* 0x000fe400078e00ff */
        /*0010*/              @!P0 VIADD R2, R2, 0x1 ;
        /*0020*/                   MOV R3, R4 ;
        /*0030*/                   F2FP.F16.E4M3.UNPACK_B R5, R8 ;
        /*10a0*/                   EXIT ;
                Function : _Z1bv
        /*0000*/              @UP1 IADD3 R2, R2, 0x1, RZ ;
        /*0010*/                   SHF.L.U32 R3, R3, 0x7, RZ ;
        /*0020*/                   IMAD.SHL.U32 R4, R4, 0x80, RZ ;
"""


def test_reads_each_function_and_its_opcodes():
    found = dict(sass_forms.kernels(LISTING))
    assert list(found) == ["_Z1av", "_Z1bv"]
    assert found["_Z1av"] == ["IMAD.MOV.U32", "VIADD", "MOV", "F2FP.F16.E4M3.UNPACK_B", "EXIT"]
    assert found["_Z1bv"] == ["IADD3", "SHF.L.U32", "IMAD.SHL.U32"]


def test_counts_imad_and_alu_forms():
    found = dict(sass_forms.kernels(LISTING))
    assert sass_forms.count_forms(found["_Z1av"]) == (2, 1)
    assert sass_forms.count_forms(found["_Z1bv"]) == (1, 2)


def _run(args, tool):
    env = dict(os.environ, CUOBJDUMP=tool)
    return subprocess.run([sys.executable, str(_path), *args], env=env, capture_output=True,
                          text=True)


def test_a_file_cuobjdump_cannot_read_is_a_clear_error(tmp_path):
    obj = tmp_path / "not_cuda.txt"
    obj.write_text("text")
    run = _run([str(obj)], shutil.which("false"))
    assert run.returncode != 0
    assert "cuobjdump -sass %s failed" % obj in run.stderr


def test_a_bad_kernel_regex_is_a_clear_error(tmp_path):
    run = _run([str(tmp_path), "-k", "(unclosed"], shutil.which("true"))
    assert run.returncode != 0
    assert "-k expects a regular expression, got '(unclosed'" in run.stderr


def test_a_missing_tool_names_the_ways_to_supply_it(tmp_path):
    # -S: no site packages, so no triton wheel to fall back on; an empty PATH finds no cuobjdump.
    env = dict(os.environ, CUOBJDUMP="", PATH=str(tmp_path))
    run = subprocess.run([sys.executable, "-S", str(_path), str(tmp_path)], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "sass_forms: cuobjdump not found (set CUOBJDUMP or pip install triton)" in run.stderr
