"""A partition's gradient sums: views of one flat tensor per dtype, each with its parameter's layout."""

from __future__ import annotations

import torch
from torch import nn

from seqify.pipe.executors.programs import accumulators, flat_sums


def test_sums_are_views_of_one_flat_tensor_per_dtype_with_each_parameters_strides() -> None:
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    half = nn.Parameter(torch.ones(5, dtype=torch.float64))
    sparse = nn.Parameter(torch.ones(4, 6)[:, ::2])  # every other column: not dense, a tensor of its own
    params = [conv.weight, conv.bias, half, sparse]
    acc = accumulators(params)
    assert [a.shape for a in acc] == [p.shape for p in params]
    assert [a.stride() for a in acc[:3]] == [p.stride() for p in params[:3]]
    assert all(a.dtype == p.dtype and not a.any() for a, p in zip(acc, params))
    assert acc[0]._base is acc[1]._base and acc[2]._base is not acc[0]._base and acc[3]._base is None
    assert flat_sums(acc) is None  # one sum outside the flat tensors: the partition is not summed as one
    flats = flat_sums(acc[:3])
    assert flats is not None and [f.numel() for f in flats] == [conv.weight.numel() + 4, 5]
    acc[0].add_(conv.weight)  # writing through the view lands in the flat tensor, in the parameter's order
    assert torch.equal(flats[0][:conv.weight.numel()], conv.weight.detach().permute(0, 2, 3, 1).flatten())
