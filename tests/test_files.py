"""Atomic writers leave files with the mode the umask gives, not mkstemp/mkdtemp's private 0600/0700:
an exported drafter must be readable by the serving engine's user."""

import hashlib
import os
import stat

import pytest
import torch

from selfdraft.heads.io import write_folder
from selfdraft.heads.target import join_chunks
from selfdraft.inference import bench
from selfdraft.train import checkpoint as ckpt


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_atomic_writers_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        folder = write_folder(tmp_path / "drafter", "model.safetensors", {"w": torch.zeros(2, 2)}, {"kind": "x"})
        write_folder(folder, "model.safetensors", {"w": torch.ones(2, 2)}, {"kind": "x"})  # replacing too
        data = b"GGUF" + bytes(100)
        (tmp_path / "part1").write_bytes(data)
        joined = join_chunks([tmp_path / "part1"], tmp_path / "model.gguf",
                             sha256=hashlib.sha256(data).hexdigest())
        report = tmp_path / "report.md"
        bench._write_atomic(report, b"# report\n")
        staging = ckpt.staging_dir(tmp_path / "checkpoints", 7)
        staging.mkdir(parents=True)
        ckpt.save_tree(staging, "trainable", {"w": torch.zeros(3)})
        checkpoint = ckpt.publish(tmp_path / "checkpoints", 7, {"step": 7}, keep_last=2)
    finally:
        os.umask(old)
    for path in (folder, checkpoint):
        assert _mode(path) == 0o777 & ~umask, path
    for path in (*folder.iterdir(), joined, report, *checkpoint.iterdir()):
        assert _mode(path) == 0o666 & ~umask, path
