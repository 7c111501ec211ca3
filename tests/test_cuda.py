"""The CUDA paths: the crammed model, pretraining (bf16 and fp16 + GradScaler, eager and torch.compile, resume)
and fine-tuning on a GPU. Skipped where torch sees no CUDA device (CI); run on a GPU machine with
``python -m pytest tests/test_cuda.py``."""

import csv
import json

import numpy as np
import pytest
import torch
from conftest import ARCH, DEFAULT, impl, killed_at_save, recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import cramswarm  # noqa: E402,F401  (registers the Auto classes)
from cramswarm.data import tokenizer as tokenization  # noqa: E402
from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM  # noqa: E402
from cramswarm.precision import resolve_precision  # noqa: E402
from cramswarm.pretrain import HeldOut, pretrain  # noqa: E402
from cramswarm.training import resolve_device  # noqa: E402

CUDA = torch.device("cuda")


def small_model(**kw) -> CrammedBertForMaskedLM:
    torch.manual_seed(0)
    config = CrammedBertConfig(vocab_size=300, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, **kw)
    return CrammedBertForMaskedLM(config)


def masked_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (8, 64), generator=generator)
    labels = torch.where(torch.rand(8, 64, generator=generator) < 0.25, ids, torch.full_like(ids, -100))
    return ids, labels


def test_auto_device_and_precision_pick_cuda_bf16():
    device = resolve_device("auto")
    assert device.type == "cuda"
    assert resolve_precision("auto", device) == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")


@pytest.mark.parametrize("norm_scheme", ["pre", "post"])
def test_bf16_loss_and_gradients_on_cuda_match_fp32_on_cpu(norm_scheme):
    model = small_model(norm_scheme=norm_scheme).train()
    ids, labels = masked_batch()
    reference = model(ids, labels=labels).loss
    reference.backward()
    ref_grad = model.bert.layers[0].attention.qkv.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model.to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids.to(CUDA), labels=labels.to(CUDA)).loss
    assert loss.dtype == torch.float32
    loss.backward()
    grad = model.bert.layers[0].attention.qkv.weight.grad.cpu()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-2)
    assert ((grad - ref_grad).norm() / ref_grad.norm()).item() < 5e-2


def test_sparse_and_dense_prediction_agree_on_cuda():
    ids, labels = masked_batch(1)
    sparse = small_model().to(CUDA).eval()
    dense = small_model(sparse_prediction=False).to(CUDA).eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a = sparse(ids.to(CUDA), labels=labels.to(CUDA)).loss
        b = dense(ids.to(CUDA), labels=labels.to(CUDA)).loss
    assert a.item() == pytest.approx(b.item(), rel=1e-3)


def test_padding_mask_on_cuda():
    model = small_model().to(CUDA).eval()
    ids = torch.randint(5, 300, (2, 16), device=CUDA)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    other = ids.clone()
    other[1, 10:] = 7  # change only padded positions
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a = model.bert(ids, attention_mask=mask).last_hidden_state
        b = model.bert(other, attention_mask=mask).last_hidden_state
    assert torch.allclose(a[1, :10].float(), b[1, :10].float(), atol=1e-2)


def test_held_out_loss_on_cuda_matches_cpu(tiny_run):
    folder, _ = tiny_run
    blocks = np.load(folder / "blocks.npy")[-16:]
    heldout = HeldOut(blocks, 0.15, 96, 8)
    model = CrammedBertForMaskedLM(CrammedBertConfig.from_arch(ARCH, 96))
    on_cpu = heldout.loss(model, "fp32", torch.device("cpu"))
    assert heldout.loss(model.to(CUDA), "fp32", CUDA) == pytest.approx(on_cpu, rel=1e-4)


def _rows(path):
    return list(csv.DictReader(open(path)))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pretrain_on_cuda_learns_and_saves_a_cpu_checkpoint(tiny_run, precision):
    """bf16 autocast, or fp16 with the GradScaler; the checkpoint loads on the CPU."""
    from transformers import AutoModelForMaskedLM

    folder, tok_path = tiny_run
    out = folder / f"ckpt-{precision}"
    summary = pretrain(recipe(precision=precision), ARCH, folder / "blocks.npy", tok_path, out,
                       progress=False, impl=impl(device="cuda"))
    assert summary["device"] == "cuda" and summary["precision"] == precision
    assert summary["provenance"]["hardware"]["gpu"] == torch.cuda.get_device_name(CUDA)
    rows = _rows(out / "train_log.csv")
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.3
    assert all(np.isfinite(float(r["loss"])) for r in rows)
    model = AutoModelForMaskedLM.from_pretrained(out)
    assert next(model.parameters()).device.type == "cpu"


def test_compiled_pretraining_on_cuda_matches_eager(tiny_run):
    from safetensors.torch import load_file

    folder, tok_path = tiny_run
    r, gpu = recipe(precision="fp32", budget={"unit": "steps", "value": 6}), impl(device="cuda")
    eager = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "eager", progress=False, impl=gpu)
    compiled = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "compiled",
                        progress=False, impl=impl(device="cuda", compile=True))
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], abs=1e-3)
    assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], abs=1e-3)
    assert not [k for k in load_file(folder / "compiled" / "model.safetensors") if k.startswith("_orig_mod")]
    # bf16 + compile, the GPU recipe's setting, also trains
    bf16 = pretrain(r | {"precision": "bf16", "budget": {"unit": "steps", "value": 30}}, ARCH,
                    folder / "blocks.npy", tok_path, folder / "compiled-bf16", progress=False,
                    impl=impl(device="cuda", compile=True))
    rows = _rows(folder / "compiled-bf16" / "train_log.csv")
    assert bf16["precision"] == "bf16" and float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.3


def test_pretrain_resumes_on_cuda(tiny_run):
    """A state saved from a CUDA run (CUDA tensors, optimizer state, fp16 scaler) resumes on CUDA."""
    folder, tok_path = tiny_run
    r, gpu = recipe(precision="fp16", budget={"unit": "steps", "value": 12}), impl(device="cuda", resume_every_steps=4)
    full = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "full", progress=False, impl=gpu)

    state = folder / "state"
    with killed_at_save(2) as saves:  # during the second write (step 8), before its rename: the file keeps step 4
        pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "resumed", progress=False, state_dir=state,
                 impl=gpu)
    resumed = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "resumed", progress=False, state_dir=state,
                       impl=gpu)
    assert saves == [4, 8] and resumed["resumed_from_step"] == 4 and resumed["steps"] == full["steps"] == 12
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], abs=2e-2)


def test_finetune_on_cuda(tmp_path):
    from cramswarm.config import glue_protocol
    from cramswarm.data import sources
    from cramswarm.data.synthetic import corpus_documents
    from cramswarm.glue.finetune import finetune
    from cramswarm.pretrain import init_random

    docs = list(corpus_documents(300, 0))
    tok = tokenization.train_wordpiece([docs], 256)
    tok.save(str(tmp_path / "tokenizer.json"))
    init_random(ARCH | {"max_positions": 64}, tmp_path / "tokenizer.json", tmp_path / "model", seed=0)
    synthetic = {"source": "synthetic", "synthetic": {"seed": 0, "glue_train_examples": 40,
                                                      "glue_validation_examples": 24}}
    for task in ("sst2", "stsb"):  # a classification and a regression task
        sources.write_glue(synthetic, task, tmp_path / f"{task}.parquet")
        protocol = glue_protocol(DEFAULT) | {"max_length_tokens": 64, "device": "cuda", "epochs": 2}
        result = finetune(tmp_path / "model", task, tmp_path / f"{task}.parquet", 0, protocol,
                          tmp_path / f"{task}.json", precision="auto", progress=False)
        assert result["provenance"]["hardware"]["gpu"] == torch.cuda.get_device_name(CUDA)
        assert all(np.isfinite(x) for x in result["train_loss_per_epoch"])
        scores = json.loads((tmp_path / f"{task}.json").read_text())["scores"]
        assert scores and all(np.isfinite(v) for split in scores.values() for v in split.values())


def test_finetune_attention_leaves_out_cudnn_on_cuda_only():
    """Dynamic padding brings a new shape every few batches; cuDNN attention builds a graph for each one."""
    from cramswarm.glue.finetune import attention_backends

    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(CUDA):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_hivemind_swarm_peers_train_on_the_gpu():
    """SWARM's stage peers (hivemind processes, recipe device auto) compute on the GPU their process sees: the
    swarm trains, loses no microbatch, and its replicas stay bitwise equal."""
    pytest.importorskip("hivemind", reason="hivemind is not installed")
    import swarm_helpers as swarm

    result = swarm.ht.run_swarm(swarm.plan(peers_per_stage=[2, 1], device="auto"), swarm.source(), 160,
                                progress=False)
    stats = result.stats
    assert set(stats["peer_devices"].values()) == {"cuda"}, stats["peer_devices"]
    assert stats["microbatches_requested"] == stats["microbatches_done"] == 160 and stats["lost_microbatches"] == 0
    assert stats["replicas_equal"], stats["replica_steps"]
    losses = [row["loss"] for row in result.log]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert all(t.device.type == "cpu" for state in result.stage_states for t in state.values())


def test_square_cube_measures_the_layer_on_the_gpu(tmp_path):
    """swarm_study.square_cube with device cuda times the layer on the GPU and names it in the device column."""
    import pandas as pd

    from cramswarm.swarm_study import study

    study.square_cube(tmp_path / "sq.csv", hidden_sizes=(256,), bandwidths_mbit_s=(100.0,), schemes=("none",),
                      batch=2, seq_len=16, repeats=2, link="ideal", device="cuda")
    frame = pd.read_csv(tmp_path / "sq.csv")
    assert set(frame["device"]) == {torch.cuda.get_device_name()} and (frame["compute_s"] > 0).all()


def test_blockwise8_on_the_gpu_is_the_cpus_code():
    """A stage peer encodes and decodes where it computes: on CUDA the codes, the scales and the decoded values are
    the CPU's, bit for bit, for several inputs (the code step absmax / 127 is divided alike on both devices; CUDA's
    division by a Python number, a multiplication by the reciprocal, flipped codes near rounding boundaries on an
    H200 2026-11-26)."""
    from cramswarm.swarm.compression import decode, encode, payload_to

    generator = torch.Generator().manual_seed(0)
    for shape in [(256, 128, 96), (1000, 77)]:   # whole blocks; a padded last block
        x = torch.randn(*shape, generator=generator) * 3
        on_cpu, on_gpu = encode(x, "blockwise8"), encode(x.cuda(), "blockwise8")
        assert on_gpu["codes"].is_cuda
        back = payload_to(on_gpu, "cpu")
        assert torch.equal(back["absmax"], on_cpu["absmax"])
        assert torch.equal(back["codes"], on_cpu["codes"]), (back["codes"] != on_cpu["codes"]).sum()
        assert torch.equal(decode(payload_to(on_cpu, "cuda")).cpu(), decode(on_cpu))
