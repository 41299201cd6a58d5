"""The driver-floor checks against the real driver, by fault injection: a driver version
patched to an older one, and kernel images patched into a format or PTX ISA the driver does
not know. Each must end in UnsupportedDriverError naming the driver, the floor, the GPU and
what to do; never a crash or a raw CUDA error."""

import dataclasses
import struct

import pytest

import cudaflash
from _internals import clear_caches
from cudaflash import _driver, driver_compat, manifest

pytestmark = pytest.mark.requires_gpu


def _first(kind: str):
    """A kernel of ``kind`` this GPU can load, with the device index and its context made
    current."""
    import torch

    torch.zeros(1, device="cuda")  # torch's context exists
    _driver.current_context(0)
    dev = _driver.device(0)
    usable = manifest.load_manifest().usable(dev.arch, dev.smem_optin)
    entry = next((e for e in usable.values() if e.kind == kind), None)
    if entry is None:
        entry = next(e for e in manifest.load_manifest().kernels if e.kind == kind)
    return entry, dev


def test_old_driver_gets_a_clear_error(monkeypatch):
    import torch

    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16)
    clear_caches()  # so that the call loads its kernel again
    monkeypatch.setattr(_driver, "driver_version_number", lambda: 11080)  # CUDA 11.8, R520
    try:
        with pytest.raises(cudaflash.UnsupportedDriverError) as exc:
            cudaflash.flash_attn_func(q, q, q)
        message = str(exc.value)
        print(f"\nUnsupportedDriverError: {message}")
        assert torch.cuda.get_device_name(0) in message
        assert "supports CUDA 11.8" in message and "needs CUDA 12.0 (R525+)" in message
        assert "Update the NVIDIA driver to R525 or newer" in message
    finally:
        monkeypatch.undo()
        clear_caches()
    out = cudaflash.flash_attn_func(q, q, q)  # the real driver loads the same kernel
    assert out.isfinite().all()


def test_cubin_for_another_gpu_is_refused_clearly():
    """A patched image the driver cannot run here: the cubin's ELF e_flags retargeted to
    sm_100 (CUDA_ERROR_NO_BINARY_FOR_GPU, the code an unknown format gets too). (The R580
    driver loads a cubin whose OS/ABI byte alone is changed to an unassigned value.)"""
    entry, dev = _first("cubin")
    image = bytearray(entry.path.read_bytes())
    flags = struct.unpack_from("<I", image, 48)[0]
    # Where e_flags holds the SM (measured): CUDA 12 in bits 0-7 and 16-23 (0x5a0d5a for
    # sm_90a), CUDA 13 in bits 8-15 (0x6005a04).
    fields = (0xFF, 0xFF0000) if image[7] == 0x33 else (0xFF00,)
    for mask in fields:
        shift = (mask & -mask).bit_length() - 1
        assert (flags & mask) >> shift == entry.arch, hex(flags)
        flags = (flags & ~mask) | (100 << shift)
    struct.pack_into("<I", image, 48, flags)
    with pytest.raises(cudaflash.UnsupportedDriverError) as exc:
        _driver.load_image(entry, 0, bytes(image))
    message = str(exc.value)
    print(f"\nUnsupportedDriverError: {message}")
    assert "CUDA_ERROR_NO_BINARY_FOR_GPU" in message and dev.name in message
    assert f"needs CUDA {entry.min_driver // 1000}.0" in message


def test_newer_ptx_isa_than_the_driver_is_refused_clearly():
    entry, dev = _first("ptx")
    text = entry.path.read_text()
    isa = "%d.%d" % driver_compat.ptx_isa(text)
    assert isa == entry.ptx_isa  # the shipped file declares what the manifest says
    patched = driver_compat.with_ptx_isa(text, (9, 9))
    newer = dataclasses.replace(entry, ptx_isa="9.9", min_driver=13090)
    with pytest.raises(cudaflash.UnsupportedDriverError) as exc:
        _driver.load_image(newer, 0, patched.encode() + b"\0")
    message = str(exc.value)
    print(f"\nUnsupportedDriverError: {message}")
    assert "does not accept PTX ISA 9.9" in message and dev.name in message
    # The shipped PTX itself JIT-compiles on this driver.
    module = _driver.load_image(entry, 0, text.encode() + b"\0")
    assert module is not None
