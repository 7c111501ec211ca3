"""Fine-tune one checkpoint on one GLUE task with one seed (or several in one process), and score the last epoch
on validation.

One global hyperparameter set for every task (the paper's rule); the score reported is the last epoch's,
never the best. Batches are dynamically padded, and length-bucketed (examples of similar length batched
together inside shuffled pools) so short tasks don't pay for padding to the maximum length.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

import cramswarm.models  # noqa: F401  (registers crammed-bert with the Auto classes)
from cramswarm.data import tokenizer as tokenization
from cramswarm.data.sources import read_glue
from cramswarm.glue.metrics import compute_metrics
from cramswarm.glue_tasks import get_task
from cramswarm.io import write_json
from cramswarm.precision import autocast, choose_precision
from cramswarm.provenance import provenance
from cramswarm.training import resolve_device

BUCKET_POOL_BATCHES = 50  # batches per pool inside which examples are sorted by length
# Keys of a protocol (cramswarm.config.glue_protocol: a glue.protocols entry plus the shared settings).
PROTOCOL_KEYS = (
    "epochs",
    "batch_size",
    "lr",
    "schedule",
    "warmup_fraction",
    "weight_decay",
    "dropout",
    "max_length_tokens",
    "device",
)
WARMUP_KEYS = ("warmup_from_task", "warmup_reference_rows")  # optional: warmup_steps


def encode(tok, task: str, rows: list[dict], max_length: int) -> list[list[int]]:
    spec = get_task(task)
    tok.enable_truncation(max_length)
    tok.no_padding()
    if len(spec.text_columns) == 1:  # an empty second segment, as the reference: [CLS] A [SEP] [SEP]
        inputs = [(row[spec.text_columns[0]], "") for row in rows]
    else:
        first, second = spec.text_columns
        inputs = [(row[first], row[second]) for row in rows]
    return [enc.ids for enc in tok.encode_batch(inputs)]


def bucketed_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """Index batches; with ``rng`` shuffled pools sorted by length (training), else length-sorted (evaluation)."""
    if rng is None:
        order = np.argsort(lengths, kind="stable")
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    order = rng.permutation(len(lengths))
    pool = batch_size * BUCKET_POOL_BATCHES
    batches = []
    for start in range(0, len(order), pool):
        chunk = order[start : start + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def attention_backends(device: torch.device):
    """Where dynamic padding runs SDPA: on CUDA without its cuDNN backend, elsewhere unchanged.

    cuDNN attention builds a graph for every new (batch, length) shape, and dynamically padded batches bring
    many shapes. Measured on an H100 (torch 2.11, cuDNN 9.19, the default study's 2 x 256 model, batch 16): the
    first training step at a new shape took 130-460 ms with cuDNN attention and 11 ms without; steps at a shape
    already seen took 5.6-7.2 ms with it and 4.9 ms without. Without cuDNN, SDPA takes flash attention, else
    memory-efficient attention (padding masks), else the math kernel.
    """
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def collate(ids: list[list[int]], index: np.ndarray, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the batch to its longest example (dynamic padding), or to ``width`` tokens when given."""
    width = width or max(len(ids[i]) for i in index)
    input_ids = torch.full((len(index), width), tokenization.PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.long)
    for row, i in enumerate(index):
        input_ids[row, : len(ids[i])] = torch.tensor(ids[i])
        mask[row, : len(ids[i])] = 1
    return input_ids, mask


def load_model(checkpoint: str | Path, task: str, dropout: float):
    spec = get_task(task)
    checkpoint = Path(checkpoint)
    tok = tokenization.load(checkpoint / "tokenizer.json")
    config = AutoConfig.from_pretrained(checkpoint)
    if config.vocab_size != tok.get_vocab_size():
        raise ValueError(
            f"checkpoint {checkpoint}: model vocab_size {config.vocab_size} disagrees with its tokenizer's "
            f"{tok.get_vocab_size()} tokens"
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        checkpoint,
        num_labels=spec.num_labels,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
    )
    return model, tok


@torch.no_grad()
def predict(model, ids: list[list[int]], batch_size: int, precision: str, regression: bool) -> np.ndarray:
    model.eval()
    device = next(model.parameters()).device
    out = np.zeros(len(ids), dtype=np.float64 if regression else np.int64)
    for index in bucketed_batches(np.array([len(x) for x in ids]), batch_size * 4, None):
        input_ids, mask = collate(ids, index)
        with autocast(precision, device), attention_backends(device):
            logits = model(input_ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        out[index] = logits.squeeze(-1).numpy() if regression else logits.argmax(-1).numpy()
    return out


def warmup_steps(protocol: dict, total_steps: int) -> int:
    """Warmup steps of a fine-tuning run of ``total_steps``: ``warmup_fraction`` of them, or, with
    ``warmup_from_task``, of the steps that task's train split gives (``warmup_reference_rows`` rows in whole batches
    of ``batch_size``, times ``epochs``), the same for every task. The Cramming reference converts its warmup once,
    on its first task (CoLA: int(0.1 x 534 x 5) = 267), and reuses it for the rest: RTE then warms up for a third
    of its steps and MNLI for 0.2 %."""
    if not protocol.get("warmup_from_task"):
        return int(protocol["warmup_fraction"] * total_steps)
    rows = protocol.get("warmup_reference_rows")
    if rows is None:
        raise ValueError(f"glue protocol warmup_from_task {protocol['warmup_from_task']}: the task's train rows are "
                         "unknown (finetune --warmup-data gives them)")
    return int(protocol["warmup_fraction"] * (rows // protocol["batch_size"]) * protocol["epochs"])


def finetune(
    checkpoint: str | Path,
    task: str,
    data_path: str | Path,
    seed: int,
    protocol: dict,
    out_json: str | Path,
    labels: dict | None = None,
    precision: str = "bf16",
    progress: bool = True,
) -> dict:
    """``labels`` (e.g. model name and vocab size) are copied into the result for the tables.

    ``protocol`` holds :data:`PROTOCOL_KEYS` (``name`` optional), as ``cramswarm.config.glue_protocol`` returns.
    """
    spec = get_task(task)
    missing = [key for key in PROTOCOL_KEYS if key not in protocol]
    if missing:
        raise ValueError(f"fine-tuning protocol lacks {', '.join(missing)} (see glue.protocols in config/config.yaml)")
    start = time.perf_counter()
    torch.manual_seed(seed)
    device = resolve_device(protocol["device"])
    chosen = choose_precision(precision, device)
    precision = chosen.name
    model, tok = load_model(checkpoint, task, protocol["dropout"])
    model.to(device)
    train_rows = read_glue(data_path, "train")
    train_ids = encode(tok, task, train_rows, protocol["max_length_tokens"])
    dtype = torch.float32 if spec.is_regression else torch.long
    train_labels = torch.tensor([row["label"] for row in train_rows], dtype=dtype)
    lengths = np.array([len(x) for x in train_ids])
    rng = np.random.default_rng(seed)

    steps_per_epoch = -(-len(train_ids) // protocol["batch_size"])
    total_steps = steps_per_epoch * protocol["epochs"]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=protocol["lr"], betas=(0.9, 0.98), eps=1e-6, weight_decay=protocol["weight_decay"]
    )
    warmup = warmup_steps(protocol, total_steps)
    if protocol["schedule"] == "cosine":
        scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    elif protocol["schedule"] == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    else:
        scheduler = get_constant_schedule_with_warmup(optimizer, warmup)

    scaler = torch.amp.GradScaler(enabled=precision == "fp16")
    bar = tqdm(total=total_steps, desc=f"finetune {task} s{seed}", disable=not progress, mininterval=2.0)
    padded_tokens = real_tokens = 0
    losses = []
    for _epoch in range(protocol["epochs"]):
        model.train()
        epoch_loss = 0.0
        for index in bucketed_batches(lengths, protocol["batch_size"], rng):
            input_ids, mask = collate(train_ids, index)
            padded_tokens += input_ids.numel()
            real_tokens += int(mask.sum())
            with autocast(precision, device), attention_backends(device):
                loss = model(
                    input_ids.to(device), attention_mask=mask.to(device), labels=train_labels[index].to(device)
                ).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            epoch_loss += loss.item()
            bar.update()
        losses.append(epoch_loss / steps_per_epoch)
    bar.close()

    scores = {}
    for split in spec.eval_splits:
        rows = read_glue(data_path, split)
        ids = encode(tok, task, rows, protocol["max_length_tokens"])
        predictions = predict(model, ids, protocol["batch_size"], precision, spec.is_regression)
        references = np.array([row["label"] for row in rows])
        scores[split] = compute_metrics(task, predictions, references)
    result = {
        **(labels or {}),
        "checkpoint": str(checkpoint),
        "task": task,
        "seed": seed,
        "scores": scores,
        "protocol": {key: protocol[key] for key in ("name", *PROTOCOL_KEYS, *WARMUP_KEYS) if key in protocol},
        "steps": total_steps,
        "final_lr": scheduler.get_last_lr()[0],
        "precision": precision,
        "precision_reason": chosen.reason,
        "epochs": protocol["epochs"],
        "train_examples": len(train_rows),
        "train_loss_per_epoch": [round(x, 5) for x in losses],
        "padding_efficiency": round(real_tokens / max(padded_tokens, 1), 4),
        "wall_s": round(time.perf_counter() - start, 2),
        "provenance": provenance(protocol, seed, str(device)),
    }
    write_json(out_json, result)
    return result


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_key(
    checkpoint: str | Path,
    task: str,
    data_path: str | Path,
    seed: int,
    protocol: dict,
    labels: dict | None,
    precision: str,
) -> str:
    """What a fine-tuning result depends on: the checkpoint's weights and config, the task data (by content), the
    seed, the protocol, the labels and the precision."""
    checkpoint = Path(checkpoint)
    parts = {
        "weights": _file_digest(checkpoint / "model.safetensors"),
        "config": _file_digest(checkpoint / "config.json"),
        "data": _file_digest(Path(data_path)),
        "task": task,
        "seed": seed,
        "protocol": protocol,
        "labels": labels or {},
        "precision": precision,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def finetune_seeds(
    checkpoint: str | Path,
    task: str,
    data_path: str | Path,
    seeds: list[int],
    protocol: dict,
    outs: list[str | Path],
    labels: dict | None = None,
    precision: str = "bf16",
    progress: bool = True,
    cache_dir: str | Path | None = None,
) -> list[dict]:
    """:func:`finetune` for several seeds in one process (one torch/transformers start-up instead of one per seed),
    seed ``seeds[i]`` written to ``outs[i]``. Each seed's result is the same as a run of that seed alone: every
    run reseeds torch and numpy and reloads the checkpoint.

    With ``cache_dir`` each finished seed is also kept there under :func:`cache_key`, and a later call with the
    same inputs copies it instead of training again, so a job that failed at its fourth seed keeps its first three.
    """
    if len(seeds) != len(outs):
        raise ValueError(f"{len(seeds)} seeds but {len(outs)} output paths")
    resolved = choose_precision(precision, resolve_device(protocol["device"]))
    print(f"precision {resolved.name} ({resolved.reason})", flush=True)
    results = []
    for seed, out in zip(seeds, outs):
        cached = None
        if cache_dir is not None:
            key = cache_key(checkpoint, task, data_path, seed, protocol, labels, resolved.name)
            cached = Path(cache_dir) / f"{task}-s{seed}-{key}.json"
            if cached.is_file():
                result = json.loads(cached.read_text())
                write_json(out, result)
                print(f"seed {seed}: reused {cached}", flush=True)
                results.append(result)
                continue
        result = finetune(checkpoint, task, data_path, seed, protocol, out, labels, precision, progress)
        if cached is not None:
            write_json(cached, result)
        results.append(result)
    return results
