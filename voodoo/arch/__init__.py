"""Architecture adapters: only what cannot be derived from llama.cpp's converter -- a
tensor-parallel policy.

Which GGUF tensors are selectable, which HF parameters they hold and how (renames, Q/K
permutations, transposes, splits, scales, stacked experts) is derived at run time for any
architecture the pinned converter knows (:mod:`voodoo.tensormap`); the student gates HF
parameters through that map (:func:`voodoo.gates.install_param_gates`). An adapter adds, for
one family, the Megatron split of each tensor (``"column"``/``"row"``/None) and the module
layout the tensor-parallel student (:mod:`cluster.tp`) shards: :class:`TensorSpec`s keyed by
GGUF name, with the row permutation llama.cpp's converter applies (checked against the derived
map: :func:`voodoo.pipeline._tp_adapter` only uses an adapter whose tensors are exactly the
map's). A family without one trains on one device or layer-wise (``--device_map``).

Adapters register themselves with :func:`register`; :func:`get_adapter` picks one from an HF
config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

__all__ = [
    "TensorSpec", "Adapter", "UnsupportedArchitecture", "register", "get_adapter",
    "supported_architectures",
]

Role = Literal["attention", "non_attention"]
TP = Literal["column", "row"] | None


class UnsupportedArchitecture(ValueError):
    """No adapter is registered for a model's architecture."""


@dataclass
class TensorSpec:
    """One selectable tensor.

    Attributes:
        gguf_name: GGUF tensor name, the key of every per-tensor dict (``blk.0.attn_q.weight``).
        module_name: fully-qualified name of the torch module holding the weight
            (``model.layers.0.self_attn.q_proj``; for a tied embedding, the embedding module).
        kind: ``"linear"`` (an ``nn.Linear``) or ``"embedding"`` (an ``nn.Embedding``).
        shape: ``(n_rows, n_per_row)``: torch's ``(out_features, in_features)``, or
            ``(n_vocab, n_embd)`` for the embedding. GGUF's ``ne`` is the reverse.
        role: ``"attention"`` (attn_q/k/v/output) or ``"non_attention"``; picks the menu.
        tp: tensor-parallel split: ``"column"`` (output rows split), ``"row"`` (input columns
            split) or ``None`` (replicated).
        tied_to: other module names sharing this weight (``["lm_head"]`` for tied embeddings).
    """

    gguf_name: str
    module_name: str
    kind: Literal["linear", "embedding"]
    shape: tuple[int, int]
    role: Role
    tp: TP
    tied_to: list[str] = field(default_factory=list)

    @property
    def n_rows(self) -> int:
        return self.shape[0]

    @property
    def n_per_row(self) -> int:
        return self.shape[1]


class Adapter:
    """Base class of architecture adapters. Subclasses set :attr:`architectures` (through
    :func:`register`) and implement :meth:`selectable`; the permutation hooks default to the
    identity.

    Args:
        config: the model's HF ``PretrainedConfig`` (or anything with the same attributes).
    """

    #: HF ``architectures`` names this adapter handles (set by :func:`register`).
    architectures: tuple[str, ...] = ()
    #: HF ``model_type`` values this adapter handles (set by :func:`register`).
    model_types: tuple[str, ...] = ()

    def __init__(self, config: Any):
        self.config = config

    # ------------------------------------------------------------------ tensors
    def selectable(self, model) -> list[TensorSpec]:
        """The selectable tensors of ``model`` (an instance of the HF model class), in GGUF
        file order where known. Raises ValueError if the model's modules do not have the
        expected names or shapes."""
        raise NotImplementedError

    def gguf_names(self, model) -> list[str]:
        """GGUF names of :meth:`selectable`."""
        return [s.gguf_name for s in self.selectable(model)]

    # ------------------------------------------------------------ permutations
    def hf_rows_to_gguf(self, gguf_name: str, a):
        """Reorders the rows of ``a`` (numpy or torch, shape ``(n_rows, ...)``) from HF layout
        to the layout llama.cpp's converter writes for ``gguf_name``. Identity by default.
        Returns a new array/tensor of the same type and shape (or ``a`` itself)."""
        return a

    def gguf_rows_to_hf(self, gguf_name: str, a):
        """Inverse of :meth:`hf_rows_to_gguf`. Identity by default."""
        return a

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.architectures)})"


_REGISTRY: dict[str, type[Adapter]] = {}
_BY_MODEL_TYPE: dict[str, type[Adapter]] = {}


def register(*architectures: str, model_types: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator registering an :class:`Adapter` subclass for HF ``architectures``
    names (``"LlamaForCausalLM"``) and, as a fallback when a config has no
    ``architectures``, for ``model_types`` (``"llama"``).

    Raises ValueError when a name is already registered to another class."""
    if not architectures:
        raise ValueError("register() needs at least one architecture name")

    def deco(cls: type[Adapter]) -> type[Adapter]:
        if not (isinstance(cls, type) and issubclass(cls, Adapter)):
            raise TypeError(f"@register expects an Adapter subclass, got {cls!r}")
        for a in architectures:
            if a in _REGISTRY and _REGISTRY[a] is not cls:
                raise ValueError(f"architecture {a} is already registered to "
                                 f"{_REGISTRY[a].__name__}")
            _REGISTRY[a] = cls
        for m in model_types:
            _BY_MODEL_TYPE.setdefault(m, cls)
        cls.architectures = tuple(architectures)
        cls.model_types = tuple(model_types)
        return cls

    return deco


def supported_architectures() -> list[str]:
    """Registered HF architecture names, sorted."""
    return sorted(_REGISTRY)


def get_adapter(config: Any) -> Adapter:
    """The adapter for an HF config: looked up by ``config.architectures`` (first match),
    then by ``config.model_type``.

    Raises:
        UnsupportedArchitecture: no adapter is registered; the message names the model's
            architecture and the supported ones.
    """
    archs = list(getattr(config, "architectures", None) or [])
    for a in archs:
        if a in _REGISTRY:
            return _REGISTRY[a](config)
    mt = getattr(config, "model_type", None)
    if not archs and mt in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[mt](config)
    what = ", ".join(archs) if archs else f"model_type={mt!r}"
    raise UnsupportedArchitecture(
        f"no tensor-parallel adapter for {what} (tensor parallelism is available for "
        f"{', '.join(supported_architectures())}); train on one device or layer-wise with "
        "--device_map, which work for any architecture llama.cpp's converter knows")


# Adapters register themselves on import.
from . import llama  # noqa: E402,F401
