"""Specification of the comparison rows the notebooks print: bitwise equality and norm-wise relative
error; and of `as_type`, which types the settings train and reproduce read from text."""

from typing import Any, Literal

import pytest
import torch

from gcbs_lib.check import as_type, cmp_table, compare, relative_error, tolerance


def test_relative_error_is_the_norm_of_the_difference_over_the_norm_of_the_reference():
    reference = torch.tensor([3.0, 4.0])
    assert relative_error(reference + torch.tensor([0.0, 0.5]), reference) == pytest.approx(0.1)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.ones(2), torch.zeros(2)) == float("inf")


def test_a_norm_wise_error_within_tolerance_can_hide_a_large_element_wise_error():
    reference = torch.tensor([1e6, 1e-6], dtype=torch.float64)
    ours = torch.tensor([1e6, 2e-6], dtype=torch.float64)  # the small entry is off by 100 %
    row = compare("mixed scales", ours, reference)
    assert (
        row.within_tolerance
        and not row.exact
        and not torch.allclose(ours, reference, rtol=1e-12, atol=0)
    )


def test_each_precision_gets_its_own_tolerance_ordered_by_precision():
    levels = [tolerance(d) for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    assert levels == sorted(levels) and len(set(levels)) == 4
    with pytest.raises(ValueError, match="no tolerance for torch.int64"):
        tolerance(torch.int64)


def test_the_table_names_its_columns_for_what_they_measure():
    table = cmp_table(
        [compare("w", torch.ones(3), torch.ones(3)), compare("v", torch.zeros(2), torch.ones(2))]
    )
    header, same, different = table.splitlines()
    assert header.split() == ["name", "exact", "‖Δ‖/‖ref‖", "tolerance", "within"]
    assert same.split() == ["w", "True", "0.0e+00", "1e-05", "True"]
    assert different.split() == ["v", "False", "1.0e+00", "1e-05", "False"]


def test_shapes_that_differ_are_refused():
    with pytest.raises(ValueError, match="shape mismatch"):
        compare("x", torch.ones(3), torch.ones(2, 3))


def test_as_type_keeps_a_value_of_the_type_and_makes_a_float_of_an_int_or_a_number_text():
    assert as_type(3, int, "wrong") == 3 and as_type(None, int | None, "wrong") is None
    assert as_type(2, float, "wrong") == 2.0 and isinstance(as_type(2, float, "wrong"), float)
    assert as_type("3e-5", float, "wrong") == 3e-5  # YAML reads 3e-5 as text
    assert as_type("gcbs", Literal["random", "gcbs"], "wrong") == "gcbs"
    assert as_type([1], list, "wrong") == [1] and as_type({"a": 1}, Any, "wrong") == {"a": 1}
    refused = [(True, int), ("3", int), (1, bool), ("fast", float), (True, float), (3, str)]
    for value, kind in [*refused, ("hard", Literal["gcbs"]), (None, int)]:
        with pytest.raises(ValueError, match="^wrong$"):
            as_type(value, kind, "wrong")
