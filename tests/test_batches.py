"""A batch is a tensor, or a dict whose tensor entries are sliced together on dim 0 while its other
entries pass through; anything else, or tensor entries of different lengths, is refused by name."""

import pytest
import torch

from gcbs_lib.batches import batch_length, slice_batch


def test_a_tensor_batch_is_as_long_as_its_first_dim_and_sliced_on_it():
    batch = torch.arange(12).reshape(6, 2)
    assert batch_length(batch) == 6
    assert torch.equal(slice_batch(batch, 2, 4), batch[2:4])
    assert batch_length(torch.tensor(1.0)) == 0


def test_a_dict_batch_slices_its_tensors_together_and_passes_the_rest_through():
    batch = {"input_ids": torch.arange(10).reshape(5, 2), "mask": torch.ones(5), "mode": "code"}
    assert batch_length(batch) == 5
    part = slice_batch(batch, 1, 3)
    assert torch.equal(part["input_ids"], batch["input_ids"][1:3])
    assert torch.equal(part["mask"], torch.ones(2))
    assert part["mode"] == "code"


def test_tensor_entries_of_different_lengths_or_a_batch_of_another_kind_are_refused():
    with pytest.raises(ValueError, match="all of the same length on dim 0"):
        batch_length({"input_ids": torch.zeros(5, 2), "mask": torch.zeros(4)})
    with pytest.raises(ValueError, match="all of the same length on dim 0"):
        batch_length({"mode": "code"})
    with pytest.raises(TypeError, match="a tensor or a dict of tensors, got tuple"):
        batch_length((torch.zeros(3), torch.zeros(3)))
