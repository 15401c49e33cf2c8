"""Llama-style decoders: LlamaForCausalLM, MistralForCausalLM (llama.cpp converts both with its
``LlamaModel``, which permutes Q/K rows) and Qwen2ForCausalLM (same module names; llama.cpp's
``Qwen2Model`` converter does not permute).

Names follow llama.cpp's ``gguf-py/gguf/tensor_mapping.py`` for ``MODEL_ARCH.LLAMA`` /
``QWEN2``; the permutation is ``LlamaModel.permute`` in ``conversion/llama.py`` of the pinned
llama.cpp source (see :mod:`voodoo.llamacpp`).
"""

from __future__ import annotations

import re

from . import Adapter, TensorSpec, register

#: Decoder Linear (suffix of ``model.layers.{i}.``) -> (GGUF name stem, role, tensor parallel).
#: The TP split is Megatron's: q/k/v and gate/up split their output rows ("column"), o/down
#: their input columns ("row").
LINEARS: dict[str, tuple[str, str, str]] = {
    "self_attn.q_proj": ("attn_q", "attention", "column"),
    "self_attn.k_proj": ("attn_k", "attention", "column"),
    "self_attn.v_proj": ("attn_v", "attention", "column"),
    "self_attn.o_proj": ("attn_output", "attention", "row"),
    "mlp.gate_proj": ("ffn_gate", "non_attention", "column"),
    "mlp.up_proj": ("ffn_up", "non_attention", "column"),
    "mlp.down_proj": ("ffn_down", "non_attention", "row"),
}
EMBED_MODULE = "model.embed_tokens"
LM_HEAD_MODULE = "lm_head"
LAYER_PREFIX = "model.layers"

_BLK = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k)\.weight$")


def permute(w, n_head: int, n_head_kv: int | None = None):
    """llama.cpp's ``LlamaModel.permute`` (``conversion/llama.py``): HF rows -> GGUF rows.

    Within each head, HF stores the rotary halves as ``[first half | second half]``; llama.cpp
    interleaves them (``[0, d/2, 1, d/2+1, ...]``) for its non-NEOX RoPE. ``w`` is numpy or
    torch, shape ``(n_head * head_dim, ...)``; when ``n_head_kv`` is given and differs from
    ``n_head`` it is the number of heads (as for K with GQA). Raises ValueError when the rows
    do not split into heads of even size."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head: int, n_head_kv: int | None = None):
    """Inverse of :func:`permute`: GGUF rows -> HF rows (what transformers' GGUF loader does
    for llama Q/K). Same arguments and errors."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@register("LlamaForCausalLM", "MistralForCausalLM", model_types=("llama", "mistral"))
class LlamaAdapter(Adapter):
    """Llama / Mistral: 7 Linears per decoder layer + token embedding (+ ``output.weight`` when
    untied). Q/K rows are permuted as llama.cpp's converter does."""

    #: Whether llama.cpp's converter permutes Q/K rows for this family.
    permute_qk = True

    # ------------------------------------------------------------------ config
    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def n_head(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def n_head_kv(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.n_head)

    def tied(self, model=None) -> bool:
        """Whether lm_head shares the token embedding: the modules' weights are the same
        tensor, or (without a model) ``config.tie_word_embeddings``."""
        if model is not None:
            try:
                emb = model.get_submodule(EMBED_MODULE).weight
                head = model.get_submodule(LM_HEAD_MODULE).weight
                return emb is head or emb.data_ptr() == head.data_ptr()
            except AttributeError:
                pass
        return bool(getattr(self.config, "tie_word_embeddings", False))

    # ------------------------------------------------------------------ tensors
    def selectable(self, model) -> list[TensorSpec]:
        """``token_embd.weight`` (tied_to ``["lm_head"]`` when tied), then per layer
        attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down, then
        ``output.weight`` when untied. Shapes are read from the modules (torch
        ``(out, in)``). Raises ValueError when a module is missing or not 2-D."""
        tied = self.tied(model)
        specs = [self._spec(model, EMBED_MODULE, "token_embd.weight", "embedding",
                            "non_attention", None, [LM_HEAD_MODULE] if tied else [])]
        for i in range(self.n_layers):
            for suffix, (stem, role, tp) in LINEARS.items():
                specs.append(self._spec(model, f"{LAYER_PREFIX}.{i}.{suffix}",
                                        f"blk.{i}.{stem}.weight", "linear", role, tp, []))
        if not tied:
            specs.append(self._spec(model, LM_HEAD_MODULE, "output.weight", "linear",
                                    "non_attention", None, []))
        return specs

    @staticmethod
    def _spec(model, module_name, gguf_name, kind, role, tp, tied_to) -> TensorSpec:
        try:
            w = model.get_submodule(module_name).weight
        except AttributeError as e:
            raise ValueError(f"expected a module {module_name!r} with a weight in "
                             f"{type(model).__name__}: {e}") from None
        if w.dim() != 2:
            raise ValueError(f"{module_name}.weight has shape {tuple(w.shape)}; expected 2-D")
        return TensorSpec(gguf_name, module_name, kind, (int(w.shape[0]), int(w.shape[1])),
                          role, tp, list(tied_to))

    # ------------------------------------------------------------ permutations
    def _heads(self, gguf_name: str) -> int | None:
        """Heads to permute over for ``gguf_name`` (None: not permuted)."""
        if not self.permute_qk:
            return None
        m = _BLK.match(gguf_name)
        if not m:
            return None
        return self.n_head if m.group(2) == "attn_q" else self.n_head_kv

    def hf_rows_to_gguf(self, gguf_name: str, a):
        """Q/K: :func:`permute` over ``n_head`` (attn_q) or ``n_head_kv`` (attn_k), as
        ``convert_hf_to_gguf.py`` does; other tensors unchanged. ``a``: ``(n_rows, ...)``."""
        h = self._heads(gguf_name)
        return a if h is None else permute(a, h)

    def gguf_rows_to_hf(self, gguf_name: str, a):
        """Inverse of :meth:`hf_rows_to_gguf`."""
        h = self._heads(gguf_name)
        return a if h is None else unpermute(a, h)


@register("Qwen2ForCausalLM", model_types=("qwen2",))
class Qwen2Adapter(LlamaAdapter):
    """Qwen2: llama's module names (q/k/v carry biases, which stay F32 and are not selectable);
    llama.cpp's ``Qwen2Model`` converter does not permute Q/K (NEOX RoPE)."""

    permute_qk = False
