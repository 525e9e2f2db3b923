"""Plain-torch pieces shared by the engine emulators (``sglang_emulator.py``, ``eagle_reference_emulator.py``).

Nothing here knows our exporter or transformers' modeling classes: a Llama decoder layer (RMSNorm, neox
RoPE, grouped-query attention over an explicit key/value store, SwiGLU MLP), reading a drafter folder's
files, running the target the way an engine captures its hidden states, and turning an EAGLE-2 candidate
list (flat candidates + the parent index of each group of top-k) into root-to-node paths.

The emulators import this file by path (``tests/engines`` is not a package), so it stays import-free of
the tests.  Shape letters as in docs/architecture.md: T positions, m new rows, S stored entries, H hidden,
h heads, kvh key/value heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


class EngineLoadError(RuntimeError):
    """The engine would refuse this folder, crash on it, or load it with weights left uninitialised."""


class EngineUnsupported(EngineLoadError):
    """The engine has no code path for this target / drafter combination."""


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise EngineLoadError(f"{folder} has no config.json")
    return json.loads(path.read_text())


def read_safetensors(folder: Path, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``*.safetensors`` in ``folder`` (or only the files in ``names``)."""
    from safetensors.torch import load_file

    files = [Path(folder) / n for n in names] if names else sorted(Path(folder).glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if f.is_file():
            state.update(load_file(str(f)))
    return state


# --- layers -----------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(…, H) -> (…, H): weight * x / sqrt(mean(x^2) + eps), computed in float32."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) neox rotary tables for (m,) positions: cos, sin (m, hd)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (hd/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (m, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (m, hd)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (m, heads, hd) rotated with cos/sin (m, hd), rotate_half style (neox)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class KVStore:
    """Keys and values of every entry a draft layer has written, in write order: (S, kvh, hd) each."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_base: float


def linear(x: torch.Tensor, state: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return F.linear(x, state[prefix + ".weight"], state.get(prefix + ".bias"))


def attention(x: torch.Tensor, positions: torch.Tensor, state: dict[str, torch.Tensor], prefix: str, dims: Dims,
              store: KVStore, visible_old: torch.Tensor, causal_new: bool) -> torch.Tensor:
    """Self-attention of m new rows x (m, in) at ``positions`` (m,).

    The new keys/values are appended to ``store``. Row i attends to the stored entries where
    ``visible_old`` (m, S_before) is True, and to the new entries j <= i (``causal_new``) or j == i.
    Returns o_proj output (m, H)."""
    m = x.shape[0]
    q = linear(x, state, prefix + ".q_proj").view(m, dims.heads, dims.head_dim)  # (m, h, hd)
    k = linear(x, state, prefix + ".k_proj").view(m, dims.kv_heads, dims.head_dim)  # (m, kvh, hd)
    v = linear(x, state, prefix + ".v_proj").view(m, dims.kv_heads, dims.head_dim)
    cos, sin = rope_cos_sin(positions, dims.head_dim, dims.rope_base)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    before = len(store)
    store.keys.extend(k.unbind(0))
    store.values.extend(v.unbind(0))
    K = torch.stack(store.keys)  # (S, kvh, hd)
    Vv = torch.stack(store.values)
    rep = dims.heads // dims.kv_heads
    K, Vv = K.repeat_interleave(rep, dim=1), Vv.repeat_interleave(rep, dim=1)  # (S, h, hd)
    new = torch.ones(m, m, dtype=torch.bool).tril() if causal_new else torch.eye(m, dtype=torch.bool)
    visible = torch.cat([visible_old.reshape(m, before), new], dim=1)  # (m, S)
    scores = torch.einsum("mhd,shd->hms", q, K) / math.sqrt(dims.head_dim)  # (h, m, S)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.einsum("hms,shd->mhd", probs, Vv).reshape(m, dims.heads * dims.head_dim)  # (m, h*hd)
    return linear(out, state, prefix + ".o_proj")


def swiglu(x: torch.Tensor, state: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return linear(F.silu(linear(x, state, prefix + ".gate_proj")) * linear(x, state, prefix + ".up_proj"),
                  state, prefix + ".down_proj")


# --- the target ---------------------------------------------------------------------------------------

_PREFILLS: dict = {}


@torch.inference_mode()
def target_prefill(target, prompt_ids: list[int]) -> tuple[tuple[torch.Tensor, ...], int]:
    """The target over the prompt: hidden states (transformers numbering: index 0 the embeddings, index j
    the input of decoder layer j = output of layer j-1, the last one after the final norm), each (T, H),
    and the greedy next token (the bonus). The last few results are kept (the target is frozen)."""
    key = (id(target), tuple(prompt_ids))
    if key not in _PREFILLS:
        out = target(input_ids=torch.tensor([list(prompt_ids)]), output_hidden_states=True, use_cache=False)
        if len(_PREFILLS) >= 8:
            _PREFILLS.pop(next(iter(_PREFILLS)))
        _PREFILLS[key] = (tuple(h[0] for h in out.hidden_states), int(out.logits[0, -1].argmax()))
    return _PREFILLS[key]


def text_config(target):
    return target.config.get_text_config()


# --- weights ------------------------------------------------------------------------------------------

def llama_layer_spec(dims, intermediate: int, prefix: str, attn_in: int, input_norm: bool,
                     qkv_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Llama decoder layer as both engines build it (q/k/v read ``attn_in``
    features: 2H in EAGLE-3's first layer); ``input_norm`` False for EAGLE-1's layer 0."""
    d, I = dims, intermediate
    spec = {f"{prefix}.self_attn.q_proj.weight": (d.heads * d.head_dim, attn_in),
            f"{prefix}.self_attn.k_proj.weight": (d.kv_heads * d.head_dim, attn_in),
            f"{prefix}.self_attn.v_proj.weight": (d.kv_heads * d.head_dim, attn_in),
            f"{prefix}.self_attn.o_proj.weight": (d.hidden, d.heads * d.head_dim),
            f"{prefix}.mlp.gate_proj.weight": (I, d.hidden), f"{prefix}.mlp.up_proj.weight": (I, d.hidden),
            f"{prefix}.mlp.down_proj.weight": (d.hidden, I),
            f"{prefix}.post_attention_layernorm.weight": (d.hidden,)}
    if input_norm:
        spec[f"{prefix}.input_layernorm.weight"] = (d.hidden,)
    if qkv_bias:
        for p in ("q", "k", "v"):
            spec[f"{prefix}.self_attn.{p}_proj.bias"] = (spec[f"{prefix}.self_attn.{p}_proj.weight"][0],)
    return spec


# --- trees ----------------------------------------------------------------------------------------------

def paths_from_parents(tokens: list[int], parent_of: list[int]) -> list[tuple[int, ...]]:
    """Root-to-node token paths of nodes with ``parent_of[i]`` = index of the parent node or -1."""
    paths = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parent_of[j]
        paths.append(tuple(reversed(path)))
    return paths
