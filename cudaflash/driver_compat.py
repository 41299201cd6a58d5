"""Which NVIDIA driver a kernel file needs, read off the file itself.

Two facts decide whether a driver loads a kernel image (measured on the H100 with R580, and
NVIDIA's compatibility rules for the rest):

- A **cubin** is an ELF file whose header says which toolkit family wrote it. CUDA 11 and 12
  toolchains write OS/ABI 0x33 (ABI version 7, ``e_version`` = the toolkit, 129 for 12.9);
  CUDA 13 writes OS/ABI 0x41. A driver loads the cubins of its own major CUDA version and
  older ones (minor version compatibility: a 12.9 cubin loads on R525, the first CUDA 12
  driver); a format it does not know fails with CUDA_ERROR_NO_BINARY_FOR_GPU (209), the same
  code as a wrong arch. So a CUDA 12 cubin needs a CUDA 12.0 driver, a CUDA 13 one a 13.0.
- **PTX** is compiled by the driver's JIT, which refuses an ISA newer than its own
  (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, 222). The ``.version`` line is the whole requirement.

Driver versions are CUDA driver API versions as ``cuDriverGetVersion`` returns them
(1000 * major + 10 * minor: 12020 for CUDA 12.2). Pure Python, no GPU: the build records these
floors in the manifest, CI checks the wheel's files against them, and the runtime compares
them with the driver before the first load.
"""

from __future__ import annotations

import re
import struct

# The CUDA release that introduced each PTX ISA version (PTX ISA manual, release notes): a
# driver of that release or newer JIT-compiles the PTX.
PTX_ISA_CUDA = {
    (7, 0): 11000, (7, 1): 11010, (7, 2): 11020, (7, 3): 11030, (7, 4): 11040,
    (7, 5): 11050, (7, 6): 11060, (7, 7): 11070, (7, 8): 11080,
    (8, 0): 12000, (8, 1): 12010, (8, 2): 12020, (8, 3): 12030, (8, 4): 12040,
    (8, 5): 12050, (8, 6): 12070, (8, 7): 12080, (8, 8): 12090,
    (9, 0): 13000, (9, 1): 13010,
}

# The first Linux driver branch of each CUDA release (NVIDIA's CUDA toolkit release notes,
# table 3), for messages: people know their driver by its branch, not its CUDA version.
CUDA_DRIVER_BRANCH = {
    11000: 450, 11010: 455, 11020: 460, 11030: 465, 11040: 470, 11050: 495, 11060: 510,
    11070: 515, 11080: 520, 12000: 525, 12010: 530, 12020: 535, 12030: 545, 12040: 550,
    12050: 555, 12060: 560, 12080: 570, 12090: 575, 13000: 580, 13010: 590,
}

# The lowest PTX ISA whose .target line accepts each target (ptxas: "PTX .version X does not
# support .target Y"): where the search for the lowest ISA a PTX file needs starts.
TARGET_MIN_PTX_ISA = {"sm_80": (7, 0), "sm_86": (7, 1), "sm_89": (7, 8), "sm_90": (7, 8),
                      "sm_90a": (8, 0)}

ELF_MAGIC = b"\x7fELF"
ELFOSABI_CUDA_11_12 = 0x33  # CUDA 11.x and 12.x toolchains
ELFOSABI_CUDA_13 = 0x41  # CUDA 13.x


class KernelFormatError(ValueError):
    """A file is not a cubin or PTX this module can read."""


def cuda_version_text(version: int) -> str:
    """12020 -> '12.2'."""
    return f"{version // 1000}.{version % 1000 // 10}"


def parse_cuda_version(text: str) -> int:
    """'12.2' or '12.2.140' -> 12020."""
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a CUDA version such as 12.2")
    return 1000 * int(m.group(1)) + 10 * int(m.group(2))


def driver_branch(version: int) -> str:
    """The first driver branch that supports CUDA ``version``: 'R535' for 12020. A version
    between known releases maps to the next known one (12070 -> R570); one past the table
    says so."""
    known = [v for v in sorted(CUDA_DRIVER_BRANCH) if v >= version]
    if not known:
        return f"a driver for CUDA {cuda_version_text(version)}"
    return f"R{CUDA_DRIVER_BRANCH[known[0]]}"


def describe_driver(version: int) -> str:
    """'CUDA 12.2 (R535+)': what a driver version means to a user."""
    return f"CUDA {cuda_version_text(version)} ({driver_branch(version)}+)"


# ---- cubins --------------------------------------------------------------------------------


def cubin_header(data: bytes) -> tuple[int, int, int]:
    """(OS/ABI byte, ABI version, e_version) of a cubin's ELF header."""
    if len(data) < 64 or data[:4] != ELF_MAGIC:
        raise KernelFormatError("not an ELF file (a cubin starts with \\x7fELF)")
    if data[4] != 2 or data[5] != 1:
        raise KernelFormatError("not a 64-bit little-endian ELF file, as cubins are")
    (e_version,) = struct.unpack_from("<I", data, 20)
    return data[7], data[8], e_version


def cubin_toolkit(data: bytes) -> str:
    """The toolkit family that wrote a cubin: '12.9' where the header says it (CUDA 11/12
    write their version into e_version), else '13' for the CUDA 13 format."""
    osabi, _, e_version = cubin_header(data)
    if osabi == ELFOSABI_CUDA_11_12:
        return f"{e_version // 10}.{e_version % 10}"
    if osabi == ELFOSABI_CUDA_13:
        return "13"
    raise KernelFormatError(f"unknown cubin format: ELF OS/ABI byte {osabi:#x} (CUDA 11/12 "
                            f"write {ELFOSABI_CUDA_11_12:#x}, CUDA 13 {ELFOSABI_CUDA_13:#x})")


def cubin_min_driver(data: bytes) -> int:
    """The oldest CUDA driver version that loads this cubin: the first driver of the major
    release whose format it has (12000 for any CUDA 12 cubin, 13000 for CUDA 13)."""
    return 1000 * int(cubin_toolkit(data).split(".")[0])


# ---- PTX -----------------------------------------------------------------------------------

_VERSION_LINE = re.compile(r"^\.version[ \t]+(\d+)\.(\d+)[ \t]*$", re.M)


def ptx_isa(text: str) -> tuple[int, int]:
    """The ISA a PTX file declares (its ``.version`` line)."""
    m = _VERSION_LINE.search(text)
    if not m:
        raise KernelFormatError("no '.version X.Y' line: not a PTX file")
    return int(m.group(1)), int(m.group(2))


def with_ptx_isa(text: str, isa: tuple[int, int]) -> str:
    """``text`` declaring ISA ``isa`` instead of its own (the build lowers it to what the code
    needs, so that older drivers JIT it)."""
    ptx_isa(text)  # raises if there is no version line
    return _VERSION_LINE.sub(f".version {isa[0]}.{isa[1]}", text, count=1)


def ptx_min_driver(isa: tuple[int, int]) -> int:
    try:
        return PTX_ISA_CUDA[isa]
    except KeyError:
        raise KernelFormatError(f"PTX ISA {isa[0]}.{isa[1]} is not in the table of known ISA "
                                "versions (cudaflash/driver_compat.py PTX_ISA_CUDA)") from None


# ptxas's complaint when a file declares too low an ISA for what it uses.
_ISA_NEEDED = re.compile(r"requires PTX ISA \.version (\d+)\.(\d+) or later")


def isa_required_by(ptxas_log: str) -> tuple[int, int] | None:
    """The highest ISA ptxas said the code requires, or None if it said nothing of the kind."""
    needed = [(int(a), int(b)) for a, b in _ISA_NEEDED.findall(ptxas_log)]
    return max(needed) if needed else None


# ---- any kernel file -----------------------------------------------------------------------


def min_driver(kind: str, data: bytes) -> int:
    """The oldest CUDA driver version that loads a kernel file of ``kind`` ('cubin', 'ptx')."""
    if kind == "cubin":
        return cubin_min_driver(data)
    if kind == "ptx":
        return ptx_min_driver(ptx_isa(data.decode("ascii", errors="replace")))
    raise ValueError(f"kind={kind!r}; allowed: 'cubin', 'ptx'")
