from framework.common.outputs import CompletionOutput


def test_a_completion_is_finished_once_it_has_a_finish_reason():
    out = CompletionOutput(0, "", [1, 2])
    assert not out.finished()
    out.finish_reason = "length"
    assert out.finished()
