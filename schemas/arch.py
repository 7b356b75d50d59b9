"""Model architectures: the catalog data-file contract (`schemas/catalog/*.yaml`).

The planner needs exact shapes, not marketing sizes: parameter counts drive weight, gradient and optimizer
memory; KV bytes per token and the linear-attention state drive rollout concurrency; the largest tensor sizes
the weight-sync bucket. Every count here is computed from the config fields with the formula in the docstring,
and a validator cross-checks it against the published size so that a mistyped field cannot pass unnoticed.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .target import numeric_field_names

PositiveInt = Annotated[int, Field(ge=1)]

#: Relative tolerance between the computed parameter count and the published one.
PARAM_TOLERANCE = 0.05

LayerKind = Literal["full", "linear", "mla"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AttentionArch(_Frozen):
    """How the token mixer works; decides KV-cache size and the attention parameter count."""

    kind: Literal["full", "linear-hybrid", "mla"] = Field(
        "full",
        description=(
            "full: softmax attention with a per-token KV cache (MHA/GQA) in every layer; linear-hybrid: most "
            "layers are linear attention with a fixed-size per-sequence state and every Nth layer is full "
            "attention; mla: DeepSeek multi-head latent attention, caching one compressed latent per token."
        ),
    )
    qkv_bias: bool = Field(False, description="Whether q/k/v projections carry a bias (Qwen2/2.5 do).")
    qk_norm: bool = Field(False, description="Whether per-head RMSNorm is applied to q and k (Qwen3 does).")
    output_gate: bool = Field(
        False,
        description="Gated attention: q_proj also emits a same-sized output gate (doubles q_proj's width).",
    )
    full_attention_interval: PositiveInt | None = Field(
        None,
        description="linear-hybrid only: every Nth layer (layer index i with (i+1) % N == 0) is full attention.",
    )
    linear_num_key_heads: PositiveInt | None = Field(
        None, description="linear-hybrid only: key (and query) heads of the linear-attention layers."
    )
    linear_num_value_heads: PositiveInt | None = Field(
        None, description="linear-hybrid only: value heads of the linear-attention layers."
    )
    linear_key_head_dim: PositiveInt | None = Field(
        None, description="linear-hybrid only: per-head key dimension of the linear-attention layers."
    )
    linear_value_head_dim: PositiveInt | None = Field(
        None, description="linear-hybrid only: per-head value dimension of the linear-attention layers."
    )
    linear_conv_kernel: PositiveInt | None = Field(
        None, description="linear-hybrid only: width of the causal depthwise convolution before the recurrence."
    )
    kv_lora_rank: PositiveInt | None = Field(
        None, description="mla only: rank of the compressed KV latent (what the cache stores per token)."
    )
    q_lora_rank: PositiveInt | None = Field(
        None, description="mla only: rank of the query low-rank projection; null for a full-rank q_proj."
    )
    qk_rope_head_dim: PositiveInt | None = Field(
        None, description="mla only: rotary part of each q/k head; the shared rope key is cached per token."
    )
    qk_nope_head_dim: PositiveInt | None = Field(
        None, description="mla only: non-rotary part of each q/k head, reconstructed from the latent."
    )
    v_head_dim: PositiveInt | None = Field(None, description="mla only: per-head value dimension.")

    @model_validator(mode="after")
    def _kind_fields(self) -> AttentionArch:
        linear = (
            "full_attention_interval",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel",
        )
        mla = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        required = {"full": (), "linear-hybrid": linear, "mla": mla}[self.kind]
        missing = [name for name in required if getattr(self, name) is None]
        if missing:
            raise ValueError(f"attention kind {self.kind!r} needs {', '.join(missing)}")
        allowed = (*required, "q_lora_rank") if self.kind == "mla" else required
        foreign = [
            name for name in (*linear, *mla, "q_lora_rank") if name not in allowed and getattr(self, name) is not None
        ]
        if foreign:
            raise ValueError(f"attention kind {self.kind!r} does not use {', '.join(foreign)}")
        return self


class MoeArch(_Frozen):
    """Mixture-of-experts FFN; total and active parameters diverge, so both are needed for memory and FLOPs."""

    num_experts: PositiveInt = Field(description="Routed experts per MoE layer.")
    experts_per_token: PositiveInt = Field(description="Routed experts activated per token (top-k).")
    expert_intermediate_size: PositiveInt = Field(description="FFN width of one routed expert (SwiGLU).")
    num_shared_experts: int = Field(0, ge=0, description="Always-active shared experts per MoE layer.")
    shared_expert_intermediate_size: PositiveInt | None = Field(
        None, description="FFN width of one shared expert; defaults to expert_intermediate_size."
    )
    first_dense_layers: int = Field(
        0, ge=0, description="Leading layers that use the dense FFN (intermediate_size) instead of experts."
    )

    @model_validator(mode="after")
    def _top_k(self) -> MoeArch:
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        return self


class ModelArch(_Frozen):
    """One model architecture, with HF config.json numbers and a source for each."""

    id: str = Field(description="Canonical catalog id, lower case; equals the file name without .yaml.")
    aliases: list[str] = Field(
        default_factory=list,
        description="Other names that resolve to this entry (HF repo ids, underscore spellings); case-insensitive.",
    )
    family: str = Field(description="Model family, e.g. qwen3, qwen2.5, deepseek-v3, rlc.")
    hf_architecture: str = Field(
        description="The `architectures[0]` of config.json, which selects the transformers/vLLM model class."
    )
    num_layers: PositiveInt = Field(description="Decoder layers (num_hidden_layers), excluding MTP layers.")
    hidden_size: PositiveInt = Field(description="Model width h.")
    num_attention_heads: PositiveInt = Field(description="Query heads n_q.")
    num_kv_heads: PositiveInt = Field(description="Key/value heads n_kv (GQA groups); for MLA the HF value.")
    head_dim: PositiveInt = Field(
        description="Per-head width d_h of full attention; for MLA qk_nope_head_dim + qk_rope_head_dim."
    )
    intermediate_size: PositiveInt = Field(
        description="Dense SwiGLU FFN width; for MoE models used only by the first_dense_layers (else unused)."
    )
    vocab_size: PositiveInt = Field(description="Vocabulary size V (embedding rows, logits width).")
    tie_word_embeddings: bool = Field(description="Whether the LM head shares the embedding matrix.")
    max_position_embeddings: PositiveInt = Field(
        description="config.json max_position_embeddings: longest context without extra rope scaling."
    )
    original_max_position_embeddings: PositiveInt | None = Field(
        None,
        description=(
            "Context the rope-scaling factor is relative to (YaRN original_max_position_embeddings, i.e. the "
            "pre-training context); null means max_position_embeddings."
        ),
    )
    rope_scaling_max_factor: float = Field(
        1.0,
        ge=1.0,
        description=(
            "Largest documented YaRN/rope scaling factor, applied to original_max_position_embeddings; "
            "1.0 when no scaling is documented."
        ),
    )
    attention: AttentionArch = Field(default_factory=AttentionArch, description="Token-mixer layout.")
    moe: MoeArch | None = Field(None, description="Mixture-of-experts settings; null for a dense model.")
    mtp_layers: int = Field(
        0, ge=0, description="Multi-token-prediction layers shipped with the checkpoint (0 if none)."
    )
    params_b: float = Field(gt=0, description="Published total parameters in billions (excluding MTP layers).")
    active_params_b: float = Field(gt=0, description="Published parameters active per token, in billions.")
    dtype: str = Field("bfloat16", description="Checkpoint dtype (config.json torch_dtype).")
    sources: dict[str, str] = Field(
        default_factory=dict,
        description="Field name -> source citation or uncertainty note. Every numeric field has an entry.",
    )

    # ------------------------------------------------------------------ validation

    @model_validator(mode="after")
    def _consistent(self) -> ModelArch:
        if self.id != self.id.lower():
            raise ValueError(f"id {self.id!r} must be lower case")
        required = numeric_field_names(type(self), nested=False)
        if self.attention.kind != "full":
            required.append("attention")
        if self.moe is not None:
            required.append("moe")
        missing = [name for name in required if name not in self.sources]
        if missing:
            raise ValueError(f"sources has no entry for {', '.join(missing)}")
        unknown = sorted(k for k in self.sources if k.split(".")[0] not in type(self).model_fields)
        if unknown:
            raise ValueError(f"sources names unknown fields: {', '.join(unknown)}")
        if self.active_params_b > self.params_b:
            raise ValueError(f"active_params_b {self.active_params_b} > params_b {self.params_b}")
        if self.moe is not None and self.moe.first_dense_layers > self.num_layers:
            raise ValueError("moe.first_dense_layers exceeds num_layers")
        if self.attention.kind == "full" and self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        for label, computed, published in (
            ("total", self.total_params(), self.params_b),
            ("active", self.active_params(), self.active_params_b),
        ):
            rel = abs(computed / 1e9 - published) / published
            if rel > PARAM_TOLERANCE:
                raise ValueError(
                    f"{label} parameters computed from the fields = {computed / 1e9:.3f}B, published "
                    f"{published}B ({rel:.1%} apart, tolerance {PARAM_TOLERANCE:.0%}): check the fields"
                )
        return self

    # ------------------------------------------------------------------ structure

    @property
    def is_moe(self) -> bool:
        """True when the FFN is a mixture of experts."""
        return self.moe is not None

    def layer_kind(self, index: int) -> LayerKind:
        """Token mixer of decoder layer `index`: full, linear (hybrid's fixed-state layers) or mla."""
        kind = self.attention.kind
        if kind == "mla":
            return "mla"
        if kind == "linear-hybrid":
            interval = self.attention.full_attention_interval or 1
            return "full" if (index + 1) % interval == 0 else "linear"
        return "full"

    def layer_is_moe(self, index: int) -> bool:
        """Whether decoder layer `index` uses experts (after moe.first_dense_layers dense layers)."""
        return self.moe is not None and index >= self.moe.first_dense_layers

    def num_full_attention_layers(self) -> int:
        """Layers that keep a per-token KV cache (all of them except hybrid's linear layers): for a hybrid, the
        layers i with (i + 1) % interval == 0 (`layer_kind`), i.e. num_layers // interval. Closed form because
        the planner asks for it per candidate engine."""
        if self.attention.kind != "linear-hybrid":
            return self.num_layers
        return self.num_layers // (self.attention.full_attention_interval or 1)

    def num_linear_attention_layers(self) -> int:
        """Hybrid layers with a fixed-size per-sequence state instead of a KV cache."""
        return self.num_layers - self.num_full_attention_layers()

    # ------------------------------------------------------------------ parameter counts

    def attention_params(self, kind: LayerKind) -> int:
        """Token-mixer parameters of one layer of `kind`.

        full:   h·n_q·d_h·(2 if output_gate) + 2·h·n_kv·d_h + n_q·d_h·h, + biases (n_q+2·n_kv)·d_h if
                qkv_bias, + 2·d_h if qk_norm.
        linear: (Gated DeltaNet) in_proj h·(2·n_k·d_k + 2·n_v·d_v) + h·2·n_v (beta, alpha)
                + conv (2·n_k·d_k + n_v·d_v)·kernel + 2·n_v (A_log, dt_bias) + d_v (gated norm)
                + out_proj n_v·d_v·h.
        mla:    q: h·r_q + r_q + r_q·n_q·(nope+rope) (or h·n_q·(nope+rope) without q_lora_rank);
                kv_a: h·(r_kv + rope) + r_kv; kv_b: r_kv·n_q·(nope + v); o: n_q·v·h.
        """
        a, h = self.attention, self.hidden_size
        if kind == "full":
            n_q, n_kv, d = self.num_attention_heads, self.num_kv_heads, self.head_dim
            q_out = n_q * d * (2 if a.output_gate else 1)
            count = h * q_out + 2 * h * n_kv * d + n_q * d * h
            if a.qkv_bias:
                count += q_out + 2 * n_kv * d
            if a.qk_norm:
                count += 2 * d
            return count
        if kind == "linear":
            n_k, n_v = a.linear_num_key_heads or 0, a.linear_num_value_heads or 0
            d_k, d_v = a.linear_key_head_dim or 0, a.linear_value_head_dim or 0
            conv_dim = 2 * n_k * d_k + n_v * d_v
            return (
                h * (2 * n_k * d_k + 2 * n_v * d_v)
                + h * 2 * n_v
                + conv_dim * (a.linear_conv_kernel or 0)
                + 2 * n_v
                + d_v
                + n_v * d_v * h
            )
        n_q = self.num_attention_heads
        rope, nope, v = a.qk_rope_head_dim or 0, a.qk_nope_head_dim or 0, a.v_head_dim or 0
        r_kv = a.kv_lora_rank or 0
        qk = nope + rope
        q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n_q * qk if a.q_lora_rank else h * n_q * qk
        return q + h * (r_kv + rope) + r_kv + r_kv * n_q * (nope + v) + n_q * v * h

    def ffn_params(self, moe_layer: bool, active: bool = False) -> int:
        """FFN parameters of one layer (SwiGLU: 3·h·f).

        Dense: 3·h·intermediate_size. MoE: E·3·h·f_e + n_shared·3·h·f_s + router h·E; with `active`, only the
        top-k routed experts count: k·3·h·f_e + n_shared·3·h·f_s + h·E.
        """
        h = self.hidden_size
        if not moe_layer or self.moe is None:
            return 3 * h * self.intermediate_size
        m = self.moe
        shared = m.num_shared_experts * 3 * h * (m.shared_expert_intermediate_size or m.expert_intermediate_size)
        routed = (m.experts_per_token if active else m.num_experts) * 3 * h * m.expert_intermediate_size
        return routed + shared + h * m.num_experts

    def layer_param_count(self, index: int, active: bool = False) -> int:
        """Parameters of decoder layer `index`: token mixer + FFN + two RMSNorms (2·h)."""
        return (
            self.attention_params(self.layer_kind(index))
            + self.ffn_params(self.layer_is_moe(index), active=active)
            + 2 * self.hidden_size
        )

    def max_layer_params(self) -> int:
        """Largest single decoder layer (total), e.g. to size an FSDP unit's transient all-gather."""
        return max(self.layer_param_count(i) for i in range(self.num_layers))

    def embedding_params(self) -> int:
        """Input embedding V·h, plus the LM head V·h when untied, plus the final norm h."""
        vh = self.vocab_size * self.hidden_size
        return vh * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def total_params(self) -> int:
        """All parameters excluding MTP layers: embeddings (+untied head) + Σ layers + final norm.

        MTP layers are excluded because published sizes exclude them (DeepSeek-V3: 671B, the checkpoint holds
        685B with the MTP module); see mtp_params().
        """
        return self.embedding_params() + sum(self.layer_param_count(i) for i in range(self.num_layers))

    def active_params(self) -> int:
        """Parameters touched per token: as total_params() with only top-k routed experts per MoE layer."""
        return self.embedding_params() + sum(self.layer_param_count(i, active=True) for i in range(self.num_layers))

    def mtp_params(self) -> int:
        """Parameters of the MTP module(s), sharing embedding and LM head with the main model.

        Per MTP layer: one decoder layer shaped like the last main layer + a 2h→h projection (2·h²)
        + three RMSNorms (embedding norm, hidden norm, output norm: 3·h).
        """
        if not self.mtp_layers:
            return 0
        h = self.hidden_size
        return self.mtp_layers * (self.layer_param_count(self.num_layers - 1) + 2 * h * h + 3 * h)

    def largest_param_numel(self) -> int:
        """Elements of the largest single tensor (the embedding V·h for every catalog model).

        The weight-sync bucket must hold it (verl NPU FAQ): bytes = numel × dtype bytes (fp32 under FSDP).
        """
        h = self.hidden_size
        candidates = [self.vocab_size * h, h * self.intermediate_size]
        if self.moe is not None:
            candidates.append(h * self.moe.expert_intermediate_size)
        if self.attention.kind != "mla":
            q_out = self.num_attention_heads * self.head_dim * (2 if self.attention.output_gate else 1)
            candidates.append(h * q_out)
        return max(candidates)

    # ------------------------------------------------------------------ cache sizes

    def kv_bytes_per_token(self, dtype_bytes: int = 2, include_mtp: bool = False) -> int:
        """KV-cache bytes per token summed over layers (vLLM, unsharded).

        full / linear-hybrid: 2·n_kv·d_h·L_full·bytes, where L_full counts only full-attention layers (all
        layers for kind full, every Nth for hybrid). mla: (kv_lora_rank + qk_rope_head_dim)·L·bytes.
        With `include_mtp`, the MTP layers (full attention or MLA) are added to the layer count.
        """
        a = self.attention
        extra = self.mtp_layers if include_mtp else 0
        if a.kind == "mla":
            return ((a.kv_lora_rank or 0) + (a.qk_rope_head_dim or 0)) * (self.num_layers + extra) * dtype_bytes
        layers = self.num_full_attention_layers() + extra
        return 2 * self.num_kv_heads * self.head_dim * layers * dtype_bytes

    def linear_state_bytes_per_sequence(self, dtype_bytes: int = 2, state_dtype_bytes: int = 4) -> int:
        """Fixed per-sequence state of the hybrid's linear layers, independent of length (0 otherwise).

        Per linear layer: recurrent state n_v·d_k·d_v·state_dtype_bytes (fp32 in vLLM, mamba_ssm_dtype)
        + conv state (2·n_k·d_k + n_v·d_v)·(kernel−1)·dtype_bytes.
        """
        a = self.attention
        if a.kind != "linear-hybrid":
            return 0
        n_k, n_v = a.linear_num_key_heads or 0, a.linear_num_value_heads or 0
        d_k, d_v = a.linear_key_head_dim or 0, a.linear_value_head_dim or 0
        ssm = n_v * d_k * d_v * state_dtype_bytes
        conv = (2 * n_k * d_k + n_v * d_v) * ((a.linear_conv_kernel or 1) - 1) * dtype_bytes
        return self.num_linear_attention_layers() * (ssm + conv)

    def max_scaled_context(self) -> int:
        """Longest context reachable with the documented rope scaling.

        max(max_position_embeddings, original_max_position_embeddings·rope_scaling_max_factor), where the
        original defaults to max_position_embeddings.
        """
        base = self.original_max_position_embeddings or self.max_position_embeddings
        return max(self.max_position_embeddings, int(base * self.rope_scaling_max_factor))
