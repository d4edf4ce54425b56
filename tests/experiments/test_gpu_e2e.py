"""experiments/gpu_e2e.py (run by experiments/gpu_check.sh on a GPU): its usage errors, and a dry run of
the speed comparison on a tiny model on the CPU."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_e2e.py"


def run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_without_cuda_is_a_usage_error():
    done = run("speed")
    assert done.returncode == 2 and "CUDA is not available here; use --device cpu --tiny" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_speed_dry_run_compares_each_backend_with_transformers():
    done = run("speed", "--device", "cpu", "--tiny", "--batches", "3", "--tokens", "4", "--prompt-len", "12")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("E2E")]
    assert re.match(r"E2E batch 3: hf_generate \d+ tok/s .* roofline [\d.]+ ms$", lines[0])
    for backend, line in zip(["torch_paged", "triton"], lines[1:], strict=True):
        assert re.match(rf"E2E batch 3 {backend} +graphs=False fused_ops=True +async=False matmul=torch +\d+ tok/s = "
                        rf"[\d.]+x hf_generate; "
                        rf"decode step [\d.]+ ms = \d+% of the roofline; greedy == HF for 3/3$", line), line


def test_the_profiled_dry_run_times_decode_steps_by_operator():
    """``--profile``: each case's engine steps, profiled once every request decodes (on a CPU by operator)."""
    done = run("speed", "--device", "cpu", "--tiny", "--batches", "3", "--tokens", "4", "--prompt-len", "12",
               "--cases", "default", "--profile")
    assert done.returncode == 0, done.stderr[-3000:]
    heads = [line for line in done.stdout.splitlines() if re.match(r"STEPKERNELS batch", line)]
    assert len(heads) == 2, done.stdout[-3000:]
    for line in heads:
        assert re.match(r"STEPKERNELS batch 3: 10/10 steps decoded every request; per step \d+ operators, [\d.]+ ms "
                        r"of CPU time in [\d.]+ ms \(profiled\)$", line), line
    assert "aten::mm" in done.stdout


def test_cases_picks_the_kinds_asked_for_and_refuses_others():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        from gpu_e2e import cases
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    picked = cases("cuda", ("default", "tuned"))
    assert {(c.backend, c.kind) for c in picked} >= {("triton", "default"), ("triton", "tuned"),
                                                     ("torch_paged", "default")}
    assert {c.kind for c in picked} == {"default", "tuned"}
    assert [c.matmul for c in picked if c.kind == "tuned"] == ["tuned"]
    assert {c.kind for c in cases("cuda")} == {"default", "sync", "torch-ops", "eager", "tuned", "prefetch12",
                                               "prefetch24", "prefetch48", "fuse-rotary", "fuse-rotary-prefetch24"}
    assert {(c.kind, c.prefetch_mb) for c in cases("cuda") if c.backend == "triton" and c.prefetch_mb} == {
        ("prefetch12", 12), ("prefetch24", 24), ("prefetch48", 48), ("fuse-rotary-prefetch24", 24)}
    assert {(c.backend, c.kind) for c in cases("cuda") if c.fuse_rotary} == {
        ("triton", "fuse-rotary"), ("triton", "fuse-rotary-prefetch24")}
    done = run("speed", "--device", "cpu", "--tiny", "--cases", "default,fast")
    assert done.returncode == 2 and ("--cases: unknown kind fast; choose among default,sync,torch-ops,eager,tuned,"
                                     "prefetch12,prefetch24,prefetch48,fuse-rotary,fuse-rotary-prefetch24" in done.stderr)


def test_a_parity_difference_is_judged_by_the_float32_models_logits():
    """The arbiter of a low-precision mismatch: how far a token's float32 logit falls short of the best."""
    import transformers

    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        from gpu_e2e import fp32_shortfall
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).eval()
    context = [5, 9, 13]
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].double()
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert fp32_shortfall(model, context, best, "cpu") == (0.0, best)
    short, top = fp32_shortfall(model, context, worst, "cpu")
    assert top == best and short == pytest.approx(float(logits.max() - logits.min()))


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_the_gpu_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(ROOT / "experiments" / script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_check_step_is_cut_to_the_deadline_and_skipped_past_it(tmp_path):
    """DEADLINE_S bounds the whole check, so that a device call's logs come back: the steps' own limits add up
    to more than a call may run."""
    script = ("now=$(date +%s); START=$((now - 500)); DEADLINE_S=540; . experiments/gpu_step.sh; "
              "step quick 100 echo done; step cut_off 100 false; START=$((now - 530)); step late 100 echo ran; "
              "STEPS=other step filtered 100 echo ran")
    done = subprocess.run(["bash", "-c", script], env={"LOG_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(r"== quick \((39|40) s at most\): echo done", lines[0]) and lines[1] == "   quick ok (done)"
    assert "   cut_off FAILED (status 1); last lines of" in done.stdout
    assert "== late: skipped, DEADLINE_S=540 reached" in lines and "ran" not in done.stdout
    statuses = {p.stem: p.read_text().strip() for p in tmp_path.glob("*.status")}
    assert statuses == {"quick": "0", "cut_off": "1", "late": "124"}


def test_gpu_check_without_a_gpu_says_so_and_runs_nothing(tmp_path):
    """On a machine without CUDA the check stops at once, with a non-zero status, before any step."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 1 and "no CUDA device: nothing to check here" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device.log"]
