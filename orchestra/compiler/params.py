"""Kernel parameter declarations: what each argument of a kernel is, read from its source.

`parse_params(source, name)` reads the ``__global__`` declaration of ``name`` (``extern "C"``
or a plain non-template C++ function) and returns a tuple of `Param`. Supported types:

* scalars: ``bool``; ``char``/``signed char``/``unsigned char``; ``short``, ``int``, ``long``,
  ``long long`` with ``signed``/``unsigned``; ``int8_t`` .. ``uint64_t`` (also ``std::``),
  ``size_t``, ``ptrdiff_t``, ``intptr_t``, ``uintptr_t``; ``float``, ``double``;
* pointers ``T*`` to anything (device addresses, 8 bytes); ``const T*`` (or ``T const*``) is
  a read-only pointer: ``Param.const`` is True, and the graph layer defaults such an argument
  to read access;
* ``cudaGraphConditionalHandle`` (also ``CUgraphConditionalHandle``): a CUDA graph's
  conditional handle, 64-bit (``Param.kind`` ``"handle"``), which the kernel passes to
  ``cudaGraphSetConditional``; a graph node gives it a `orchestra.graph.Condition`.

Qualifiers ``const`` (top level), ``__restrict__``, ``volatile`` and ``__grid_constant__`` are
ignored. Anything else (structs, references, arrays, ``__half``, templates) raises
``ValueError`` asking for explicit ``params=``, e.g. ``params=("const float*", "float*",
"int", "float")``. Long is 64-bit (Linux LP64, as NVCC/NVRTC use for device code there).
"""

from __future__ import annotations

import re

from orchestra.errors import ParamDeclarationTypeError, ParamDeclarationValueError

import attrs

# ctype name -> (numpy-style kind name, size in bytes). "pointer" uses ("ptr", 8).
SCALAR_TYPES: dict[str, tuple[str, int]] = {
    "bool": ("bool", 1),
    "char": ("int8", 1), "signed char": ("int8", 1), "unsigned char": ("uint8", 1),
    "short": ("int16", 2), "unsigned short": ("uint16", 2),
    "int": ("int32", 4), "unsigned int": ("uint32", 4),
    "long": ("int64", 8), "unsigned long": ("uint64", 8),
    "long long": ("int64", 8), "unsigned long long": ("uint64", 8),
    "int8_t": ("int8", 1), "uint8_t": ("uint8", 1), "int16_t": ("int16", 2),
    "uint16_t": ("uint16", 2), "int32_t": ("int32", 4), "uint32_t": ("uint32", 4),
    "int64_t": ("int64", 8), "uint64_t": ("uint64", 8),
    "size_t": ("uint64", 8), "ptrdiff_t": ("int64", 8), "ssize_t": ("int64", 8),
    "intptr_t": ("int64", 8), "uintptr_t": ("uint64", 8),
    "float": ("float32", 4), "double": ("float64", 8),
}

# Conditional handles (cudaGraphConditionalHandle is unsigned long long in the runtime headers).
HANDLE_TYPES: dict[str, tuple[str, int]] = {
    "cudaGraphConditionalHandle": ("uint64", 8),
    "CUgraphConditionalHandle": ("uint64", 8),
}

# Spelling variants -> canonical names above.
_ALIASES = {
    "signed short": "short", "short int": "short", "signed short int": "short",
    "unsigned short int": "unsigned short", "signed": "int", "signed int": "int",
    "unsigned": "unsigned int", "long int": "long", "signed long": "long",
    "signed long int": "long", "unsigned long int": "unsigned long",
    "long long int": "long long", "signed long long": "long long",
    "signed long long int": "long long", "unsigned long long int": "unsigned long long",
    "unsigned char": "unsigned char", "signed char": "signed char",
}

_IGNORED = {"__restrict__", "__restrict", "restrict", "volatile", "__grid_constant__",
            "struct", "register"}
_KEYWORDS = {"const", "unsigned", "signed", "short", "long", "int", "char", "bool", "float",
             "double", "void"} | _IGNORED
_TOKEN_RE = re.compile(r"[A-Za-z_][\w:]*|\*|&|\[|\]|\S")


@attrs.frozen
class Param:
    """One kernel parameter.

    Attributes:
        name: the parameter's name (``arg0``, ``arg1``... when the declaration has none).
        ctype: the canonical C type: ``"float"``, ``"unsigned int"``, ``"size_t"``,
            ``"const float*"``, ``"float*"``, ``"cudaGraphConditionalHandle"``.
        kind: ``"pointer"``, ``"scalar"`` or ``"handle"`` (a conditional handle).
        const: for a pointer, True when the pointee is const (read-only access); False for
            scalars.

    Immutable: may be shared between threads freely.
    """

    name: str
    ctype: str
    kind: str
    const: bool = False

    @property
    def is_pointer(self) -> bool:
        return self.kind == "pointer"

    @property
    def is_handle(self) -> bool:
        """A conditional handle (``cudaGraphConditionalHandle``)."""
        return self.kind == "handle"

    @property
    def dtype(self) -> str:
        """numpy dtype name of the value passed: ``"float32"``, ``"uint64"``... ``"ptr"``
        (a 64-bit device address) for pointers, ``"uint64"`` for conditional handles."""
        if self.kind == "pointer":
            return "ptr"
        if self.kind == "handle":
            return HANDLE_TYPES[self.ctype][0]
        return SCALAR_TYPES[self.ctype][0]

    @property
    def size(self) -> int:
        """Bytes the parameter occupies (its natural alignment too)."""
        if self.kind == "pointer":
            return 8
        if self.kind == "handle":
            return HANDLE_TYPES[self.ctype][1]
        return SCALAR_TYPES[self.ctype][1]

    def __str__(self) -> str:
        return f"{self.ctype} {self.name}"


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", " ", text)


def _split_top_level(s: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in s:
        if ch in "(<[{":
            depth += 1
        elif ch in ")>]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_param_decl(decl: str, index: int = 0, *, kernel: str = "") -> Param:
    """One declaration (``"const float* __restrict__ x"``, ``"int"``, ``"size_t n = 0"``) ->
    `Param`. Unnamed parameters are called ``arg<index>``.

    Raises `ParamDeclarationValueError` (a ``ValueError``) for an unsupported type (the message
    asks for ``params=``).
    """
    where = f" of kernel {kernel!r}" if kernel else ""
    text = decl.split("=", 1)[0].strip()
    tokens = [t for t in _TOKEN_RE.findall(text) if t not in _IGNORED]
    if not tokens:
        raise ParamDeclarationValueError(f"empty parameter declaration {decl!r}{where}")

    def unsupported(why: str) -> ParamDeclarationValueError:
        return ParamDeclarationValueError(
            f"parameter {index} ({decl.strip()!r}){where}: {why}; pass the parameter types"
            " explicitly, e.g. params=(\"const float*\", \"float*\", \"int\", \"float\")")

    if "&" in tokens or "[" in tokens:
        raise unsupported("references and arrays are not supported")
    name = f"arg{index}"
    if len(tokens) >= 2 and tokens[-1] not in _KEYWORDS and tokens[-1] != "*" \
            and re.match(r"^[A-Za-z_]\w*$", tokens[-1]):
        name = tokens[-1]
        tokens = tokens[:-1]
    if "*" in tokens:
        last_star = len(tokens) - 1 - tokens[::-1].index("*")
        if any(t not in ("*", "const") for t in tokens[last_star + 1:]):
            raise unsupported("unexpected tokens after '*'")
        stars = [i for i, t in enumerate(tokens) if t == "*"]
        # The pointee of the outermost pointer is const when "const" stands before the first
        # '*' of a T* (const T* / T const*), or between the last two '*' of a T**.
        lo = stars[-2] + 1 if len(stars) > 1 else 0
        const = "const" in tokens[lo:stars[-1]]
        base = " ".join(t for t in tokens[:stars[0]] if t != "const")
        if not base:
            raise unsupported("pointer without a pointee type")
        ctype = _canonical(base, allow_unknown=True)
        if "const" in tokens[:stars[0]]:
            ctype = "const " + ctype
        for i, s in enumerate(stars):
            nxt = stars[i + 1] if i + 1 < len(stars) else len(tokens)
            ctype += "*" + (" const" if "const" in tokens[s + 1:nxt] and nxt != len(tokens)
                            else "")
        return Param(name, ctype, "pointer", const)
    base = " ".join(t for t in tokens if t != "const")
    handle = base[2:] if base.startswith("::") else base
    if handle in HANDLE_TYPES:
        return Param(name, handle, "handle", False)
    ctype = _canonical(base)
    if ctype is None:
        raise unsupported(f"unsupported type {base!r}")
    return Param(name, ctype, "scalar", False)


def _canonical(base: str, allow_unknown: bool = False):
    b = re.sub(r"\s+", " ", base.strip())
    for prefix in ("::", "std::", "cuda::std::"):
        if b.startswith(prefix):
            b = b[len(prefix):]
    b = _ALIASES.get(b, b)
    if b in SCALAR_TYPES:
        return b
    return base.strip() if allow_unknown else None


def _find_declaration(text: str, kernel_name: str):
    """``(param list text, is_template)`` of the first ``__global__`` declaration of
    ``kernel_name``, or None."""
    pat = re.compile(r"\b" + re.escape(kernel_name) + r"\s*\(")
    for m in pat.finditer(text):
        start = max(text.rfind(";", 0, m.start()), text.rfind("}", 0, m.start()),
                    text.rfind("{", 0, m.start()))
        head = text[start + 1:m.start()]
        head = re.sub(r"^\s*#[^\n]*\n", "", head, flags=re.MULTILINE)
        if "__global__" not in head:
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "(":
                depth += 1
            elif text[i] == ")":
                depth -= 1
            i += 1
        if depth:
            return None
        return text[m.end():i - 1], bool(re.search(r"\btemplate\b", head))
    return None


def parse_params(source: str, kernel_name: str) -> tuple[Param, ...]:
    """Parse the parameters of ``__global__`` kernel ``kernel_name`` declared in ``source``.

    Raises `ParamDeclarationValueError` (a ``ValueError``) when no ``__global__`` declaration
    of that name is found, when it is a template (use ``name_expression=`` with explicit
    ``params=``), or for an unsupported parameter type.
    """
    text = _strip_comments(source)
    found = _find_declaration(text, kernel_name)
    if found is None:
        raise ParamDeclarationValueError(
            f"no __global__ declaration of {kernel_name!r} found in the source; pass params="
            " explicitly, e.g. params=(\"const float*\", \"float*\", \"int\")")
    plist, is_template = found
    if is_template:
        raise ParamDeclarationValueError(
            f"kernel {kernel_name!r} is a template: its parameters cannot be read from the"
            " source; pass params= explicitly, e.g. params=(\"const float*\", \"int\")")
    plist = plist.strip()
    if plist in ("", "void"):
        return ()
    return tuple(parse_param_decl(d, i, kernel=kernel_name)
                 for i, d in enumerate(_split_top_level(plist)))


def normalize_params(params) -> tuple[Param, ...]:
    """Explicit ``params=``: a sequence of `Param` objects or C type strings (optionally with
    names: ``"const float* x"``) -> tuple of `Param`. A single string is split at top-level
    commas. Raises `ParamDeclarationValueError` (a ``ValueError``) for unsupported types,
    `ParamDeclarationTypeError` (a ``TypeError``) for other items."""
    if isinstance(params, str):
        params = _split_top_level(params) if params.strip() else []
    try:
        params = list(params)
    except TypeError:
        raise ParamDeclarationTypeError(
            f"params= must be a sequence of C declarations (str) or Params, got"
            f" {type(params).__name__} {params!r}") from None
    out = []
    for i, p in enumerate(params):
        if isinstance(p, Param):
            out.append(p)
        elif isinstance(p, str):
            out.append(parse_param_decl(p, i))
        else:
            raise ParamDeclarationTypeError(f"params[{i}] must be a C type string or a Param,"
                                            f" got {type(p).__name__}")
    names = [p.name for p in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ParamDeclarationValueError(f"duplicate parameter names: {sorted(dup)}")
    return tuple(out)
