"""cudaflash: FlashAttention (forward and backward) for PyTorch, from prebuilt cubins launched
through the CUDA driver API (cuda-python). No compiler and no C++ extension at run time;
importing it touches no GPU.
"""

from .api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                  flash_attn_varlen_qkvpacked_func, forward, list_kernels)
from ._driver import CudaError, UnsupportedDriverError
from .config import KernelConfig
from .kvcache import flash_attn_with_kvcache

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "forward",
           "list_kernels", "KernelConfig", "CudaError", "UnsupportedDriverError",
           "__version__"]
