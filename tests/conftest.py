"""Shared fixtures for the test suite."""
import pytest
import torch


@pytest.fixture
def float64_default():
    """Run a test with float64 as the default dtype, restoring the previous default afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
