"""Flat buffers (``psserver.trainer.compute.flat``): what crosses between trainer and server, one
buffer per shard, packed and unpacked without allocating per step. Device-independent: the
same calls run on a GPU's tensors."""

from __future__ import annotations

import pytest
import torch

from psserver.trainer.compute.flat import FlatBuffer, copy_flat_into


def tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(0),
            torch.randn(2, 1, 2, generator=g)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_then_copy_back_is_the_values_in_the_wire_dtype(dtype):
    src = tensors()
    packer = FlatBuffer([t.numel() for t in src], dtype, "cpu")
    flat = packer.pack(src)
    assert flat.dtype == dtype and flat.shape == (21,)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in src]).to(dtype))
    out = [torch.full_like(t, 7.0) for t in src]
    copy_flat_into(flat, out)  # back to fp32, each its shape
    for a, b in zip(out, src, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(a, b.to(dtype).float())


def test_every_pack_reuses_one_buffer():
    src = tensors()
    packer = FlatBuffer([t.numel() for t in src], torch.float32, "cpu")
    first = packer.pack(src)
    ptr = first.data_ptr()
    again = packer.pack([t * 2 for t in src])
    assert again.data_ptr() == ptr and again is first  # no allocation: the same storage, overwritten
    assert torch.equal(again, torch.cat([t.reshape(-1) * 2 for t in src]))


def test_a_gradient_that_needs_grad_packs_detached():
    w = torch.randn(4, requires_grad=True)
    loss = (w * w).sum()
    (grad,) = torch.autograd.grad(loss, [w], create_graph=True)
    flat = FlatBuffer([4], torch.float32, "cpu").pack([grad])
    assert not flat.requires_grad and torch.allclose(flat, 2 * w.detach())


def test_sizes_that_do_not_fit_are_refused():
    packer = FlatBuffer([12, 5], torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"tensors of \[5, 12\] values for a buffer of \[12, 5\]"):
        packer.pack([torch.zeros(5), torch.zeros(12)])
    with pytest.raises(ValueError, match="a flat buffer of shape"):
        copy_flat_into(torch.zeros(16), [torch.zeros(12), torch.zeros(5)])
    with pytest.raises(ValueError, match="a flat buffer of shape"):
        copy_flat_into(torch.zeros(17, 1), [torch.zeros(12), torch.zeros(5)])
    assert FlatBuffer([], torch.float32, "cpu").pack([]).numel() == 0
    copy_flat_into(torch.zeros(0), [])  # nothing to do


def test_copy_into_parameters_that_require_grad():
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    flat = torch.arange(8, dtype=torch.bfloat16)
    copy_flat_into(flat, params)
    assert torch.equal(model.weight.detach(), torch.arange(6.0).view(2, 3)) and model.bias.tolist() == [6.0, 7.0]
    assert model.weight.requires_grad and model.weight.grad_fn is None  # still leaves


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_on_the_gpu_a_host_buffer_lands_in_device_tensors():
    src = [t.cuda() for t in tensors()]
    packer = FlatBuffer([t.numel() for t in src], torch.bfloat16, "cuda:0")
    flat = packer.pack(src)
    assert flat.device.type == "cuda" and flat.data_ptr() == packer.pack(src).data_ptr()
    out = [torch.zeros_like(t) for t in src]
    copy_flat_into(flat.cpu(), out)
    assert all(torch.equal(a, b.to(torch.bfloat16).float()) for a, b in zip(out, src, strict=True))
