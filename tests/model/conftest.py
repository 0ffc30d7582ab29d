"""Every kernel test draws its inputs from a seeded generator: a tolerance that fails, fails again."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def seeded_torch():
    torch.manual_seed(0)
