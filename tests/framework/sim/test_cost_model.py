"""A step's BatchShape as the simulator reads it off the scheduler's output."""
from framework import SamplingParams
from framework.common.request import Request
from framework.scheduling.output import SchedulerOutput
from framework.sim.cost_model import BatchShape


def request(rid, prompt_len, computed):
    r = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(n=3), 0.0)
    r.num_computed_tokens = computed
    return r


def test_a_v0_leader_finishing_its_prompt_samples_a_logits_row_for_each_of_its_forks():
    chunk, leader, decode = request("chunk", 40, 0), request("leader", 40, 32), request("decode", 10, 9)
    leader.forks = [request("leader#1", 40, 32), request("leader#2", 40, 32)]
    chunk.forks = [request("chunk#1", 40, 0)]  # samples nothing yet: neither do its forks
    out = SchedulerOutput(scheduled=[chunk, leader, decode],
                          num_scheduled_tokens={"chunk": 16, "leader": 8, "decode": 1})
    sampling = []
    shape = BatchShape.from_scheduler_output(out, sampling)
    assert (shape.num_seqs, shape.num_tokens, shape.num_sampled) == (3, 25, 4)
    assert (shape.num_prefill_seqs, shape.prefill_tokens, shape.num_decode_seqs, shape.decode_context) == (2, 24, 1, 10)
    assert shape.prefill_pairs == 16 * 17 // 2 + 8 * 32 + 8 * 9 // 2
    assert sampling == [leader, decode]
