"""ZeRO-3 loading reads each process's elements of a weight straight from the safetensors file (no
mapping of the whole file): the reader against safetensors' own, and bad files refused."""

import pytest
import torch
from safetensors.torch import save_file

from selfdraft.errors import SelfdraftError
from selfdraft.train.partitioned import _index, _read_elements


def _file(tmp_path):
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(7, 5), "b.weight": torch.randn(13).to(torch.bfloat16),
               "c.bias": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_any_range_of_any_weight_reads_as_the_flattened_tensor(tmp_path):
    path, tensors = _file(tmp_path)
    index = _index([path])
    assert set(index) == set(tensors)  # __metadata__ is not a tensor
    for name, tensor in tensors.items():
        assert index[name].shape == tuple(tensor.shape) and index[name].dtype == tensor.dtype
        flat = tensor.reshape(-1)
        for start, count in ((0, flat.numel()), (3, 2), (flat.numel() - 1, 1)):
            out = torch.empty(count, dtype=tensor.dtype)
            _read_elements(index[name], start, out)
            assert torch.equal(out, flat[start:start + count])
    # into another dtype (a bf16 file, a fp32 model): converted as copy_ converts
    out = torch.empty(5, dtype=torch.float32)
    _read_elements(index["b.weight"], 2, out)
    assert torch.equal(out, tensors["b.weight"].reshape(-1)[2:7].float())
    with pytest.raises(ValueError, match="outside"):  # never past the tensor's end into the next one
        _read_elements(index["c.bias"], 3, torch.empty(4, dtype=torch.int64))


def test_truncated_and_corrupt_files_are_refused_with_the_reason(tmp_path):
    path, _ = _file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(SelfdraftError, match="truncated"):
        _index([path])
    path.write_bytes(data[:20])
    with pytest.raises(SelfdraftError, match="not a complete safetensors file"):
        _index([path])
    length = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"{" * length + data[8 + length:])
    with pytest.raises(SelfdraftError, match="corrupt safetensors header"):
        _index([path])
