"""Splitting the crammed-BERT MLM model into SWARM pipeline stages, and assembling the stages back.

Stage 0 holds the embeddings and its share of the transformer layers; middle stages hold layers only; the last
stage holds its layers, the final norm and the MLM head, and computes the loss. With one stage the module is
the whole model (input ids and labels in, loss out). Each stage is an independent deep copy, so stage
replicas on different peers never share storage.

Weight tying: crammed BERT ties the decoder to the word embeddings. Stages live on different peers, so with
two or more stages the last stage holds its OWN copy of the decoder weight (initialised equal to the word
embeddings, then trained separately: the two copies receive different gradients). ``assemble_model`` therefore
returns a model whose config says ``tie_word_embeddings=False``; its state dict has exactly the keys of a
crammed checkpoint, and the encoder (what GLUE fine-tuning reads) is unaffected by the untying.

Narrowing compression (``swarm.compression`` bottleneck2/4, maxout2/4; :func:`build_swarm_model`): the model
holds a bottleneck or maxout layer after the last layer of every stage but the last
(``CrammedBertConfig.boundary_*``). A stage gets its sending half (``send``, after its layers) and the next stage
its widening projection (``receive``, before its layers), so only the narrowed tensor crosses; the assembled
model (and its checkpoint) holds the whole layers again under ``bert.boundaries.<layer>``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cramswarm.swarm.compression import narrowing, split_narrowing


class StageCountError(ValueError):
    """``swarm.stages`` does not divide the model's layer count."""


class Stage(nn.Module):
    """A contiguous slice of crammed BERT. ``forward(x, labels=None)``: x = input ids for the first stage,
    hidden states otherwise; returns hidden states, or the MLM loss (a scalar) for the last stage."""

    def __init__(self, config: CrammedBertConfig, index: int, num_stages: int, embeddings: nn.Module | None,
                 layers: list[nn.Module], final_norm: nn.Module | None, head: nn.Module | None,
                 receive: nn.Module | None = None, send: nn.Module | None = None):
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.sparse_prediction = config.sparse_prediction
        self.embeddings = embeddings
        self.receive = receive   # widening projection of the narrowed tensor from the previous stage
        self.layers = nn.ModuleList(layers)
        self.send = send         # narrowing half of the boundary layer after this stage's layers
        self.final_norm = final_norm
        self.head = head

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.embeddings is not None:
            x = self.embeddings(x)
        if self.receive is not None:
            x = self.receive(x)
        for layer in self.layers:
            x = layer(x, None)
        if self.head is None:
            return x if self.send is None else self.send(x)
        if labels is None:
            raise ValueError(f"stage {self.index} is the last stage: it needs labels to compute the loss")
        hidden = self.final_norm(x)
        # The same loss as CrammedBertForMaskedLM.forward (sparse: decode the masked positions only).
        if self.sparse_prediction:
            selected = labels.view(-1) != -100
            logits = self.head(hidden.view(-1, hidden.shape[-1])[selected])
            return F.cross_entropy(logits.float(), labels.view(-1)[selected])
        logits = self.head(hidden)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def check_stage_count(num_layers: int, num_stages: int) -> int:
    """Layers per stage; raises StageCountError naming ``swarm.stages`` when it does not divide the layers."""
    if num_stages < 1:
        raise StageCountError(f"swarm.stages={num_stages}: need at least one pipeline stage")
    if num_layers % num_stages:
        raise StageCountError(
            f"swarm.stages={num_stages} does not divide the model's {num_layers} layers "
            f"(choose a divisor of {num_layers})"
        )
    return num_layers // num_stages


def stage_ends(num_layers: int, num_stages: int) -> list[int]:
    """The last layer (0-based) of every stage but the last: where narrowing boundary layers go."""
    per_stage = check_stage_count(num_layers, num_stages)
    return [(index + 1) * per_stage - 1 for index in range(num_stages - 1)]


def build_swarm_model(arch: dict, vocab_size: int, seed: int, num_stages: int,
                      compression: str) -> CrammedBertForMaskedLM:
    """The model a swarm trains: ``training.build_model`` (dropout 0), plus for a narrowing ``compression`` a
    bottleneck or maxout layer at every stage boundary (ValueError naming ``swarm.compression`` if that needs
    two stages or a width the factor divides)."""
    from cramswarm.training import build_model

    narrow = narrowing(compression)
    if narrow is None:
        return build_model(arch, vocab_size, seed)
    kind, factor = narrow
    if num_stages < 2:
        raise ValueError(f"swarm.compression={compression} narrows the stage boundaries: it needs swarm.stages >= 2 "
                         f"(got {num_stages})")
    if arch["hidden_size"] % factor:
        raise ValueError(f"swarm.compression={compression}: the factor {factor} does not divide the hidden size "
                         f"{arch['hidden_size']}")
    torch.manual_seed(seed)
    config = CrammedBertConfig.from_arch(
        arch, vocab_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, boundary_kind=kind,
        boundary_factor=factor, boundary_layers=stage_ends(arch["layers"], num_stages),
    )  # fmt: skip
    return CrammedBertForMaskedLM(config)


def split_model(model: CrammedBertForMaskedLM, num_stages: int) -> list[nn.Module]:
    """Deep copies of the model's slices, one ``Stage`` per pipeline stage (see the module docstring)."""
    config = model.config
    per_stage = check_stage_count(config.num_hidden_layers, num_stages)
    bert = model.bert
    boundaries = getattr(bert, "boundaries", {})
    ends = stage_ends(config.num_hidden_layers, num_stages)
    if sorted(int(i) for i in boundaries) not in ([], ends):
        raise ValueError(f"the model's boundary layers sit after layers {sorted(int(i) for i in boundaries)}, "
                         f"not at the ends of {num_stages} stages ({ends})")
    halves = {int(i): split_narrowing(layer) for i, layer in boundaries.items()}
    stages = []
    for index in range(num_stages):
        first, last = index == 0, index == num_stages - 1
        start, end = index * per_stage, (index + 1) * per_stage
        parts = (
            bert.embeddings if first else None,
            list(bert.layers[start:end]),
            bert.final_norm if last else None,
            model.head if last else None,
            halves[start - 1][1] if start - 1 in halves else None,
            halves[end - 1][0] if end - 1 in halves else None,
        )
        # One deepcopy per stage: inside the single-stage model the decoder stays tied to the embeddings;
        # across stages the last stage gets its own copy of the decoder weight.
        embeddings, layers, final_norm, head, receive, send = copy.deepcopy(parts)
        stages.append(Stage(config, index, num_stages, embeddings, layers, final_norm, head, receive, send))
    return stages


def assemble_model(stages: list[nn.Module], config: CrammedBertConfig) -> CrammedBertForMaskedLM:
    """One ``CrammedBertForMaskedLM`` holding the stages' parameters (crammed state-dict layout).

    With several stages the decoder weight is the last stage's own copy, so the config is untied.
    """
    check_stage_count(config.num_hidden_layers, len(stages))
    config = copy.deepcopy(config)
    if len(stages) > 1:
        config.tie_word_embeddings = False
    model = CrammedBertForMaskedLM(config)
    state = {}
    layer = 0
    for stage in stages:
        for name, tensor in stage.state_dict().items():
            part, _, rest = name.partition(".")
            if part == "embeddings":
                state[f"bert.embeddings.{rest}"] = tensor
            elif part == "layers":
                local, _, tail = rest.partition(".")
                state[f"bert.layers.{layer + int(local)}.{tail}"] = tensor
            elif part == "final_norm":
                state[f"bert.final_norm.{rest}"] = tensor
            elif part == "head":
                state[f"head.{rest}"] = tensor
            elif part == "receive":   # the widening projection of the boundary layer before this stage
                state[f"bert.boundaries.{layer - 1}.up.{rest}"] = tensor
            elif part == "send":      # the narrowing half of the boundary layer after this stage
                state[f"bert.boundaries.{layer + len(stage.layers) - 1}.{rest}"] = tensor
            else:
                raise ValueError(f"unexpected stage parameter {name!r}")
        layer += len(stage.layers)
    if len(stages) == 1:
        state.setdefault("head.decoder.weight", state["bert.embeddings.word_embeddings.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_table")]:
        raise ValueError(f"stages do not fit the config: missing {missing}, unexpected {unexpected}")
    return model
