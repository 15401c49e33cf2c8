"""The one table of ggml quant types, llama.cpp's shape fallbacks, menus and sizes in bytes.

Block sizes and bytes per block come from ``gguf``'s ``GGML_QUANT_SIZES`` (llama.cpp's
``gguf-py/gguf/constants.py``); bits per weight are derived from them (``8 * type_size /
block_size``), never typed in. The shape fallbacks are llama.cpp's ``tensor_type_fallback`` in
``src/llama-quant.cpp`` (pinned commit, see :mod:`voodoo.llamacpp`).

Every size in Voodoo is computed by :func:`tensor_nbytes`; nothing else multiplies bpw by
weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "QuantType", "TYPES", "qtype", "fallback_type", "tensor_nbytes", "build_menu",
    "DEFAULT_ATTENTION_MENU", "DEFAULT_NON_ATTENTION_MENU", "IMATRIX_REQUIRED",
    "requires_imatrix", "FTYPE_NOMINAL_BPW", "nearest_ftype", "Q8_0", "F16_MAX",
    "range_safe_menu", "imatrix_safe_menus", "GGML_IMATRIX_REQUIRED",
]

#: Types that can be candidates or fallbacks (floating types included for the F16 fallback).
_SUPPORTED = [
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0",
    "IQ4_XS", "IQ4_NL", "MXFP4", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS",
    "IQ1_M", "IQ1_S",
]

#: llama-quantize's ``tensor_requires_imatrix`` (``src/llama-quant.cpp``): these need an
#: imatrix except for ``token_embd.weight`` and ``output.weight``.
IMATRIX_REQUIRED = frozenset(["IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"])
_IMATRIX_EXEMPT = frozenset(["token_embd.weight", "per_layer_token_embd.weight", "output.weight"])


@dataclass(frozen=True)
class QuantType:
    """One ggml type.

    Attributes:
        name: ggml type name, e.g. ``"IQ2_XXS"``.
        ggml_type: its ``gguf.GGMLQuantizationType``.
        block_size: weights per block.
        type_size: bytes per block.
    """

    name: str
    ggml_type: GGMLQuantizationType
    block_size: int
    type_size: int

    @property
    def bpw(self) -> float:
        """Bits per weight, ``8 * type_size / block_size``."""
        return 8.0 * self.type_size / self.block_size

    @property
    def id(self) -> int:
        return int(self.ggml_type)

    def row_nbytes(self, n_per_row: int) -> int:
        """Bytes of one row; raises ValueError if ``n_per_row`` is not a multiple of the block."""
        if n_per_row % self.block_size:
            raise ValueError(f"{n_per_row} weights per row is not a multiple of {self.name}'s "
                             f"block size {self.block_size}")
        return n_per_row // self.block_size * self.type_size


def _build() -> dict[str, QuantType]:
    out = {}
    for name in _SUPPORTED:
        t = GGMLQuantizationType[name]
        bs, ts = GGML_QUANT_SIZES[t]
        out[name] = QuantType(name, t, bs, ts)
    return out


#: name -> QuantType, the single source of truth for type facts.
TYPES: dict[str, QuantType] = _build()
Q8_0 = TYPES["Q8_0"]


def qtype(t) -> QuantType:
    """Looks up a type by name (any case), ``GGMLQuantizationType``, id or QuantType.

    Raises ValueError naming the known types."""
    if isinstance(t, QuantType):
        return t
    if isinstance(t, GGMLQuantizationType):
        t = t.name
    elif isinstance(t, int):
        t = GGMLQuantizationType(t).name
    key = str(t).strip().upper()
    if key not in TYPES:
        raise ValueError(f"unknown or unsupported ggml type {t!r}{_did_you_mean(key)}; "
                         f"supported: {', '.join(TYPES)}")
    return TYPES[key]


def _did_you_mean(key: str) -> str:
    """`` (did you mean IQ4_XS?)`` for a type name that differs from a known one only in
    underscores, dashes, dots or spaces (``iq4xs``, ``Q4-K``), else ""."""
    import re
    squash = re.sub(r"[^0-9A-Z]", "", key)
    near = [n for n in TYPES if re.sub(r"[^0-9A-Z]", "", n) == squash]
    return f" (did you mean {near[0]}?)" if squash and len(near) == 1 else ""


#: ``tensor_type_fallback`` in llama.cpp ``src/llama-quant.cpp``: a 256-block type whose row
#: length is not a multiple of 256 is written as this 32-block type instead.
_FALLBACK = {
    "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL",
    "IQ2_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL",
    "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}


def fallback_type(t, n_per_row: int) -> QuantType:
    """The type llama.cpp actually writes when asked for ``t`` on rows of ``n_per_row``.

    Rule (``tensor_type_fallback``, llama.cpp ``src/llama-quant.cpp``): if ``n_per_row`` is not
    a multiple of the block size, 256-block types fall back to a 32-block type (table above);
    if even that does not fit (or the type is already a 32-block type), F16.

    Raises ValueError for a type that has no fallback (as llama.cpp does)."""
    q = qtype(t)
    if n_per_row % q.block_size == 0:
        return q
    if q.name in _FALLBACK:
        r = TYPES[_FALLBACK[q.name]]
    elif q.block_size <= 32:
        r = q
    else:
        raise ValueError(f"no tensor type fallback is defined for type {q.name}")
    if n_per_row % r.block_size:
        r = TYPES["F16"]
    return r


#: the largest finite float16 magnitude; larger weights become inf in F16
F16_MAX = 65504.0


def range_safe_menu(menu, max_abs: float) -> list[str]:
    """``menu`` (type names) with F16 replaced by BF16 when the tensor's largest weight
    magnitude ``max_abs`` exceeds float16's range (:data:`F16_MAX`): llama.cpp's F16 (its
    shape fallback, :func:`fallback_type`) would write inf, which ``ggml_validate_row_data``
    rejects (llama-quantize stops with "quantized data validation failed"). BF16 holds the
    float32 range in the same 2 bytes per weight, so sizes are unchanged; written as ``=bf16``
    in the tensor-type file, llama-quantize reproduces it. Duplicates are dropped."""
    out = []
    for t in menu:
        t = qtype(t).name
        if t == "F16" and not max_abs <= F16_MAX:
            t = "BF16"
        if t not in out:
            out.append(t)
    return out


def tensor_nbytes(t, n_rows: int, n_per_row: int) -> int:
    """Bytes llama.cpp writes for a (n_rows, n_per_row) tensor asked to be ``t``: the
    fallback type's row size times ``n_rows`` (GGUF's 32-byte alignment padding excluded)."""
    return n_rows * fallback_type(t, n_per_row).row_nbytes(n_per_row)


#: libggml's ``ggml_quantize_requires_imatrix`` (``ggml/src/ggml.c``): these abort in
#: ``ggml_quantize_chunk`` without an imatrix row, whatever the tensor's name.
GGML_IMATRIX_REQUIRED = frozenset(["IQ2_XXS", "IQ2_XS", "IQ1_S"])


def requires_imatrix(t, tensor_name: str | None = None) -> bool:
    """Whether ``t`` cannot be written for ``tensor_name`` without an imatrix row: llama-quantize's
    ``tensor_requires_imatrix`` rule (see :data:`IMATRIX_REQUIRED`; ``token_embd.weight`` and
    ``output.weight`` exempt), and for every tensor libggml's own rule
    (:data:`GGML_IMATRIX_REQUIRED`; llama-quantize aborts on those, e.g. an untied
    ``token_embd.weight``, read only by get_rows, has no imatrix row)."""
    name = qtype(t).name
    return (name in IMATRIX_REQUIRED and tensor_name not in _IMATRIX_EXEMPT) or \
        name in GGML_IMATRIX_REQUIRED


def imatrix_safe_menus(menus, imatrix) -> tuple[dict, dict]:
    """``menus`` (gguf_name -> type names) without the types a tensor cannot have because the
    imatrix holds no row for it (:func:`requires_imatrix`; ``imatrix`` None: no tensor has
    one). A menu that would become empty is kept whole (the candidate stage then names the
    problem). Returns ``(menus, dropped)``, ``dropped``: gguf_name -> the types removed."""
    out, dropped = {}, {}
    for name, menu in menus.items():
        if imatrix is not None and imatrix.get(name) is not None:
            out[name] = list(menu)
            continue
        keep = [t for t in menu if not requires_imatrix(t, name)]
        out[name] = keep if keep else list(menu)
        if keep and len(keep) < len(menu):
            dropped[name] = [t for t in menu if t not in keep]
    return out, dropped


def build_menu(types, n_per_row: int) -> list[QuantType]:
    """A tensor's candidate menu: each requested type mapped through :func:`fallback_type`,
    duplicates dropped, ordered from most to fewest bits per weight (ties keep the request
    order). A menu never holds a type llama.cpp would not write for that row length."""
    seen, out = set(), []
    for t in types:
        r = fallback_type(t, n_per_row)
        if r.name not in seen:
            seen.add(r.name)
            out.append(r)
    order = {q.name: i for i, q in enumerate(out)}
    return sorted(out, key=lambda q: (-q.bpw, order[q.name]))


#: Default menus (fine rungs). Attention tensors are small and sensitive, so their menu stops
#: at IQ2_S; the rest go down to IQ1_S. The rest also hold Q5_1: a 32-block type, whose matmul
#: rounds activations per 32 values on llama.cpp's CPU backend instead of per 256 (Q8_K) as
#: every K/IQ type does (voodoo.actround); at SmolLM2's Q4_K_M size four ffn_down took it and
#: the KLD went 0.0085 -> 0.0078 (docs/method.md).
DEFAULT_ATTENTION_MENU = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S", "IQ2_S")
DEFAULT_NON_ATTENTION_MENU = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q4_K", "IQ4_XS", "IQ3_S",
                              "IQ3_XXS", "IQ2_S", "IQ2_XXS", "IQ1_S")

#: Nominal bits per weight of llama.cpp's file types, from the ``QUANT_OPTIONS`` table of
#: ``tools/quantize/quantize.cpp``: types described by "N bpw" take N; types described by a
#: Llama-3-8B file size take ``size / 7.96 GB (its Q8_0) * 8.5``.
_FTYPE_DESC = {
    "IQ1_S": ("bpw", 1.56), "IQ1_M": ("bpw", 1.75), "IQ2_XXS": ("bpw", 2.06),
    "IQ2_XS": ("bpw", 2.31), "IQ2_S": ("bpw", 2.5), "IQ2_M": ("bpw", 2.7),
    "Q2_K": ("G", 2.96), "IQ3_XXS": ("bpw", 3.06), "IQ3_XS": ("bpw", 3.3),
    "IQ3_S": ("bpw", 3.44), "Q3_K_S": ("G", 3.41), "IQ3_M": ("bpw", 3.66),
    "Q3_K_M": ("G", 3.74), "Q3_K_L": ("G", 4.03), "IQ4_XS": ("bpw", 4.25),
    "Q4_0": ("G", 4.34), "Q4_K_S": ("G", 4.37), "IQ4_NL": ("bpw", 4.50), "Q4_K_M": ("G", 4.58),
    "Q4_1": ("G", 4.78), "Q5_0": ("G", 5.21), "Q5_K_S": ("G", 5.21), "Q5_K_M": ("G", 5.33),
    "Q5_1": ("G", 5.65), "Q6_K": ("G", 6.14), "Q8_0": ("G", 7.96),
    # above Q8_0: a model whose rows are not a multiple of 32 keeps its tensors F16
    "F16": ("bpw", 16.0),
}
FTYPE_NOMINAL_BPW = {k: (v if kind == "bpw" else v / 7.96 * Q8_0.bpw)
                     for k, (kind, v) in _FTYPE_DESC.items()}


def nearest_ftype(bpw: float) -> str:
    """The llama.cpp file type whose nominal bpw is nearest ``bpw`` (the file-name badge)."""
    return min(FTYPE_NOMINAL_BPW, key=lambda k: (abs(FTYPE_NOMINAL_BPW[k] - bpw), k))
