"""The torch.compile surface without a GPU: the ``cudaflash::*`` custom ops are registered
with their schemas, their fake implementations give the outputs' shapes and dtypes, and a
traced flash_attn_func becomes one ``cudaflash::fwd`` node. CPU only, so that CI runs it on
every torch the README names (the oldest included); tests/test_gpu_*.py run the same ops
compiled on the GPU."""

import pytest
import torch

import cudaflash
from cudaflash import _autograd  # noqa: F401  (registers the ops)


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_ops_are_registered_with_their_schemas():
    fwd = str(torch.ops.cudaflash.fwd.default._schema)
    assert fwd.startswith("cudaflash::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale, "
                          "bool causal, bool deterministic=False, int window_left=-1, "
                          "int window_right=-1, float softcap=0.")
    assert fwd.endswith("float dropout_p=0., Tensor? dropout_seed=None) -> (Tensor, Tensor)")
    assert "Tensor lse" in str(torch.ops.cudaflash.bwd.default._schema)
    assert "Tensor? dropout_seed=None" in str(torch.ops.cudaflash.bwd.default._schema)
    assert "int max_seqlen_q" in str(torch.ops.cudaflash.varlen_fwd.default._schema)


def test_fake_implementations_give_shapes_and_dtypes():
    q, k, v = meta(2, 100, 8, 64), meta(2, 300, 2, 64), meta(2, 300, 2, 64)
    out, lse = torch.ops.cudaflash.fwd(q, k, v, None, True)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "meta")
    assert (lse.shape, lse.dtype) == ((2, 8, 100), torch.float32)
    dq, dk, dv = torch.ops.cudaflash.bwd(torch.empty_like(q), q, k, v, out, lse, None, True,
                                         False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    qp, kp = meta(250, 8, 128, dtype=torch.float16), meta(400, 2, 128, dtype=torch.float16)
    cu = meta(3, dtype=torch.int32)
    out, lse = torch.ops.cudaflash.varlen_fwd(qp, kp, kp, cu, cu, 200, 300, None, False)
    assert (out.shape, out.dtype) == (qp.shape, torch.float16)
    assert (lse.shape, lse.dtype) == ((8, 250), torch.float32)


def exported_nodes(module, *args) -> list:
    """The call_function nodes of ``module`` exported with ``args`` (torch.export traces with
    fake tensors, through dynamo as torch.compile does); skips where this torch cannot export
    it for reasons not cudaflash's."""
    try:
        exported = torch.export.export(module, args)
    except Exception as e:  # an export limitation of this torch, not of cudaflash
        if "cudaflash" in str(e):
            raise
        pytest.skip(f"torch {torch.__version__} cannot export this module: {e}")
    return [n for n in exported.graph.nodes if n.op == "call_function"]


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return cudaflash.flash_attn_func(q, k, v, causal=True, window_size=(64, 0))


def test_traced_flash_attn_func_is_one_op():
    """torch.export traces with fake tensors (the op's body never runs), through dynamo as
    torch.compile does: the graph must hold cudaflash::fwd with the call's arguments."""
    q = torch.randn(1, 128, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(1, 128, 2, 64, dtype=torch.bfloat16)
    calls = [n for n in exported_nodes(Attention(), q, k, v) if "cudaflash" in str(n.target)]
    assert [str(n.target) for n in calls] == ["cudaflash.fwd.default"]
    args = calls[0].args
    assert args[4] is True and tuple(args[6:8]) == (64, 0)  # causal, window


class DropoutAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return cudaflash.flash_attn_func(q, k, v, dropout_p=0.25, causal=True)


def test_traced_dropout_draws_its_seed_in_the_graph():
    """Under tracing the seed is a torch.randint node of the graph (a new mask each run)
    and the op takes dropout_p and that seed, so its backward rebuilds the same mask."""
    q = torch.randn(1, 128, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(1, 128, 2, 64, dtype=torch.bfloat16)
    calls = [n for n in exported_nodes(DropoutAttention(), q, k, v)
             if "cudaflash" in str(n.target)]
    assert [str(n.target) for n in calls] == ["cudaflash.fwd.default"]
    args = calls[0].args
    assert args[10] == 0.25
    seed = args[11]
    assert "randint" in str(seed.target)
    assert seed.meta["val"].dtype == torch.int64 and tuple(seed.meta["val"].shape) == (1,)


def test_ops_refuse_dropout_without_a_seed():
    q, k, v = (torch.randn(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="dropout_p > 0 needs dropout_seed"):
        torch.ops.cudaflash.fwd(q, k, v, None, False, False, -1, -1, 0.0, None, 0.5, None)
    with pytest.raises(ValueError, match=r"dropout_p=1.5; it must be a number in \[0, 1\)"):
        torch.ops.cudaflash.fwd(q, k, v, None, False, False, -1, -1, 0.0, None, 1.5,
                                torch.zeros(1, dtype=torch.int64))
