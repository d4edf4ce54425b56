import numpy as np
import pytest

from framework.engine.prompts import token_ids, tokenize


@pytest.mark.parametrize("ids", [[3, 10], np.array([3, 10]), [np.int64(3), 10]], ids=["list", "array", "numpy ints"])
def test_the_vocabulary_size_itself_is_out_of_the_vocabulary(ids):
    with pytest.raises(ValueError, match=r"^prompt token id 10 is out of the vocabulary \[0, 10\)$"):
        token_ids(ids, 10)
    assert token_ids([0, 9], 10) == [0, 9]


def test_the_error_names_the_first_id_out_of_the_vocabulary():
    with pytest.raises(ValueError, match=r"^prompt token id 12 is out of the vocabulary \[0, 10\)$"):
        token_ids([1, 12, 2, 15, 3], 10)


def test_a_bytearray_is_no_token_ids():
    with pytest.raises(ValueError, match="a prompt is text"):
        tokenize(bytearray(b"\x05\x06"), None, 100, "tiny-llama")


def test_a_dict_with_ids_and_text_keeps_both():
    assert tokenize({"prompt_token_ids": [5, 6], "prompt": "hi"}, None, 100, "tiny-llama") == ([5, 6], "hi")
