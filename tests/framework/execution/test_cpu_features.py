"""framework.execution.cpu_features: the instructions this CPU offers, from its flags."""
import torch

from framework.execution.cpu_features import cpu_has_amx_bf16, cpu_has_matmul_instructions


def test_cpu_matmul_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert not cpu_has_matmul_instructions(torch.bfloat16, str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_has_matmul_instructions(torch.bfloat16, str(cpuinfo))
    assert not cpu_has_matmul_instructions(torch.float16, str(cpuinfo))
    assert cpu_has_matmul_instructions(torch.bfloat16, str(tmp_path / "missing")), "unknown: trust torch's kernel"


def test_amx_bf16_needs_both_tile_flags_and_is_refused_when_unknown(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_int8\n")
    assert not cpu_has_amx_bf16(str(cpuinfo)), "tiles without their bf16 product"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_has_amx_bf16(str(cpuinfo))
    assert not cpu_has_amx_bf16(str(tmp_path / "missing")), "unknown: an AMX kernel would die of SIGILL"
    cpuinfo.write_text("processor\t: 0\n")
    assert not cpu_has_amx_bf16(str(cpuinfo))
