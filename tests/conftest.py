import pytest


from helpers import sample_inputs


@pytest.fixture
def inputs():
    return sample_inputs
