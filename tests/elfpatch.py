"""Real faults in a copy of a real BLAS: an instruction this CPU refuses at the start of a
function (SIGILL when called, on any CPU), or a function that returns at once (its results
are left as they were: wrong numbers). Found through the ELF dynamic symbol table."""

from __future__ import annotations

import platform
import struct
from pathlib import Path

# An undefined instruction and a return, per machine: ud2 / ret on x86_64, udf #0 / ret on
# aarch64 (little-endian words).
TRAP = {"x86_64": b"\x0f\x0b", "aarch64": b"\x00\x00\x00\x00"}
RETURN = {"x86_64": b"\xc3", "aarch64": b"\xc0\x03\x5f\xd6"}
# A jump to itself: the function never returns (a hang).
LOOP = {"x86_64": b"\xeb\xfe", "aarch64": b"\x00\x00\x00\x14"}


def symbol_offset(elf: bytes, name: str) -> int:
    """File offset of the code of exported function ``name`` in a 64-bit little-endian ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                for i in range(shnum)]
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    loads = []
    for i in range(phnum):
        p_type, _, off, vaddr, _, filesz, _, _ = struct.unpack_from("<IIQQQQQQ", elf,
                                                                    phoff + i * phentsize)
        if p_type == 1:
            loads.append((vaddr, off, filesz))
    for sh in sections:
        if sh[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sh[6]]  # sh_link: its string table
        for j in range(sh[5] // 24):
            st_name, _, _, _, st_value, _ = struct.unpack_from("<IBBHQQ", elf, sh[4] + j * 24)
            at = strtab[4] + st_name
            if elf[at:elf.index(b"\0", at)] == name.encode() and st_value:
                for start, off, size in loads:
                    if start <= st_value < start + size:
                        return st_value - start + off
    raise ValueError(f"{name} not found")


def patched_copy(source: Path, target: Path, function: str = "cblas_sgemm",
                 fault: str = "trap") -> Path:
    """A copy of ``source`` at ``target`` whose ``function`` starts with ``fault`` (``trap``:
    an undefined instruction; ``return``: returns at once; ``loop``: never returns)."""
    data = bytearray(Path(source).read_bytes())
    code = {"trap": TRAP, "return": RETURN, "loop": LOOP}[fault][platform.machine()]
    at = symbol_offset(bytes(data), function)
    data[at:at + len(code)] = code
    target.write_bytes(bytes(data))
    return target
