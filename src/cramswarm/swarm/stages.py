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

from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM, static_sparse_loss
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
        self.sparse_prediction_rate = config.sparse_prediction_rate
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
        # The same loss as CrammedBertForMaskedLM.forward (sparse: decode the masked positions only; static: a fixed
        # number of positions, the masked ones first).
        if self.sparse_prediction == "static":
            return static_sparse_loss(self.head, hidden.view(-1, hidden.shape[-1]), labels.view(-1),
                                      self.sparse_prediction_rate)[0]
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


def swarm_config(arch: dict, vocab_size: int, num_stages: int, compression: str) -> CrammedBertConfig:
    """The config of the model a swarm trains: ``training.build_model``'s (dropout 0), plus for a narrowing
    ``compression`` a bottleneck or maxout layer at every stage boundary (ValueError naming ``swarm.compression``
    if that needs two stages or a width the factor divides)."""
    narrow = narrowing(compression)
    if narrow is None:
        return CrammedBertConfig.from_arch(arch, vocab_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    kind, factor = narrow
    if num_stages < 2:
        raise ValueError(f"swarm.compression={compression} narrows the stage boundaries: it needs swarm.stages >= 2 "
                         f"(got {num_stages})")
    if arch["hidden_size"] % factor:
        raise ValueError(f"swarm.compression={compression}: the factor {factor} does not divide the hidden size "
                         f"{arch['hidden_size']}")
    return CrammedBertConfig.from_arch(
        arch, vocab_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, boundary_kind=kind,
        boundary_factor=factor, boundary_layers=stage_ends(arch["layers"], num_stages),
    )  # fmt: skip


def build_swarm_model(arch: dict, vocab_size: int, seed: int, num_stages: int,
                      compression: str) -> CrammedBertForMaskedLM:
    """The whole model a swarm trains (:func:`swarm_config`), initialised from ``seed`` as
    ``training.build_model`` does. A stage peer builds only its stage: :func:`build_stage`."""
    config = swarm_config(arch, vocab_size, num_stages, compression)
    torch.manual_seed(seed)
    return CrammedBertForMaskedLM(config)


def _own_tensors(module: nn.Module) -> bool:
    return any(t is not None for t in (*module._parameters.values(), *module._buffers.values()))


def _place(module: nn.Module, device: torch.device) -> None:
    """Give this module's OWN parameters and buffers (not its children's) fresh storage on ``device`` (contents
    undefined). New tensors, never in place: a parameter tied to another module's stays where it is."""
    for name, param in list(module._parameters.items()):
        if param is not None and param.device != device:
            module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device),
                                                    requires_grad=param.requires_grad)
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and buffer.device != device:
            module._buffers[name] = torch.empty_like(buffer, device=device)


def build_stage(arch: dict, vocab_size: int, seed: int, stage: int, num_stages: int,
                compression: str = "none", memory_cap_mb: float | None = None) -> Stage:
    """Stage ``stage`` of the swarm model, holding only that stage's parameters, bitwise equal to
    ``split_model(build_swarm_model(arch, vocab_size, seed, num_stages, compression), num_stages)[stage]``;
    the global RNG is left as ``build_swarm_model`` leaves it.

    How: the whole model is built on the ``meta`` device (shapes only), then its initialisation is replayed
    from ``torch.manual_seed(seed)`` in the order the real construction draws from the RNG: the constructors'
    ``reset_parameters`` of the encoder's modules (in construction order), the encoder's ``post_init``
    (``_init_weights`` children first), then the same for the MLM head, built after the encoder's
    ``post_init``. A module of another stage gets storage only while it is initialised (its draws must still
    be made), then goes back to ``meta``; so the peak is this stage's parameters plus the largest one module
    of another stage (the word embeddings, for stages but the first). The untied last stage's decoder weight
    is the word embeddings' initial value: the RNG is rewound to where the embeddings were initialised and
    the same draw made into the decoder weight, so the embeddings are never held there.

    ``memory_cap_mb`` (``swarm.peer_memory_cap_mb``): refuse, before allocating anything, a stage whose model
    state (:func:`stage_state_bytes`) is over this many MiB.
    """
    from cramswarm.models.crammed_bert import Embeddings

    config = swarm_config(arch, vocab_size, num_stages, compression)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} does not exist in a swarm of {num_stages} stages")
    with torch.device("meta"):
        model = CrammedBertForMaskedLM(config)
    tied = config.tie_word_embeddings
    embeddings, layers, final_norm, head, receive, send = _stage_parts(model, num_stages)[stage]
    parts = [part for part in (embeddings, *layers, final_norm, head, receive, send) if part is not None]
    if memory_cap_mb is not None:
        own = {id(p): p.numel() for part in parts for p in part.parameters()}   # a tied weight once
        state = [0] * num_stages
        state[stage] = STATE_BYTES_PER_PARAMETER * sum(own.values())
        check_memory_cap(state, memory_cap_mb)
    keep = {id(module) for part in parts for module in part.modules()}
    cpu, meta = torch.device("cpu"), torch.device("meta")
    words = model.bert.embeddings.word_embeddings
    rewind: list[torch.Tensor] = []   # RNG state just before the word embeddings' post_init draw

    def construct(root: nn.Module) -> None:   # what the constructors draw, in construction order
        for module in root.modules():
            if not _own_tensors(module):
                continue
            kept = id(module) in keep
            if kept:
                _place(module, cpu)
            if hasattr(module, "reset_parameters"):   # nn.Linear / nn.Embedding / nn.LayerNorm
                if not kept:
                    _place(module, cpu)
                module.reset_parameters()
                if not kept:
                    _place(module, meta)
            elif not isinstance(module, Embeddings):   # Embeddings' own tensors: no draw, set in post_init
                raise TypeError(f"build_stage does not know how {type(module).__name__} is initialised")

    def initialise(module: nn.Module) -> None:   # post_init: transformers' smart_apply, children first
        for child in module.children():
            initialise(child)
        if not _own_tensors(module):
            return
        kept = id(module) in keep
        if not kept:
            _place(module, cpu)
        if module is words and head is not None and embeddings is None and tied:
            rewind.append(torch.get_rng_state())
        model._init_weights(module)
        if not kept:
            _place(module, meta)

    torch.manual_seed(seed)
    with torch.no_grad():
        construct(model.bert)
        initialise(model.bert)
        construct(model.head)
        initialise(model.head)
        if head is not None and tied:
            if embeddings is not None:   # one stage: the decoder IS the word embeddings, as in the model
                head.decoder.weight = embeddings.word_embeddings.weight
            else:   # the last of several: its own copy, drawn again from the embeddings' RNG state
                end = torch.get_rng_state()
                torch.set_rng_state(rewind[0])
                own = words.weight
                words.weight = head.decoder.weight
                model._init_weights(words)
                words.weight = own
                torch.set_rng_state(end)
    result = Stage(config, stage, num_stages, embeddings, layers, final_norm, head, receive, send)
    left = [name for name, t in (*result.named_parameters(), *result.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"build_stage left {left} uninitialised")
    return result


STATE_BYTES_PER_PARAMETER = 16   # what a training peer holds per fp32 parameter: weight, gradient, AdamW's 2 moments
# What a stage peer holds per fp32 parameter at its peak, its in-stage step: the weight (4) and AdamW's two moments
# (8), and either the gradients (4) and the flat gradient vector gathered from them for the all-reduce (4; then
# divided in place, ``StageReplica.take_snapshot``), or that vector (or, in a group of several, the average that
# replaces it; 4) and AdamW's temporary (its foreach step allocates the square root of the second moment; 4).
# Serving a state download (``StagePeer._state_blob``) also holds the serialised weights and moments (12 more).
PEAK_BYTES_PER_PARAMETER = 20


def _stage_parameters(arch: dict, vocab_size: int, num_stages: int, compression: str) -> list[list[nn.Parameter]]:
    """Each stage's parameters (a tied one once), of the swarm model built on the ``meta`` device: no memory, the
    global RNG untouched. The last of several stages holds its own decoder copy."""
    with torch.device("meta"):
        model = CrammedBertForMaskedLM(swarm_config(arch, vocab_size, num_stages, compression))
    return [list(stage.parameters()) for stage in split_model(model, num_stages)]


def stage_state_bytes(arch: dict, vocab_size: int, num_stages: int, compression: str = "none") -> list[int]:
    """Bytes of model state (:data:`STATE_BYTES_PER_PARAMETER` per parameter, frozen ones too) each stage's peer
    holds, counted on the ``meta`` device (:func:`_stage_parameters`)."""
    return [STATE_BYTES_PER_PARAMETER * sum(p.numel() for p in params)
            for params in _stage_parameters(arch, vocab_size, num_stages, compression)]


def check_memory_cap(state_bytes: list[int], cap_mb: float | None) -> None:
    """ValueError naming ``swarm.peer_memory_cap_mb`` if a stage's state (``stage_state_bytes``) is over the cap
    (MiB); nothing when the cap is None."""
    if cap_mb is None:
        return
    over = [(i, b) for i, b in enumerate(state_bytes) if b > cap_mb * 2**20]
    if over:
        i, b = over[0]
        raise ValueError(f"swarm.peer_memory_cap_mb={cap_mb}: stage {i} of {len(state_bytes)} needs {b / 2**20:.2f} "
                         f"MiB of model state ({STATE_BYTES_PER_PARAMETER} bytes per parameter: weight, gradient, "
                         "AdamW moments); use more stages or a higher cap")


def rss_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident set size now (``VmRSS``) or its peak (``VmHWM``), in bytes, from
    ``/proc/self/status``; None where there is no such file (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024   # kB
    except OSError:
        pass
    return None


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager counting the bytes autograd saves for backward in a forward pass run inside it: the
    activations (and the decoder's logits) a backward call holds. Each storage counts once; storages of the
    ``exclude`` tensors (the stage's parameters: counted as model state) do not count. The tensors themselves are
    passed through unchanged (saved-tensor hooks that count and return the tensor as it is)."""

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: set[int] = set()
        self.bytes = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.exclude and key not in self.seen and tensor.device.type != "meta":
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedActivations":
        super().__enter__()
        return self


def stage_memory(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """What this process holds for its stage, for a peer's counters: its parameters' and the optimizer state's
    bytes, its parameter count, the process's peak resident set size so far (``ru_maxrss``) and its resident set
    size now (``rss_bytes``, None off Linux), all in bytes."""
    import resource

    params = list(module.parameters())
    state = [t for s in (optimizer.state.values() if optimizer else []) for t in s.values() if torch.is_tensor(t)]
    return {
        "stage_parameter_count": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,   # Linux: KiB
        "rss_bytes": rss_bytes(),
    }


def _stage_parts(model: CrammedBertForMaskedLM, num_stages: int) -> list[tuple]:
    """Per stage, the model's own modules it is made of: (embeddings, layers, final norm, head, receive, send)."""
    config = model.config
    per_stage = check_stage_count(config.num_hidden_layers, num_stages)
    bert = model.bert
    boundaries = getattr(bert, "boundaries", {})
    ends = stage_ends(config.num_hidden_layers, num_stages)
    if sorted(int(i) for i in boundaries) not in ([], ends):
        raise ValueError(f"the model's boundary layers sit after layers {sorted(int(i) for i in boundaries)}, "
                         f"not at the ends of {num_stages} stages ({ends})")
    halves = {int(i): split_narrowing(layer) for i, layer in boundaries.items()}
    parts = []
    for index in range(num_stages):
        first, last = index == 0, index == num_stages - 1
        start, end = index * per_stage, (index + 1) * per_stage
        parts.append((
            bert.embeddings if first else None,
            list(bert.layers[start:end]),
            bert.final_norm if last else None,
            model.head if last else None,
            halves[start - 1][1] if start - 1 in halves else None,
            halves[end - 1][0] if end - 1 in halves else None,
        ))  # fmt: skip
    return parts


def split_model(model: CrammedBertForMaskedLM, num_stages: int) -> list[nn.Module]:
    """Deep copies of the model's slices, one ``Stage`` per pipeline stage (see the module docstring)."""
    stages = []
    for index, parts in enumerate(_stage_parts(model, num_stages)):
        # One deepcopy per stage: inside the single-stage model the decoder stays tied to the embeddings;
        # across stages the last stage gets its own copy of the decoder weight.
        embeddings, layers, final_norm, head, receive, send = copy.deepcopy(parts)
        stages.append(Stage(model.config, index, num_stages, embeddings, layers, final_norm, head, receive, send))
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


def stage_parameter_counts(arch: dict, vocab_size: int, stages: int, compression: str = "none") -> list[int]:
    """Trainable parameters of each stage (a narrowing ``compression``'s boundary layers included), counted on the
    ``meta`` device (:func:`_stage_parameters`)."""
    return [sum(p.numel() for p in params if p.requires_grad)
            for params in _stage_parameters(arch, vocab_size, stages, compression)]
