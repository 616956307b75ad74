"""A Hugging Face DeepSeek-V3 ``config.json`` as :class:`~harness.reference.model.DeepseekV3Config` fields.

Every key of the file is accounted for, so that a checkpoint config never silently trains a
model other than the one it describes:

* a key named like a field sets it (``hidden_size``, ``n_group``, ``scoring_func``, ...);
* ``rope_parameters`` (``rope_scaling`` in older files) is flattened: its ``factor`` sets
  ``rope_factor``, ``type`` or ``rope_type`` sets ``rope_type``, and so on;
* a key in :data:`FIXED` must hold the one value the reference (and Hugging Face's model) implements;
* a key in :data:`IGNORED` changes nothing Hugging Face's ``DeepseekV3ForCausalLM`` computes in a
  training step; each says why;
* any other key is refused with :class:`HFConfigError` naming it.

Keys the file leaves out keep Hugging Face's defaults, which are the ``deepseek-v3`` config
(:data:`HF_BASE`). Types and domains are the caller's and DeepseekV3Config's to check.
"""

from __future__ import annotations

from typing import Any

from harness.reference.model import CONFIG_FIELDS

HF_BASE = "deepseek-v3"
# Keys of rope_parameters / rope_scaling -> the field each sets.
ROPE_PARAMETERS = {
    "rope_type": "rope_type",
    "type": "rope_type",
    "rope_theta": "rope_theta",
    "factor": "rope_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
    "attention_factor": "rope_attention_factor",
    "truncate": "rope_truncate",
}
# Fields only rope_parameters sets; rope_theta may also stand at the top level (older files).
_TOP_LEVEL_FIELDS = tuple(f for f in CONFIG_FIELDS if f == "rope_theta" or f not in ROPE_PARAMETERS.values())
FIXED: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "topk_method": "noaux_tc",  # DeepSeek-V3's bias-corrected group-limited top-k; V2's methods differ
    "moe_layer_freq": 1,  # every layer after first_k_dense_replace is MoE, as Hugging Face builds it
    "attention_dropout": 0.0,  # Hugging Face applies it in training; the reference has no dropout
}
_NOT_COMPUTED = "Hugging Face's DeepseekV3ForCausalLM computes no such loss or module"
_STORAGE = "describes the checkpoint's stored weights; arms initialise their own and train in their dtype"
IGNORED: dict[str, str] = {
    "architectures": "names a class",
    "auto_map": "names remote code",
    "transformers_version": "provenance",
    "_name_or_path": "provenance",
    "torch_dtype": _STORAGE,
    "dtype": _STORAGE,
    "quantization_config": _STORAGE,
    "use_cache": "the inference KV cache",
    "bos_token_id": "generation only",
    "eos_token_id": "generation only",
    "max_position_embeddings": "the longest context; read only as YaRN's original length when that is missing",
    "head_dim": "Hugging Face sets it to qk_rope_head_dim",
    "qk_head_dim": "Hugging Face sets it to qk_nope_head_dim + qk_rope_head_dim",
    "pretraining_tp": "Hugging Face's DeepSeek-V3 does not read it",
    "ep_size": "DeepSeek's inference layout of experts",
    "output_router_logits": "extra outputs only",
    "num_nextn_predict_layers": f"multi-token prediction: {_NOT_COMPUTED}",
    "num_mtp_layers": f"multi-token prediction: {_NOT_COMPUTED}",
    "aux_loss_alpha": f"DeepSeek's expert-balance loss: {_NOT_COMPUTED}",
    "seq_aux": f"DeepSeek's expert-balance loss: {_NOT_COMPUTED}",
}


class HFConfigError(ValueError):
    """A config.json key the reference cannot honour; ``key`` is its dotted name in the file."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


def hf_config_fields(hf: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """``{field: (the key that set it, value)}`` for the fields a config.json sets.

    Raises HFConfigError for a key that would change the numerics in a way the reference does
    not implement, or that it does not know.
    """
    found: dict[str, tuple[str, Any]] = {}
    for key, value in hf.items():
        if key in FIXED:
            if value != FIXED[key]:
                raise HFConfigError(key, f"the reference implements only {FIXED[key]!r}, got {value!r}")
        elif key in _TOP_LEVEL_FIELDS:
            found[key] = (key, value)
        elif key not in IGNORED and key not in ("rope_parameters", "rope_scaling", "num_key_value_heads"):
            raise HFConfigError(key, "unknown key: it may change the numerics, and the reference does not implement it")
    found |= _rope_fields(hf, found)
    heads = found.get("num_attention_heads", (None, None))[1]
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise HFConfigError(
            "num_key_value_heads", f"MLA has one key per head: expected num_attention_heads {heads}, got {kv_heads}"
        )
    return found


def _rope_fields(hf: dict[str, Any], top_level: dict[str, tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
    """The rope_* fields of ``rope_parameters`` or ``rope_scaling`` (null or absent: default RoPE)."""
    given = [name for name in ("rope_parameters", "rope_scaling") if hf.get(name) is not None]
    if len(given) > 1:
        raise HFConfigError("rope_scaling", "set rope_parameters or rope_scaling, not both")
    if not given:
        return {}
    name = given[0]
    params = hf[name]
    if not isinstance(params, dict):
        raise HFConfigError(name, f"expected an object, got {params!r}")
    found: dict[str, tuple[str, Any]] = {}
    for key, value in params.items():
        if key not in ROPE_PARAMETERS:
            raise HFConfigError(f"{name}.{key}", f"unknown RoPE parameter (known: {', '.join(ROPE_PARAMETERS)})")
        field = ROPE_PARAMETERS[key]
        if field in found and found[field][1] != value:
            raise HFConfigError(f"{name}.{key}", f"contradicts {found[field][0]} = {found[field][1]!r}")
        if value is not None:  # Hugging Face reads a null parameter as unset
            found[field] = (f"{name}.{key}", value)
    if found.get("rope_type", (None, "default"))[1] == "yarn":
        if "rope_factor" not in found:
            raise HFConfigError(f"{name}.factor", "missing: YaRN needs the factor it stretches the context by")
        if "rope_original_max_position_embeddings" not in found and "max_position_embeddings" in hf:
            # Hugging Face's fallback: the pretraining context is the model's maximum.
            found["rope_original_max_position_embeddings"] = ("max_position_embeddings", hf["max_position_embeddings"])
    if "rope_theta" in found and "rope_theta" in top_level and found["rope_theta"][1] != top_level["rope_theta"][1]:
        raise HFConfigError(f"{name}.rope_theta", f"contradicts rope_theta = {top_level['rope_theta'][1]!r}")
    return found
