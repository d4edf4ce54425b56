"""vLLM v0's sequence data model behaves as seed 004 describes it."""
import pytest

from framework.execution.preparers.sequence import (Sequence, SequenceData, SequenceGroup, SequenceGroupMetadata,
                                          SequenceStage, SequenceStatus)
from framework.common.sampling_params import SamplingParams


def test_stage_moves_to_decode_when_every_known_token_is_computed():
    data = SequenceData([11, 12, 13, 14, 15])
    assert data.stage is SequenceStage.PREFILL and data.get_num_uncomputed_tokens() == 5
    data.update_num_computed_tokens(3)  # a chunk
    assert data.stage is SequenceStage.PREFILL and data.get_num_uncomputed_tokens() == 2
    data.update_num_computed_tokens(2)
    assert data.stage is SequenceStage.DECODE and data.get_num_uncomputed_tokens() == 0
    data.append_token_id(99)  # the sampled token is the next step's single input
    assert data.stage is SequenceStage.DECODE and data.get_num_uncomputed_tokens() == 1
    assert data.get_token_ids() == [11, 12, 13, 14, 15, 99] and data.output_token_ids == [99]
    assert data.get_last_token_id() == 99 and data.get_len() == 6 and data.get_output_len() == 1


def test_recompute_reset_prefills_prompt_and_outputs():
    data = SequenceData([1, 2, 3], [4, 5])
    data.update_num_computed_tokens(5)
    assert data.stage is SequenceStage.DECODE
    data.reset_state_for_recompute()
    assert data.stage is SequenceStage.PREFILL and data.get_num_uncomputed_tokens() == 5
    with pytest.raises(ValueError, match="computed tokens"):
        data.update_num_computed_tokens(6)


def test_prefix_token_ids_split_prompt_and_output():
    data = SequenceData([1, 2, 3], [4, 5])
    assert data.get_prefix_token_ids(2) == ((1, 2), None)
    assert data.get_prefix_token_ids(3) == ((1, 2, 3), None)
    assert data.get_prefix_token_ids(4) == ((1, 2, 3), (4,))


def test_logical_blocks_follow_the_tokens():
    seq = Sequence(0, [1, 2, 3, 4, 5], block_size=2)
    assert seq.status == SequenceStatus.WAITING and seq.is_prefill()
    blocks = seq.logical_token_blocks
    assert [b.token_ids for b in blocks] == [[1, 2], [3, 4], [5]]
    assert [b.block_number for b in blocks] == [0, 1, 2]
    assert blocks[-1].get_num_empty_slots() == 1 and not blocks[-1].is_full() and blocks[0].is_full()
    seq.append_token_id(6)
    assert seq.n_blocks == 3 and seq.logical_token_blocks[-1].is_full()
    seq.append_token_id(7)
    assert seq.n_blocks == 4 and seq.logical_token_blocks[-1].token_ids == [7]


def test_fork_copies_everything_but_the_id():
    seq = Sequence(0, [1, 2, 3], block_size=2)
    seq.data.update_num_computed_tokens(3)
    child = seq.fork(7)
    child.append_token_id(42)
    assert child.seq_id == 7 and child.get_token_ids() == [1, 2, 3, 42]
    assert seq.get_token_ids() == [1, 2, 3], "the fork shares no state with its parent"
    assert child.data.stage is SequenceStage.DECODE


def test_max_num_running_seqs_is_n_until_forked_then_the_unfinished():
    leader = Sequence(0, [1, 2, 3], block_size=2)
    group = SequenceGroup("r", [leader], SamplingParams(n=4))
    assert group.get_max_num_running_seqs() == 4 and group.is_prefill()
    leader.data.update_num_computed_tokens(3)
    for i in range(1, 4):
        group.add(leader.fork(i))
    assert group.num_seqs() == 4 and group.get_max_num_running_seqs() == 4 and not group.is_prefill()
    group.seqs_dict[2].status = SequenceStatus.FINISHED_STOPPED
    assert group.get_max_num_running_seqs() == 3 and group.num_unfinished_seqs() == 3
    assert group.num_seqs(SequenceStatus.FINISHED_STOPPED) == 1 and not group.is_finished()
    del group.seqs_dict[2]  # as the v0 preparer drops a finished sequence
    assert group.get_max_num_running_seqs() == 3
    with pytest.raises(ValueError, match="already in group"):
        group.add(group.seqs_dict[1])
    single = SequenceGroup("s", [Sequence(9, [1], 2)], SamplingParams(n=1))
    assert single.get_max_num_running_seqs() == 1


def test_metadata_default_chunk_is_the_prompt_or_one_token():
    data = SequenceData([1, 2, 3, 4])
    prompt = SequenceGroupMetadata("r", True, {0: data}, SamplingParams(), {0: [5, 6]})
    assert prompt.token_chunk_size == 4 and prompt.do_sample and prompt.computed_block_nums == []
    decode = SequenceGroupMetadata("r", False, {0: data}, SamplingParams(), {0: [5, 6]})
    assert decode.token_chunk_size == 1


def test_statuses_and_finish_reasons_are_v0s():
    assert SequenceStatus.FINISHED_IGNORED.finish_reason == "length"
    assert SequenceStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert SequenceStatus.FINISHED_STOPPED.is_finished and not SequenceStatus.SWAPPED.is_finished
