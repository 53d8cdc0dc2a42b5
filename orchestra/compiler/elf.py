"""A small pure-Python reader for the symbol table of a cubin (an ELF64 little-endian file).

Used to check that each lowered name NVRTC reports really is in the image, and to list the
kernels of a cubin in error messages when the driver cannot be asked (no GPU). Kernels are the
``STT_FUNC`` symbols carrying NVIDIA's entry-point flag (``st_other & 0x10``); ``__device__``
and ``__constant__`` variables are ``STT_OBJECT`` symbols.
"""

from __future__ import annotations

import struct

import attrs

from orchestra.errors import OrchestraError

ELF_MAGIC = b"\x7fELF"
_SHT_SYMTAB = 2
_STT_OBJECT = 1
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10
_SHT_NOBITS = 8
_EIFMT_SVAL = 0x04  # .nv.info record formats and attributes (NVIDIA cubin ELF)
_EIATTR_KPARAM_INFO = 0x17

_SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym


class ElfError(OrchestraError, ValueError):
    """The bytes are not a well-formed ELF64 little-endian image."""


@attrs.frozen
class Symbol:
    """One ``.symtab`` entry: ``name``, ``kind`` (``"func"``, ``"object"``, ``"other"``),
    ``entry`` (True for a kernel entry point), ``size`` (bytes)."""

    name: str
    kind: str
    entry: bool
    size: int


def is_elf(image) -> bool:
    """True when ``image`` starts with the ELF magic ``\\x7fELF``."""
    return bytes(image[:4]) == ELF_MAGIC


def _cstr(data: bytes, off: int) -> str:
    end = data.find(b"\0", off)
    if end < 0:
        raise ElfError("unterminated string in string table")
    return data[off:end].decode("utf-8", errors="replace")


def _sections(data: bytes) -> list[tuple]:
    """The section headers (``Elf64_Shdr`` tuples) of a checked ELF64 little-endian image."""
    if len(data) < 64 or not is_elf(data):
        raise ElfError("not an ELF image (no \\x7fELF magic)")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF image")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shentsize != _SHDR.size or shoff + shnum * shentsize > len(data):
        raise ElfError("section header table out of range")
    sections = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    for sh in sections:
        if sh[1] != _SHT_NOBITS and sh[4] + sh[5] > len(data):
            raise ElfError("section out of range")
    return sections


def _section_names(data: bytes, sections) -> list[str]:
    (shstrndx,) = struct.unpack_from("<H", data, 0x3E)
    if shstrndx >= len(sections):
        raise ElfError("section name table out of range")
    names = sections[shstrndx]
    strtab = data[names[4]:names[4] + names[5]]
    return [_cstr(strtab, sh[0]) if sh[0] < len(strtab) else "" for sh in sections]


def symbols(image) -> list[Symbol]:
    """Every named symbol of the image's ``SHT_SYMTAB`` sections.

    Raises `ElfError` for anything that is not a consistent ELF64 little-endian file.
    """
    data = bytes(image)
    sections = _sections(data)
    out = []
    for sh in sections:
        sh_type, sh_offset, sh_size, sh_link, sh_entsize = sh[1], sh[4], sh[5], sh[6], sh[9]
        if sh_type != _SHT_SYMTAB:
            continue
        if sh_entsize != _SYM.size or sh_link >= len(sections):
            raise ElfError("symbol table out of range")
        str_off, str_size = sections[sh_link][4], sections[sh_link][5]
        strtab = data[str_off:str_off + str_size]
        for i in range(sh_size // _SYM.size):
            st_name, st_info, st_other, _shndx, _value, st_size = _SYM.unpack_from(
                data, sh_offset + i * _SYM.size)
            if st_name == 0 or st_name >= len(strtab):
                continue
            t = st_info & 0xF
            kind = "func" if t == _STT_FUNC else "object" if t == _STT_OBJECT else "other"
            out.append(Symbol(_cstr(strtab, st_name), kind,
                              t == _STT_FUNC and bool(st_other & _STO_CUDA_ENTRY), st_size))
    return out


def kernel_params(image, name: str) -> list[tuple[int, int]] | None:
    """``(offset, size)`` in bytes of each parameter of kernel ``name`` (lowered), in order,
    read from the cubin's ``.nv.info.<name>`` section (its ``EIATTR_KPARAM_INFO`` records, the
    same table ``cuobjdump -elf`` prints). None when the image has no such section.

    This needs no driver: drivers before CUDA 13.1 have no ``cuFuncGetParamCount``.
    """
    data = bytes(image)
    sections = _sections(data)
    names = _section_names(data, sections)
    try:
        sh = sections[names.index(f".nv.info.{name}")]
    except ValueError:
        return None
    body = data[sh[4]:sh[4] + sh[5]]
    params, i = {}, 0
    while i + 4 <= len(body):
        fmt, attr = body[i], body[i + 1]
        if fmt == _EIFMT_SVAL:  # a sized payload follows a u16 length
            (length,) = struct.unpack_from("<H", body, i + 2)
            payload, i = body[i + 4:i + 4 + length], i + 4 + length
        else:  # EIFMT_NVAL / BVAL / HVAL: the value sits in the record's last two bytes
            payload, i = b"", i + 4
        if attr == _EIATTR_KPARAM_INFO and len(payload) >= 12:
            _index, ordinal, offset, bits = struct.unpack_from("<IHHI", payload)
            params[ordinal] = (offset, (bits >> 18) & 0x3FFF)  # size sits in bits 18..31
    return [params[k] for k in sorted(params)]


def kernel_names(image) -> list[str]:
    """Names (lowered) of the kernel entry points in a cubin, in symbol-table order."""
    return [s.name for s in symbols(image) if s.entry]


def defined_names(image) -> set[str]:
    """Names of every function and variable symbol in a cubin (kernels, device functions,
    ``__device__``/``__constant__`` variables)."""
    return {s.name for s in symbols(image) if s.kind in ("func", "object")}
