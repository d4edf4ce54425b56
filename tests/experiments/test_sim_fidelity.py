"""The fidelity script's noise floor: how closely steps of one shape agree with each other."""
import importlib.util
from pathlib import Path

import pytest

from framework.cost_model import BatchShape

spec = importlib.util.spec_from_file_location(
    "sim_fidelity", Path(__file__).resolve().parents[2] / "experiments" / "sim_fidelity.py")
sim_fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_fidelity)


def decode_shape(num_reqs: int, context: int) -> BatchShape:
    shape = BatchShape()
    for _ in range(num_reqs):
        shape.add_row(context, 1, True)
    return shape


def test_noise_floor_is_the_spread_within_shape_groups():
    # Group A (1 decode at ~100 tokens): times 1.0, 1.1, 0.9, 1.2, 1.0 around median 1.0;
    # group B (3 decodes): 2.0 x 5, no spread; a context 16 tokens away is another group.
    steps = [(decode_shape(1, 100 + i), t) for i, t in enumerate([1.0, 1.1, 0.9, 1.2, 1.0])]
    steps += [(decode_shape(3, 200), 2.0)] * 5
    steps += [(decode_shape(1, 140), 5.0)] * 4          # a group of 4: too small to count
    # Deviations: A -> 0, .1, .1, .2, 0 ; B -> 0 x 5: median of ten values is 0.
    assert sim_fidelity.noise_floor(steps) == 0.0
    steps += [(decode_shape(1, 104), 1.3), (decode_shape(1, 105), 1.3)]
    # A's median is now 1.1 (1.0,1.1,0.9,1.2,1.0,1.3,1.3); 12 deviations, six of them 0 (B) ...
    floor = sim_fidelity.noise_floor(steps)
    devs = sorted([abs(t / 1.1 - 1) for t in [1.0, 1.1, 0.9, 1.2, 1.0, 1.3, 1.3]] + [0.0] * 5)
    assert floor == pytest.approx((devs[5] + devs[6]) / 2)
    assert floor > 0


def test_noise_floor_without_large_groups_is_none():
    assert sim_fidelity.noise_floor([(decode_shape(1, 10), 1.0)] * 4) is None


@pytest.mark.parametrize("argv, message", [
    (["--calibration", "no-such-calibration.yaml"], "calibration file 'no-such-calibration.yaml' does not exist"),
    (["--model", "tiny-lama"], "model 'tiny-lama' is neither a preset"),
])
def test_a_bad_model_or_calibration_is_a_usage_error_before_any_real_run(argv, message, monkeypatch, capsys):
    """Either used to fail with a traceback, the calibration only after a real run of ~20 s."""
    monkeypatch.setattr(sim_fidelity, "serve", lambda *a, **k: pytest.fail("served"))
    monkeypatch.setattr(sim_fidelity, "real_run_with_calibration", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("sys.argv", ["sim_fidelity.py", "--repeats", "1", *argv])
    with pytest.raises(SystemExit) as exit_:
        sim_fidelity.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


class SteppedModel:
    """A model whose passes take 3, 1 and 2 (fake) seconds in turn."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.costs, self.calls = clock, [3.0, 1.0, 2.0], 0

    def __call__(self, x):
        self.clock[0] += self.costs[self.calls % 3]
        self.calls += 1
        return x * 2

    def compute_logits(self, h):
        return h + 1


def test_repeated_forward_times_every_pass_and_hides_all_but_the_median(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(sim_fidelity.time, "process_time", lambda: now[0])
    paused = []

    class Clock:
        def pause(self):
            paused.append(now[0])

        def resume(self):
            paused.append(now[0])

    model = SteppedModel(now)
    forward = sim_fidelity.RepeatedForward(model, 3, Clock())
    assert forward(5) == 10 and model.calls == 3
    assert forward.last == [3.0, 1.0, 2.0]
    assert paused == [3.0, 6.0]  # the clock misses the two repeats, not the first pass
    assert forward.hidden == 6.0 - 2.0  # a timer minus hidden sees one pass of the median, 2 s
    assert forward.compute_logits(1) == 2  # everything else goes to the model
    single = sim_fidelity.RepeatedForward(SteppedModel(now), 1)
    single(1)
    assert single.last == [3.0] and single.hidden == 0.0


def test_repeating_forward_passes_changes_no_output():
    """Re-running a pass rewrites the same K/V to the same slots: the tokens must not change."""
    from framework.engine import LLMEngine
    from framework.sampling_params import SamplingParams

    def run(times: int):
        engine = LLMEngine(sim_fidelity.engine_config("model"))
        forward = sim_fidelity.RepeatedForward.install(engine, times)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, n in enumerate([40, 17, 40]):  # the third shares the first's prompt: a prefix hit
            engine.add_request(str(i), list(range(3, 3 + n)), params)
        out, passes = {}, []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
            passes.append(len(forward.last))
        return out, passes

    once, passes_once = run(1)
    thrice, passes_thrice = run(3)
    assert thrice == once and len(once) == 3
    assert set(passes_once) == {1} and set(passes_thrice) == {3}


@pytest.mark.parametrize("argv, message", [
    (["--timings", "0"], "--timings must be at least 1"),
    (["--timings", "3", "--clock", "wall"], "--timings > 1 needs --clock cpu"),
])
def test_bad_timings_are_usage_errors(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sim_fidelity, "real_run_with_calibration", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("sys.argv", ["sim_fidelity.py", "--repeats", "1", *argv])
    with pytest.raises(SystemExit) as exit_:
        sim_fidelity.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
