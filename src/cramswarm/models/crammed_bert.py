"""Crammed BERT (Geiping & Goldstein, arXiv 2212.14034, §4.2) as one self-contained transformers model.

The final crammed architecture is the default; each modification the paper makes to BERT is one config
switch, so an ablation flips one key (see config/schema.yaml, ``$defs.arch``):

==========================  ===========================  =====================================
switch                      crammed (default)            original BERT
==========================  ===========================  =====================================
``norm_scheme``             ``pre``  (x + f(LN(x)))      ``post`` (LN(x + f(x)))
``qkv_bias`` / ``use_bias`` off                          on
``ffn``                     ``glu`` gated GELU, halved   ``gelu``
``pos_embedding``           ``scaled-sinusoidal``        ``learned``
``embedding_norm``          on                           on
``final_norm``              on                           off
``head_transform``          off                          on (dense + GELU + LN before decoder)
``decoder_bias``            off                          on
``sparse_prediction``       on (only masked positions)   off
==========================  ===========================  =====================================

``sparse_prediction: static`` decodes a fixed number of positions per batch (``sparse_prediction_rate`` of them,
the masked ones first), so the shapes do not depend on the mask: no host sync and no ``torch.compile`` graph
break at the gather (the public code's approach).

The decoder is always tied to the word embeddings. There are no token-type embeddings: inputs carry
``input_ids`` and ``attention_mask`` only (a ``token_type_ids`` argument is accepted and ignored, so
pipelines built for BERT still run). Attention goes through ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import PrefixChange
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput

MODEL_TYPE = "crammed-bert"


class CrammedBertConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 32768,
        num_hidden_layers: int = 16,
        hidden_size: int = 768,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        norm_scheme: str = "pre",
        norm_eps: float = 1e-12,
        qkv_bias: bool = False,
        use_bias: bool = False,
        ffn: str = "glu",
        pos_embedding: str = "scaled-sinusoidal",
        max_position_embeddings: int = 128,
        embedding_norm: bool = True,
        final_norm: bool = True,
        head_transform: bool = False,
        decoder_bias: bool = False,
        sparse_prediction: bool | str = True,
        sparse_prediction_rate: float = 0.25,
        initializer_range: float = 0.02,
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        classifier_dim: int | None = None,
        classifier_dropout: float = 0.1,
        classifier_pooling: str = "cls",
        pad_token_id: int = 0,
        tie_word_embeddings: bool = True,
        boundary_kind: str | None = None,
        boundary_factor: int = 2,
        boundary_layers: list[int] | None = None,
        **kwargs,
    ):
        if norm_scheme not in ("pre", "post"):
            raise ValueError(f"norm_scheme must be 'pre' or 'post', got {norm_scheme!r}")
        if ffn not in ("glu", "gelu"):
            raise ValueError(f"ffn must be 'glu' or 'gelu', got {ffn!r}")
        if pos_embedding not in ("scaled-sinusoidal", "sinusoidal", "learned"):
            raise ValueError(f"pos_embedding must be scaled-sinusoidal, sinusoidal or learned, got {pos_embedding!r}")
        if classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling must be 'cls' or 'mean', got {classifier_pooling!r}")
        if sparse_prediction not in (True, False, "static"):
            raise ValueError(f"sparse_prediction must be true, false or 'static', got {sparse_prediction!r}")
        if not 0 < sparse_prediction_rate <= 1:
            raise ValueError(f"sparse_prediction_rate must be in (0, 1], got {sparse_prediction_rate!r}")
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}")
        if boundary_kind not in (None, "bottleneck", "maxout"):
            raise ValueError(f"boundary_kind must be bottleneck, maxout or None, got {boundary_kind!r}")
        if boundary_kind and (boundary_factor < 1 or hidden_size % boundary_factor):
            raise ValueError(f"boundary_factor {boundary_factor} must divide hidden_size {hidden_size}")
        if boundary_kind and not all(0 <= i < num_hidden_layers - 1 for i in boundary_layers or []):
            raise ValueError(f"boundary_layers {boundary_layers} must name layers before the last")
        self.vocab_size = vocab_size
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.norm_scheme = norm_scheme
        self.norm_eps = norm_eps
        self.qkv_bias = qkv_bias
        self.use_bias = use_bias
        self.ffn = ffn
        self.pos_embedding = pos_embedding
        self.max_position_embeddings = max_position_embeddings
        self.embedding_norm = embedding_norm
        self.final_norm = final_norm
        self.head_transform = head_transform
        self.decoder_bias = decoder_bias
        self.sparse_prediction = sparse_prediction
        self.sparse_prediction_rate = sparse_prediction_rate
        self.initializer_range = initializer_range
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.classifier_dim = classifier_dim or hidden_size
        self.classifier_dropout = classifier_dropout
        self.classifier_pooling = classifier_pooling
        # SWARM's compression-aware layers (cramswarm.swarm.compression): a bottleneck or maxout layer of this
        # factor after each of these layers (0-based); they are where a swarm's stage boundaries were
        self.boundary_kind = boundary_kind
        self.boundary_factor = boundary_factor
        self.boundary_layers = sorted(boundary_layers or []) if boundary_kind else []
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def from_arch(cls, arch: dict, vocab_size: int, **overrides) -> "CrammedBertConfig":
        """Build from a validated ``models.<name>.arch`` section of the workflow config."""
        return cls(
            vocab_size=vocab_size,
            num_hidden_layers=arch["layers"],
            hidden_size=arch["hidden_size"],
            num_attention_heads=arch["heads"],
            intermediate_size=arch["intermediate_size"],
            norm_scheme=arch["norm_scheme"],
            norm_eps=arch["norm_eps"],
            qkv_bias=arch["qkv_bias"],
            use_bias=arch["use_bias"],
            ffn=arch["ffn"],
            pos_embedding=arch["pos_embedding"],
            max_position_embeddings=arch["max_positions"],
            embedding_norm=arch["embedding_norm"],
            final_norm=arch["final_norm"],
            head_transform=arch["head_transform"],
            decoder_bias=arch["decoder_bias"],
            sparse_prediction=arch["sparse_prediction"],
            sparse_prediction_rate=arch.get("sparse_prediction_rate", 0.25),
            initializer_range=arch["init_std"],
            classifier_dim=arch["classifier_dim"],
            classifier_pooling=arch["classifier_pooling"],
            **overrides,
        )


def sinusoidal_table(positions: int, dim: int) -> torch.Tensor:
    """The fixed sin/cos table of Vaswani et al. (base 10000; sin on even, cos on odd features)."""
    pos = torch.arange(positions, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(positions, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table


class Embeddings(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.kind = config.pos_embedding
        if self.kind == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            table = sinusoidal_table(config.max_position_embeddings, config.hidden_size)
            self.register_buffer("position_table", table, persistent=False)
            # FLASH-style scaled sinusoid: one learnable scalar, initialised to 1/sqrt(d).
            scale = 1 / math.sqrt(config.hidden_size) if self.kind == "scaled-sinusoidal" else 1.0
            self.position_scale = nn.Parameter(torch.tensor(scale), requires_grad=self.kind == "scaled-sinusoidal")
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if self.kind == "learned":
            positions = self.position_embeddings.weight[:length]
        else:
            positions = self.position_table[:length] * self.position_scale
        return self.dropout(self.norm(self.word_embeddings(input_ids) + positions))


class Attention(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=config.use_bias)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout_p if self.training else 0.0
        if x.device.type == "cpu" and torch.is_grad_enabled() and torch.is_autocast_enabled("cpu"):
            # Training under CPU autocast: PyTorch's CPU flash-attention backward is about twice as slow in bf16
            # as in fp32 (measured: 2 cores, batch 32 x 128, 12 heads of 64), while attention holds few FLOPs.
            # Running the attention kernel in fp32 is the same function at higher precision and ~10 % faster per
            # training step at BERT-base shape (docs/history/benchmarks.md, b5ef320). Inference keeps the faster
            # bf16 forward.
            with torch.autocast("cpu", enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p)
            y = y.to(torch.get_autocast_dtype("cpu"))
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class FeedForward(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.gated = config.ffn == "glu"
        inner = config.intermediate_size // 2 if self.gated else config.intermediate_size
        self.dense_in = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.use_bias)
        self.dense_out = nn.Linear(inner, config.hidden_size, bias=config.use_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            # gelu(gate) * h with h and gate the two halves of dense_in's output, computed as two half-width
            # projections of the same weight: the same function and parameters, but the backward needs no
            # concatenated gradient (15 % faster forward + backward on an H200; benchmarks/glu_backward.py)
            bias = self.dense_in.bias
            w_h, w_gate = self.dense_in.weight.chunk(2, dim=0)
            b_h, b_gate = bias.chunk(2) if bias is not None else (None, None)
            return self.dense_out(F.gelu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_h, b_h))
        return self.dense_out(F.gelu(self.dense_in(x)))


class Layer(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.pre_norm = config.norm_scheme == "pre"
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn = FeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.attention(self.norm1(x), mask))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.attention(x, mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class CrammedBertPreTrainedModel(PreTrainedModel):
    config_class = CrammedBertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Layer"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, Embeddings) and module.kind != "learned":
            table = sinusoidal_table(module.position_table.shape[0], module.position_table.shape[1])
            init.copy_(module.position_table, table)
            scale = 1 / math.sqrt(self.config.hidden_size) if module.kind == "scaled-sinusoidal" else 1.0
            init.constant_(module.position_scale, scale)


class CrammedBertModel(CrammedBertPreTrainedModel):
    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        final = config.final_norm and config.norm_scheme == "pre"
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps) if final else nn.Identity()
        if config.boundary_layers:   # registered last: the other modules are initialised as without them
            from cramswarm.models.narrowing import make_narrowing

            kind, factor, eps = config.boundary_kind, config.boundary_factor, config.norm_eps
            self.boundaries = nn.ModuleDict(
                {str(i): make_narrowing(kind, config.hidden_size, factor, eps) for i in config.boundary_layers}
            )
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,  # accepted for BERT-style callers; the model has none
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"input of {input_ids.shape[1]} tokens exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask[:, None, None, :].bool()  # True = attend; broadcast over heads and queries
        x = self.embeddings(input_ids)
        boundaries = getattr(self, "boundaries", {})
        for i, layer in enumerate(self.layers):
            x = layer(x, mask)
            if str(i) in boundaries:
                x = boundaries[str(i)](x)
        return BaseModelOutput(last_hidden_state=self.final_norm(x))


class MLMHead(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        if config.head_transform:
            self.transform = nn.Sequential(
                nn.Linear(config.hidden_size, config.hidden_size, bias=config.use_bias),
                nn.GELU(),
                nn.LayerNorm(config.hidden_size, eps=config.norm_eps),
            )
        else:
            self.transform = nn.Identity()
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class CrammedBertForMaskedLM(CrammedBertPreTrainedModel):
    _tied_weights_keys = {"head.decoder.weight": "bert.embeddings.word_embeddings.weight"}

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.bert = CrammedBertModel(config)
        self.head = MLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.head.decoder = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """``labels`` hold the original token at masked positions and -100 elsewhere.

        With ``sparse_prediction`` and labels given, only the masked positions are decoded: the loss is the
        same as dense prediction, and ``logits`` has shape (masked positions, vocab) instead of
        (batch, length, vocab). With ``sparse_prediction: static`` the shape is (round(sparse_prediction_rate x
        batch x length), vocab) whatever the mask: see :meth:`_static_sparse`.
        """
        hidden = self.bert(input_ids, attention_mask=attention_mask).last_hidden_state
        if labels is not None and self.config.sparse_prediction == "static":
            return self._static_sparse(hidden.view(-1, hidden.shape[-1]), labels.view(-1))
        if labels is not None and self.config.sparse_prediction:
            selected = labels.view(-1) != -100
            logits = self.head(hidden.view(-1, hidden.shape[-1])[selected])
            loss = F.cross_entropy(logits.float(), labels.view(-1)[selected])
            return MaskedLMOutput(loss=loss, logits=logits)
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)

    def _static_sparse(self, hidden: torch.Tensor, labels: torch.Tensor) -> MaskedLMOutput:
        loss, logits = static_sparse_loss(self.head, hidden, labels, self.config.sparse_prediction_rate)
        return MaskedLMOutput(loss=loss, logits=logits)


def static_sparse_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                       rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits) of ``sparse_prediction: static`` over flat ``hidden`` (positions x width) and ``labels``:
    decode a fixed number of positions, ``round(rate x positions)``: the masked ones in position order, then
    unmasked ones (label -100, no share of the loss) to fill up, or the first masked ones only where more are masked
    than fit. With at least as many slots as masked positions the loss is the boolean gather's; the count comes
    from shapes alone, so nothing is read back from the device and ``torch.compile`` sees one static graph. (The
    swarm's last stage computes its loss with this too.)"""
    positions = labels.shape[0]
    count = min(positions, max(1, round(rate * positions)))
    order = torch.arange(positions, 0, -1, device=labels.device)  # earlier positions rank higher
    key = torch.where(labels != -100, order + positions, order)  # masked positions above all others
    chosen = torch.topk(key, count, sorted=True).indices
    logits = head(hidden[chosen])
    return F.cross_entropy(logits.float(), labels[chosen], ignore_index=-100), logits


class CrammedBertForSequenceClassification(CrammedBertPreTrainedModel):
    """A fresh pooler + classifier. ``classifier_pooling``: ``cls`` reads the first token ([CLS]), as the
    paper's GLUE setup (``zero_index``); ``mean`` averages the non-padding tokens (the public code's
    architecture default, ``avg``)."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.bert = CrammedBertModel(config)
        self.pooler = nn.Linear(config.hidden_size, config.classifier_dim)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.classifier_dim, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        hidden = self.bert(input_ids, attention_mask=attention_mask).last_hidden_state
        # The head runs in fp32 even under autocast: bf16 logits (8 mantissa bits) flatten regression
        # outputs such as STS-B scores, and the head's cost is negligible.
        if self.config.classifier_pooling == "mean" and attention_mask is not None:
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        elif self.config.classifier_pooling == "mean":
            pooled = hidden.mean(1)
        else:
            pooled = hidden[:, 0]
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            logits = self.classifier(self.dropout(torch.tanh(self.pooler(pooled.float()))))
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.float().squeeze(-1), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.long())
        return SequenceClassifierOutput(loss=loss, logits=logits)


def parameter_counts(arch: dict, vocab_size: int) -> tuple[int, int]:
    """(all parameters, those of the tied word embedding) of the masked-LM model, counted from its shapes
    on the meta device (no memory)."""
    with torch.device("meta"):
        model = CrammedBertForMaskedLM(CrammedBertConfig.from_arch(arch, vocab_size))
    total = sum(p.numel() for p in model.parameters())
    return total, model.bert.embeddings.word_embeddings.weight.numel()


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (whose state-dict keys lack the ``_orig_mod.`` prefix), else ``model``."""
    return getattr(model, "_orig_mod", model)


def register() -> None:
    """Make the Auto classes resolve ``model_type: crammed-bert`` (idempotent).

    Also registers a load-time key renaming with transformers' conversion mapping: a checkpoint saved from a
    ``torch.compile``-wrapped model (keys ``_orig_mod.bert....``, GitHub issue #34 of the original code) loads
    with ``from_pretrained``. The renaming only applies to keys that carry the prefix; a model built from scratch
    saves clean keys, and one loaded from a prefixed checkpoint re-saves with the prefix (transformers keeps the
    layout it loaded) unless saved with ``save_original_format=False``.
    """
    if get_checkpoint_conversion_mapping(MODEL_TYPE) is None:
        register_checkpoint_conversion_mapping(MODEL_TYPE, [PrefixChange(prefix_to_remove="_orig_mod")])
    try:
        AutoConfig.register(MODEL_TYPE, CrammedBertConfig)
    except ValueError:  # already registered
        return
    AutoModel.register(CrammedBertConfig, CrammedBertModel)
    AutoModelForMaskedLM.register(CrammedBertConfig, CrammedBertForMaskedLM)
    AutoModelForSequenceClassification.register(CrammedBertConfig, CrammedBertForSequenceClassification)
