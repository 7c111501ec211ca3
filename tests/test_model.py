import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

import cramswarm  # noqa: F401  (registers the Auto classes)
from cramswarm.models.crammed_bert import (
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    CrammedBertForSequenceClassification,
    FeedForward,
    unwrap_compiled,
)

TINY = dict(vocab_size=100, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_paper_shape_parameter_count():
    """16 layers, 768 wide, 12 heads, vocab 32768, counted from the shapes (tied decoder counted once)."""
    h, v, layers = 768, 32768, 16
    block = 3 * h * h + h * h + h * 3072 + (3072 // 2) * h + 2 * 2 * h  # qkv, out, ffn in, ffn out, 2 LNs
    expected = layers * block + v * h + 2 * 2 * h + 1  # + embedding LN, final LN, position scale
    model = CrammedBertForMaskedLM(CrammedBertConfig(vocab_size=v))
    assert n_params(model) == expected == 119_589_889


@pytest.mark.parametrize(
    "switch, delta",
    [
        ({"qkv_bias": True}, 2 * 3 * 32),
        ({"use_bias": True}, 2 * (32 + 64 + 32)),  # out proj, ffn in, ffn out, per layer
        ({"decoder_bias": True}, 100),
        ({"final_norm": False}, -2 * 32),
        ({"embedding_norm": False}, -2 * 32),
        ({"head_transform": True}, 32 * 32 + 2 * 32),
        ({"ffn": "gelu"}, 2 * 32 * 32),  # FFN out grows from 32 to 64 inputs
        ({"pos_embedding": "learned", "max_position_embeddings": 128}, 128 * 32 - 1),
    ],
)
def test_each_switch_changes_the_shapes(switch, delta):
    base = n_params(CrammedBertForMaskedLM(CrammedBertConfig(**TINY)))
    assert n_params(CrammedBertForMaskedLM(CrammedBertConfig(**TINY, **switch))) - base == delta


def test_decoder_is_tied():
    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY))
    assert model.head.decoder.weight is model.bert.embeddings.word_embeddings.weight


def masked_batch():
    torch.manual_seed(0)
    x = torch.randint(5, 100, (3, 16))
    labels = torch.full_like(x, -100)
    labels[:, ::3] = x[:, ::3]
    return x, labels


@pytest.mark.parametrize("norm_scheme", ["pre", "post"])
def test_sparse_and_dense_prediction_give_the_same_loss(norm_scheme):
    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY, norm_scheme=norm_scheme)).eval()
    x, labels = masked_batch()
    sparse = model(x, labels=labels)
    model.config.sparse_prediction = False
    dense = model(x, labels=labels)
    assert sparse.logits.shape == (int((labels != -100).sum()), 100)
    assert dense.logits.shape == (3, 16, 100)
    torch.testing.assert_close(sparse.loss, dense.loss)


def test_padding_mask_isolates_padding():
    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY)).eval()
    x = torch.randint(5, 100, (1, 10))
    padded = torch.cat([x, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], dim=1).long()
    a = model.bert(x).last_hidden_state
    b = model.bert(padded, attention_mask=mask).last_hidden_state[:, :10]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_auto_classes_load_checkpoint(tmp_path):
    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY)).eval()
    model.save_pretrained(tmp_path)
    x, labels = masked_batch()
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(loaded) is CrammedBertForMaskedLM
    torch.testing.assert_close(loaded(x, labels=labels).loss, model(x, labels=labels).loss)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3).eval()
    out = classifier(x, attention_mask=torch.ones_like(x), token_type_ids=torch.zeros_like(x))
    assert out.logits.shape == (3, 3)
    torch.testing.assert_close(
        classifier.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight
    )


def test_regression_head_is_fp32_under_autocast():
    model = AutoModelForSequenceClassification.from_config(CrammedBertConfig(**TINY, num_labels=1)).eval()
    x, _ = masked_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x).logits
    assert logits.dtype == torch.float32


def test_too_long_input_is_rejected():
    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY, max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(5, 100, (1, 9)))


def test_mean_pooling_ignores_padding():
    config = CrammedBertConfig(**TINY, num_labels=2, classifier_pooling="mean")
    model = AutoModelForSequenceClassification.from_config(config).eval()
    x = torch.randint(5, 100, (1, 10))
    padded = torch.cat([x, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 5)], dim=1).long()
    torch.testing.assert_close(model(x).logits, model(padded, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)
    cls = AutoModelForSequenceClassification.from_config(CrammedBertConfig(**TINY, num_labels=2)).eval()
    cls.load_state_dict(model.state_dict())
    assert not torch.allclose(cls(x).logits, model(x).logits)  # the switch changes what the head reads


def test_unknown_switch_values_are_rejected():
    for bad in (
        {"norm_scheme": "sandwich"},
        {"ffn": "swiglu"},
        {"pos_embedding": "rotary"},
        {"classifier_pooling": "max"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CrammedBertConfig(**TINY, **bad)


def prefix_checkpoint_keys(directory, prefix="_orig_mod."):
    """Rewrite a saved checkpoint as a torch.compile-wrapped model's state dict would name it."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state = load_file(path)
    save_file({prefix + key: value for key, value in state.items()}, path, metadata={"format": "pt"})
    return sorted(state)


def test_checkpoint_with_compiled_prefix_loads_with_auto_classes(tmp_path):
    """Issue #34 of the original code: keys saved from a compiled model carry ``_orig_mod.``."""
    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY)).eval()
    model.save_pretrained(tmp_path)
    keys = prefix_checkpoint_keys(tmp_path)
    assert keys and not any(key.startswith("_orig_mod.") for key in keys)
    x, labels = masked_batch()
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is CrammedBertForMaskedLM
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(loaded(x).logits, model(x).logits)
    torch.testing.assert_close(loaded(x, labels=labels).loss, model(x, labels=labels).loss, rtol=0, atol=0)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3).eval()
    assert type(classifier) is CrammedBertForSequenceClassification
    assert torch.equal(classifier.bert(x).last_hidden_state, model.bert(x).last_hidden_state)


def test_fresh_model_saves_clean_keys(tmp_path):
    from safetensors.torch import load_file

    CrammedBertForMaskedLM(CrammedBertConfig(**TINY)).save_pretrained(tmp_path)
    assert not any(key.startswith("_orig_mod.") for key in load_file(tmp_path / "model.safetensors"))


def test_unwrap_compiled_saves_clean_keys(tmp_path):
    from safetensors.torch import load_file

    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY)).eval()
    assert unwrap_compiled(model) is model
    compiled = torch.compile(model)
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())  # the problem unwrap_compiled solves
    x, _ = masked_batch()
    try:
        out = compiled(x).logits
    except Exception as error:  # no working C++ toolchain for inductor
        pytest.skip(f"torch.compile cannot run here: {type(error).__name__}: {error}")
    torch.testing.assert_close(out, model(x).logits, atol=1e-5, rtol=1e-5)
    assert unwrap_compiled(compiled) is model
    unwrap_compiled(compiled).save_pretrained(tmp_path)
    keys = list(load_file(tmp_path / "model.safetensors"))
    assert keys and not any(key.startswith("_orig_mod.") for key in keys)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("head", ["mlm", "classifier"])
def test_bert_style_batch_with_token_type_ids(head):
    """A BERT tokenizer returns token_type_ids; the model accepts and ignores them (it has no type embeddings)."""
    torch.manual_seed(0)
    if head == "mlm":
        model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY)).eval()
    else:
        model = CrammedBertForSequenceClassification(CrammedBertConfig(**TINY, num_labels=3)).eval()
    x = torch.randint(5, 100, (2, 12))
    mask = torch.ones_like(x)
    mask[1, 8:] = 0
    batch = {"input_ids": x, "token_type_ids": torch.zeros_like(x), "attention_mask": mask}
    plain = model(**batch).logits
    second_segment = torch.zeros_like(x)
    second_segment[:, 6:] = 1
    assert torch.equal(model(**{**batch, "token_type_ids": second_segment}).logits, plain)
    assert torch.equal(model(input_ids=x, attention_mask=mask).logits, plain)
    assert plain.shape == ((2, 12, 100) if head == "mlm" else (2, 3))


@pytest.mark.parametrize("dropout, deterministic", [(0.0, True), (0.1, False)])
def test_dropout_in_train_mode(dropout, deterministic):
    """Pretraining builds with dropout 0 (deterministic even in train mode); fine-tuning uses 0.1."""
    config = CrammedBertConfig(**TINY, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = CrammedBertForMaskedLM(config).train()
    x, labels = masked_batch()
    first, second = model(x, labels=labels), model(x, labels=labels)
    assert torch.equal(first.logits, second.logits) is deterministic
    assert torch.equal(first.loss, second.loss) is deterministic
    model.eval()
    assert torch.equal(model(x).logits, model(x).logits)


def test_cpu_autocast_training_attention_matches_bf16_path():
    """Under CPU autocast with grad, attention runs in fp32 (speed); it must agree with the bf16 kernel's result."""
    model = CrammedBertForMaskedLM(CrammedBertConfig(**TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    x, labels = masked_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels=labels)
        with torch.no_grad():
            reference = model(x, labels=labels)
    out.loss.backward()
    assert out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(out.logits.float(), reference.logits.float(), atol=2e-2, rtol=2e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("use_bias", [False, True])
def test_gated_ffn_is_gelu_of_the_second_half_times_the_first(use_bias):
    """The gated FFN runs dense_in as two half-width projections; it must compute exactly what the paper's
    formulation does on dense_in's whole output (h, gate = chunk(2); gelu(gate) * h), values and gradients."""
    torch.manual_seed(0)
    config = CrammedBertConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                               intermediate_size=48, use_bias=use_bias)
    ffn = FeedForward(config).double()
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    out = ffn(x)
    h, gate = ffn.dense_in(x).chunk(2, dim=-1)
    reference = ffn.dense_out(torch.nn.functional.gelu(gate) * h)
    torch.testing.assert_close(out, reference)
    grads = torch.autograd.grad(out.square().sum(), [x, *ffn.parameters()])
    reference_grads = torch.autograd.grad(reference.square().sum(), [x, *ffn.parameters()])
    for got, want in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want)
