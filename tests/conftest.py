"""Shared pytest setup: tiny models are overhead-bound, so one intra-op thread is fastest and steadiest."""

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
