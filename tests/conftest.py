"""Shared fixtures: the embedded target (converted once per machine, cached) and small model folders."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def embedded_fp32():
    """SmolLM2-135M-Instruct in float32: token identity is checked in fp32 (FACTS.md)."""
    from selfdraft.heads.target import load_target

    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def truncated_smollm2(embedded_fp32, tmp_path_factory):
    """A real separate draft model with SmolLM2's tokenizer: its first 4 layers, as an HF folder."""
    import copy

    import torch

    model = copy.deepcopy(embedded_fp32.model)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:4])
    model.config.num_hidden_layers = 4
    folder = tmp_path_factory.mktemp("smollm2-4layers")
    model.save_pretrained(folder)
    embedded_fp32.tokenizer.save_pretrained(folder)
    return folder
