"""How big a run's outer update is, from its published spec alone (no torch, no model built): for `doctor`'s
"seconds to upload one update at the measured rate".

The built-in GPT's parameter count is exact (train/models/gpt.py: tied embeddings, 4 x n_embd MLP, biases, LayerNorms);
a Hugging Face family's is estimated from its config (embeddings, attention with grouped KV heads, gated MLP),
close enough for a bandwidth estimate. Payload sizes follow wire/codecs.py `Codec.payload_bytes`.
"""

from __future__ import annotations

import json
import math

ENVELOPE_OVERHEAD_BYTES = 400
"""Header, signature and msgpack framing around the payload (wire/envelope.py), rounded up."""


def _int(d: dict, *keys: str, default: int = 0) -> int:
    for key in keys:
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def gpt_params(n_layer: int, n_embd: int, block_size: int, vocab_size: int) -> int:
    """Exact parameter count of the built-in GPT (train/models/gpt.py)."""
    d = n_embd
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab_size * d + block_size * d + n_layer * per_block + 2 * d


def _hf_params(model: dict, hf: dict) -> int:
    d = _int(hf, "hidden_size", "n_embd", default=_int(model, "n_embd"))
    layers = _int(hf, "num_hidden_layers", "n_layer", default=_int(model, "n_layer"))
    vocab = _int(hf, "vocab_size", default=_int(model, "vocab_size"))
    heads = _int(hf, "num_attention_heads", "n_head", default=_int(model, "n_head", default=1))
    kv_heads = _int(hf, "num_key_value_heads", default=_int(model, "n_kv_head", default=heads))
    family = str(hf.get("model_type") or model.get("arch") or "")
    if family == "gpt2":
        return gpt_params(layers, d, _int(hf, "n_positions", default=_int(model, "block_size")), vocab)
    ffn = _int(hf, "intermediate_size", default=_int(model, "ffn_hidden", default=64 * math.ceil(8 * d / 3 / 64)))
    head_dim = d // max(heads, 1)
    attention = 2 * d * d + 2 * d * kv_heads * head_dim
    tied = hf.get("tie_word_embeddings", False) is True
    return vocab * d * (1 if tied else 2) + layers * (attention + 3 * d * ffn + 2 * d) + d


def model_params(model: object) -> tuple[int, bool] | None:
    """(parameter count, exact?) of a spec's `model` section (a dict, as published); None if it names too little."""
    if not isinstance(model, dict):
        return None
    hf: dict = {}
    if isinstance(model.get("hf_config"), str) and model["hf_config"]:
        try:
            loaded = json.loads(model["hf_config"])
        except ValueError:
            loaded = None
        hf = loaded if isinstance(loaded, dict) else {}
    try:
        if model.get("arch") == "gpt" and not hf:
            dims = [_int(model, k) for k in ("n_layer", "n_embd", "block_size", "vocab_size")]
            return (gpt_params(*dims), True) if all(dims) else None
        count = _hf_params(model, hf)
    except (TypeError, ValueError):
        return None
    return (count, False) if count > 0 else None


def payload_bytes(codec: str, numel: int, block: int = 256) -> int | None:
    """Bytes of one compressed pseudo-gradient of `numel` values (wire/codecs.py); None for an unknown codec."""
    block = max(int(block), 1)
    if codec == "fp32":
        return 4 * numel
    if codec == "fp16":
        return 2 * numel
    if codec in ("int8", "int4"):
        bits = 8 if codec == "int8" else 4
        return 4 * math.ceil(numel / block) + math.ceil(numel * bits / 8)
    return None


def update_bytes(spec: object) -> tuple[int, int, bool, str] | None:
    """(bytes of one outer update on the wire, parameters, exact?, codec) of a published spec dict, or None."""
    if not isinstance(spec, dict) or not isinstance(spec.get("outer"), dict):
        return None
    counted = model_params(spec.get("model"))
    codec = spec["outer"].get("codec")
    if counted is None or not isinstance(codec, str):
        return None
    block = spec["outer"].get("codec_block", 256)
    payload = payload_bytes(codec, counted[0], block if isinstance(block, int) else 256)
    if payload is None:
        return None
    return payload + ENVELOPE_OVERHEAD_BYTES, counted[0], counted[1], codec
