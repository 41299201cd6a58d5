"""Every private torch binding cudaflash uses, in one place.

These run on the per-call path, so callers bind them once at import (``from ._torch import
current_stream``) instead of looking them up per call. Private to torch: each is fetched with
getattr and may be None where a torch build lacks it (CPU-only builds, where nothing reaches
a launch); the callers say what they do then.
"""

import torch

# Raw handle of torch's current stream on a device: a side stream, or the capture stream
# inside ``torch.cuda.graph``. Same value as ``torch.cuda.current_stream(index).cuda_stream``
# without building a Stream object per call (Inductor's generated code uses the same
# function). None in CPU-only torch builds.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# torch.cuda.current_device() without its Python wrapper (0.2 instead of 0.5 us): the C
# function does the same lazy CUDA initialisation (and bad-fork check) itself.
current_device = getattr(torch._C, "_cuda_getDevice", None)
# The allocator of Inductor's generated code (torch/_inductor/codegen/wrapper.py): an empty
# tensor of given sizes, strides and dtype on the current CUDA device, without the dispatcher;
# about half of torch.empty_like's host time. Never trusted blindly: _plans.fast_allocator
# tries it once per plan and keeps it only if its tensor is what torch.empty_like gave.
empty_strided_cuda = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                             "_empty_strided_cuda", None)

# Public, but bound here too so the per-call path pays one global lookup for each.
is_compiling = torch.compiler.is_compiling  # torch.compile recognises the function itself
is_grad_enabled = torch.is_grad_enabled
empty_like = torch.empty_like
float32 = torch.float32
