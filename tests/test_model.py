import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

import cramswarm  # noqa: F401  (registers the Auto classes)
from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM

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
    torch.testing.assert_close(classifier.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight)


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
    for bad in ({"norm_scheme": "sandwich"}, {"ffn": "swiglu"}, {"pos_embedding": "rotary"}, {"classifier_pooling": "max"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CrammedBertConfig(**TINY, **bad)
