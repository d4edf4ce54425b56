import pytest

from framework.sim.cost_model import COST_MODELS, BatchShape
from framework.sim.hardware import load_hardware
from models.config import ModelConfig
from models.presets import PRESETS

CFG = ModelConfig.from_hf(PRESETS["tiny-llama"])


def replay(**kw):
    return COST_MODELS.create("replay", CFG, load_hardware("cpu"), 4, **kw)


def test_replays_durations_in_step_order_whatever_the_shape():
    m = replay(durations=[0.5, 0.25, 0.125])
    assert [m.step_time(BatchShape(num_seqs=9)), m.decode_step_time(3, 10), m.step_time(BatchShape())] == [0.5, 0.25, 0.125]
    with pytest.raises(RuntimeError, match="3 recorded steps and step 4"):
        m.step_time(BatchShape())


def test_reads_a_plain_list_or_a_steps_csv(tmp_path):
    plain = tmp_path / "d.txt"
    plain.write_text("0.1\n0.2\n\n")
    assert replay(file=str(plain)).durations == [0.1, 0.2]
    steps = tmp_path / "steps.csv"
    steps.write_text("step,start_time,duration\n2,0.3,0.4\n1,0.0,0.3\n")
    assert replay(file=str(steps)).durations == [0.3, 0.4]  # in step order


def test_reads_one_replica_of_a_cluster_runs_steps_csv(tmp_path):
    steps = tmp_path / "steps.csv"
    steps.write_text("replica,step,duration\n0,1,0.1\n0,2,0.2\n1,1,0.5\n1,2,0.6\n0,3,0.3\n1,3,0.7\n")
    assert replay(file=str(steps), replica=0).durations == [0.1, 0.2, 0.3]
    # Rows sorted otherwise (by time, say) are replayed in their step order.
    shuffled = tmp_path / "shuffled.csv"
    shuffled.write_text("replica,step,duration\n0,10,1.0\n0,9,0.9\n0,2,0.2\n")
    assert replay(file=str(shuffled), replica=0).durations == [0.2, 0.9, 1.0]
    assert replay(file=str(steps), replica=1).durations == [0.5, 0.6, 0.7]
    with pytest.raises(ValueError, match=r"replicas \[0, 1\]: pick one with replica=N"):
        replay(file=str(steps))
    with pytest.raises(ValueError, match="no steps of replica 2"):
        replay(file=str(steps), replica=2)


@pytest.mark.parametrize("kw, match", [({}, "exactly one of"), ({"durations": [1], "file": "x"}, "exactly one of"),
                                       ({"durations": [-1.0]}, ">= 0"), ({"file": "/no/such"}, "does not exist")])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        replay(**kw)


@pytest.mark.parametrize("bad", ["nan", "inf", "abc", ""])
def test_durations_must_be_finite_numbers(tmp_path, bad):
    # A NaN duration would make the virtual clock, and every latency after it, NaN.
    with pytest.raises(ValueError, match=r"finite numbers >= 0 seconds; durations has .* at step 2"):
        replay(durations=[0.1, bad])
    steps = tmp_path / "steps.csv"
    steps.write_text(f"step,start_time,duration\n1,0.0,0.3\n2,0.3,{bad}\n")
    with pytest.raises(ValueError, match=rf"{steps.name} has .* at step 2"):
        replay(file=str(steps))
    if bad:  # a blank line of a plain list is skipped
        plain = tmp_path / "d.txt"
        plain.write_text(f"0.1\n{bad}\n")
        with pytest.raises(ValueError, match="d.txt has .* at step 2"):
            replay(file=str(plain))
