"""Specification of GradCache: `cached_loss(...).backward()` gives the full-batch gradients,
whatever the chunks."""

from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gcbs_lib import gradcache
from gcbs_lib.batches import batch_length, slice_batch
from gcbs_lib.check import relative_error, tolerance
from gcbs_lib.distributed import gather_with_grad, rank_and_world_size
from gcbs_lib.gradcache import RandContext, cached_loss, encode_in_chunks
from gcbs_lib.launcher import launch
from gcbs_lib.losses import LogitScale, info_nce, rank_info_nce, similarity
from gcbs_lib.models import TinyTextEncoder, random_token_batch

BATCH, LENGTH, VOCAB = 6, 10, 50
CHUNK_SIZES = [1, 4, BATCH, BATCH + 5]  # one row, a non-divisor, the batch, more than the batch
VARIANTS = ["plain", "hard_negatives", "symmetric", "logit_scale", "mask_same_group"]
# 3·BATCH documents in four groups, that every chunk and rank cuts (mask_same_group)
GROUPS = torch.arange(3 * BATCH) % 4


@dataclass
class Setup:
    loss_fn: object
    encoders: object
    batches: list
    params: list

    def encoder_list(self):
        return (
            self.encoders
            if isinstance(self.encoders, list)
            else [self.encoders] * len(self.batches)
        )

    def full_batch_loss(self, chunk_size=None):
        """The plain loss with a graph over the whole batch (optionally encoded chunk by chunk, same
        masks)."""
        return self.loss_fn(
            *[
                encode_in_chunks(encoder, batch, chunk_size or batch_length(batch))
                for encoder, batch in zip(self.encoder_list(), self.batches)
            ]
        )

    def grads_of(self, loss):
        for p in self.params:
            p.grad = None
        loss.backward()
        return [p.grad.clone() for p in self.params]


def make_setup(variant="plain", shared=False, dtype=torch.float64, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    make = partial(
        TinyTextEncoder,
        vocab_size=VOCAB,
        dim=16,
        heads=2,
        layers=2,
        max_length=LENGTH,
        dropout=dropout,
    )
    encoders = make().to(dtype) if shared else [make().to(dtype), make().to(dtype)]
    generator = torch.Generator().manual_seed(seed + 1)
    n_docs = 3 * BATCH if variant in ("hard_negatives", "mask_same_group") else BATCH
    batches = [
        random_token_batch(BATCH, LENGTH, VOCAB, generator),
        random_token_batch(n_docs, LENGTH, VOCAB, generator),
    ]
    scale = LogitScale().to(dtype)
    loss_fn = {
        "plain": partial(info_nce, scale=20.0),
        "hard_negatives": partial(info_nce, scale=20.0),
        "symmetric": partial(info_nce, scale=20.0, symmetric=True),
        "logit_scale": partial(info_nce, scale=scale),
        "mask_same_group": partial(info_nce, scale=20.0, symmetric=True, groups=GROUPS),
    }[variant]
    modules = ([encoders] if shared else encoders) + ([scale] if variant == "logit_scale" else [])
    params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
    return Setup(loss_fn, encoders, batches, params)


def max_relative_error(grads, reference):
    return max(relative_error(g, r) for g, r in zip(grads, reference))


# ---- equivalence with the full batch
# -------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("shared", [False, True], ids=["two_encoders", "shared_encoder"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gradients_equal_the_full_batch_gradients(dtype, variant, shared, chunk_size):
    setup = make_setup(variant, shared, dtype)
    reference = setup.grads_of(setup.full_batch_loss())
    grads = setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, chunk_size))
    assert max_relative_error(grads, reference) <= tolerance(dtype)


@pytest.mark.parametrize("variant", ["symmetric", "mask_same_group"])
def test_the_loss_value_equals_the_full_batch_loss(variant):
    setup = make_setup(variant)
    torch.testing.assert_close(
        cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4),
        setup.full_batch_loss(),
        rtol=1e-13,
        atol=0,
    )


def test_a_learnable_logit_scale_gets_its_full_batch_gradient():
    setup = make_setup("logit_scale")
    scale_index = len(setup.params) - 1
    reference = setup.grads_of(setup.full_batch_loss())[scale_index]
    grad = setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4))[scale_index]
    assert reference.abs() > 0 and relative_error(grad, reference) <= 1e-12


# ---- dropout replay
# ------------------------------------------------------------------------------------------


def record_outputs(encoders):
    """Forward hooks that record every encoder output, in call order."""
    calls = []

    def hook(module, args, output):
        calls.append(output.detach().clone())

    handles = [e.register_forward_hook(hook) for e in dict.fromkeys(encoders)]
    return calls, handles


def first_pass_and_replays(setup, chunk_size):
    """Run cached_loss and its backward; return the recorded first-pass outputs and the replays, one
    per chunk, in chunk order."""
    calls, handles = record_outputs(setup.encoder_list())
    setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, chunk_size))
    for handle in handles:
        handle.remove()
    chunks = sum(-(-batch_length(batch) // chunk_size) for batch in setup.batches)
    return calls[:chunks], calls[chunks:]


def test_dropout_is_active_so_two_train_mode_forwards_differ():
    setup = make_setup(dropout=0.1)
    encoder = setup.encoder_list()[0]
    assert not torch.equal(encoder(setup.batches[0]), encoder(setup.batches[0]))


def test_replayed_chunk_embeddings_are_bitwise_equal_to_the_first_pass():
    first, replays = first_pass_and_replays(make_setup(dropout=0.1), chunk_size=4)
    assert len(first) == 4 and len(replays) == 3  # the last chunk kept its graph
    assert all(torch.equal(f, r) for f, r in zip(first, replays))


@pytest.mark.parametrize("shared", [False, True], ids=["two_encoders", "shared_encoder"])
def test_with_dropout_gradients_equal_a_reference_using_the_same_masks(shared):
    setup = make_setup("symmetric", shared, dropout=0.1)
    torch.manual_seed(123)
    reference = setup.grads_of(setup.full_batch_loss(chunk_size=4))
    torch.manual_seed(123)
    grads = setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4))
    assert max_relative_error(grads, reference) <= 1e-12


class NoReplay:
    """A RandContext that restores nothing: the negative control for dropout replay."""

    def __init__(self, *tensors):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_without_rng_replay_the_replay_differs_and_gradients_are_wrong(monkeypatch):
    monkeypatch.setattr(gradcache, "RandContext", NoReplay)
    setup = make_setup(dropout=0.1)
    torch.manual_seed(123)
    reference = setup.grads_of(setup.full_batch_loss(chunk_size=4))
    torch.manual_seed(123)
    first, replays = first_pass_and_replays(setup, chunk_size=4)
    assert not any(torch.equal(f, r) for f, r in zip(first, replays))
    torch.manual_seed(123)
    grads = setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4))
    assert max_relative_error(grads, reference) > 1e-3


def test_rand_context_replays_the_captured_state_and_leaves_the_stream_untouched():
    torch.manual_seed(0)
    context = RandContext(torch.zeros(1))
    first = torch.rand(5)
    after_first = torch.get_rng_state()
    with context:
        assert torch.equal(torch.rand(5), first)
    assert torch.equal(torch.get_rng_state(), after_first)


def continuation_of(first_draws, count, seed=0):
    """The `count` numbers that follow `first_draws` numbers of the seeded CPU stream."""
    torch.manual_seed(seed)
    torch.rand(first_draws)
    return torch.rand(count)


def test_rand_context_leaves_the_stream_untouched_however_many_numbers_the_replay_draws():
    torch.manual_seed(0)
    context = RandContext(torch.zeros(1))
    first = torch.rand(5)
    with context:
        assert torch.equal(torch.rand(2), first[:2])  # fewer than were drawn after the capture
    assert torch.equal(torch.rand(3), continuation_of(first_draws=5, count=3))


def test_the_replays_in_backward_do_not_rewind_the_global_random_stream():
    def draws_around_backward(backward):
        setup = make_setup(dropout=0.1)
        torch.manual_seed(123)
        loss = cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)
        before = torch.rand(4)
        if backward:
            loss.backward()
        return before, torch.rand(4)

    before, after = draws_around_backward(backward=True)
    expected_before, expected_after = draws_around_backward(backward=False)
    assert torch.equal(before, expected_before) and torch.equal(after, expected_after)


# ---- autograd behaviour
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1 / 2, 1 / 4, 2.0**16])
def test_scaling_the_loss_scales_every_gradient(scale):
    setup = make_setup("logit_scale")
    grads = setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4))
    scaled = setup.grads_of(scale * cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4))
    assert all(torch.equal(s, scale * g) for s, g in zip(scaled, grads))


def test_under_no_grad_it_returns_the_loss_and_adds_no_gradients():
    setup = make_setup("logit_scale")
    with torch.no_grad():
        loss = cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)
        expected = setup.full_batch_loss()
    assert not loss.requires_grad
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=0)
    assert all(p.grad is None for p in setup.params)


def test_two_forwards_then_one_backward_give_the_sum_of_the_gradients():
    first, second = make_setup(seed=0), make_setup(seed=5)
    second.encoders, second.params = first.encoders, first.params  # same model, another batch
    grads_first = first.grads_of(cached_loss(first.loss_fn, first.encoders, first.batches, 4))
    grads_second = first.grads_of(cached_loss(first.loss_fn, first.encoders, second.batches, 4))
    both = first.grads_of(
        cached_loss(first.loss_fn, first.encoders, first.batches, 4)
        + cached_loss(first.loss_fn, first.encoders, second.batches, 4)
    )
    assert max_relative_error(both, [a + b for a, b in zip(grads_first, grads_second)]) <= 1e-12


def test_dict_entries_that_are_not_tensors_pass_through_to_every_chunk():
    setup = make_setup()
    seen = []
    encoder = setup.encoders[0]
    handle = encoder.register_forward_pre_hook(lambda module, args: seen.append(args[0]["texts"]))
    setup.batches[0] = dict(setup.batches[0], texts=["a text"] * BATCH)
    cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4).backward()
    handle.remove()
    assert seen == [["a text"] * BATCH] * 4


def test_backward_twice_with_retain_graph_doubles_the_gradients_as_the_full_batch_does():
    setup = make_setup()
    once = setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4))
    loss = cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)
    for p in setup.params:
        p.grad = None
    loss.backward(retain_graph=True)
    loss.backward()
    assert max_relative_error([p.grad for p in setup.params], [2 * g for g in once]) <= 1e-12


# ---- mixed precision
# -----------------------------------------------------------------------------------------


def bf16_setup():
    return make_setup("symmetric", dtype=torch.float32, dropout=0.1)


def test_bf16_autocast_replays_bitwise_and_matches_a_bf16_full_batch():
    setup = bf16_setup()
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = setup.full_batch_loss(chunk_size=4)
    reference = setup.grads_of(loss)
    calls, handles = record_outputs(setup.encoder_list())
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)
    grads = setup.grads_of(loss)
    [h.remove() for h in handles]
    first, replays = calls[:4], calls[4:]
    assert all(torch.equal(f, r) for f, r in zip(first, replays))
    # ~2.4e-3; ~9e-3 without the replay
    assert max_relative_error(grads, reference) <= tolerance(torch.bfloat16)
    torch.manual_seed(7)  # negative control: the same masks without autocast give other embeddings
    assert not torch.equal(setup.encoder_list()[0](slice_batch(setup.batches[0], 0, 4)), first[0])


# ---- bad input
# -------------------------------------------------------------------------------------------------


def test_an_empty_batch_is_refused():
    setup = make_setup()
    setup.batches[1] = slice_batch(setup.batches[1], 0, 0)
    with pytest.raises(ValueError, match="branch 1 is an empty batch"):
        cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)


@pytest.mark.parametrize("batches", [[], "one tensor"])
def test_batches_must_be_a_non_empty_sequence_of_branch_inputs(batches):
    setup = make_setup()
    batches = setup.batches[0] if batches == "one tensor" else batches
    with pytest.raises(ValueError, match="batches must be a non-empty sequence"):
        cached_loss(setup.loss_fn, setup.encoders[0], batches, 4)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5])
def test_a_chunk_size_that_is_not_a_positive_integer_is_refused(chunk_size):
    setup = make_setup()
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        cached_loss(setup.loss_fn, setup.encoders, setup.batches, chunk_size)


def test_branches_of_lengths_the_loss_cannot_pair_are_refused():
    setup = make_setup()
    setup.batches[1] = slice_batch(setup.batches[1], 0, BATCH - 1)
    with pytest.raises(ValueError, match="5 documents for 6 queries"):
        cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)


def test_nan_embeddings_are_refused_naming_branch_and_rows():
    setup = make_setup()

    class NaNAfterRow(nn.Module):
        def forward(self, batch):
            out = setup.encoders[1](batch)
            return out.masked_fill(torch.arange(len(out))[:, None] >= 1, float("nan"))

    with pytest.raises(FloatingPointError, match=r"branch 1, rows 0:4: .*NaN"):
        cached_loss(setup.loss_fn, [setup.encoders[0], NaNAfterRow()], setup.batches, 4)


def test_one_encoder_per_branch_must_match_the_number_of_branches():
    setup = make_setup()
    with pytest.raises(ValueError, match="3 encoders for 2 branches"):
        cached_loss(setup.loss_fn, setup.encoders + setup.encoders[:1], setup.batches, 4)


def test_dict_entries_of_different_lengths_are_refused():
    setup = make_setup()
    setup.batches[0]["attention_mask"] = setup.batches[0]["attention_mask"][:-1]
    with pytest.raises(ValueError, match="all of the same length"):
        cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)


def test_a_batch_that_is_neither_a_tensor_nor_a_dict_is_refused():
    setup = make_setup()
    setup.batches[0] = (setup.batches[0]["input_ids"], setup.batches[0]["attention_mask"])
    with pytest.raises(TypeError, match="a tensor or a dict of tensors, got tuple"):
        cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)


def test_inputs_that_carry_a_graph_are_refused():
    upstream = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="branch 0: the batch requires grad"):
        cached_loss(info_nce, nn.Linear(3, 3), [upstream(torch.randn(4, 3)), torch.randn(4, 3)], 2)


def test_batchnorm_in_training_mode_is_refused_and_in_eval_mode_accepted():
    encoder = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    batches = [torch.randn(4, 3), torch.randn(4, 3)]
    with pytest.raises(ValueError, match="BatchNorm in training mode"):
        cached_loss(info_nce, encoder, batches, 2)
    encoder.eval()
    cached_loss(info_nce, encoder, batches, 2).backward()


def test_outputs_that_are_not_batch_first_are_refused():
    with pytest.raises(
        ValueError, match=r"returned torch.Size\(\[3, 2\]\), not one row per input row"
    ):
        cached_loss(info_nce, lambda x: x.T, [torch.randn(2, 3), torch.randn(2, 3)], 2)
    with pytest.raises(ValueError, match="returned <class 'tuple'>, not one row per input row"):
        cached_loss(info_nce, lambda x: (x, x), [torch.randn(2, 3), torch.randn(2, 3)], 2)


# ---- what a call holds, and how often it encodes
# --------------------------------------------------------------


def count_calls(encoders):
    calls = []
    handles = [
        e.register_forward_hook(lambda module, args, output: calls.append(1))
        for e in dict.fromkeys(encoders)
    ]
    return calls, handles


@pytest.mark.parametrize("chunk_size, chunks", [(4, 4), (BATCH, 2), (1, 2 * BATCH)])
def test_every_chunk_is_encoded_once_and_all_but_the_kept_last_replayed_once(chunk_size, chunks):
    setup = make_setup(dropout=0.1)
    calls, handles = count_calls(setup.encoder_list())
    loss = cached_loss(setup.loss_fn, setup.encoders, setup.batches, chunk_size)
    first_pass = len(calls)
    setup.grads_of(loss)
    [h.remove() for h in handles]
    assert (first_pass, len(calls) - first_pass) == (chunks, chunks - 1)


def test_until_its_backward_a_call_holds_the_last_chunks_graph_only():
    setup = make_setup()
    outputs = []
    handle = setup.encoders[1].register_forward_hook(
        lambda module, args, output: outputs.append(output)
    )
    loss = cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4)
    handle.remove()
    assert loss.requires_grad and [output.requires_grad for output in outputs] == [False, True]


def test_a_frozen_last_branch_keeps_no_graph_and_the_others_get_their_gradients():
    torch.manual_seed(0)
    query, key = nn.Linear(4, 4).double(), nn.Linear(4, 4).double().requires_grad_(False)
    batches = [torch.randn(6, 4, dtype=torch.float64) for _ in "qk"]
    info_nce(query(batches[0]), key(batches[1])).backward()
    reference = [p.grad.clone() for p in query.parameters()]
    query.zero_grad()
    cached_loss(info_nce, [query, key], batches, 4).backward()
    assert max_relative_error([p.grad for p in query.parameters()], reference) <= 1e-12


def test_under_ddp_every_chunk_is_replayed_and_none_kept(one_rank_group):
    setup = make_setup()
    ddp = [DistributedDataParallel(e) for e in setup.encoders]
    calls, handles = count_calls(ddp)
    loss = cached_loss(setup.loss_fn, ddp, setup.batches, 4)
    first_pass = len(calls)
    setup.grads_of(loss)
    [h.remove() for h in handles]
    assert (first_pass, len(calls) - first_pass) == (4, 4)


def test_the_random_stream_after_a_step_is_where_the_same_mask_reference_leaves_it():
    setup = make_setup("symmetric", dropout=0.1)
    torch.manual_seed(11)
    setup.grads_of(cached_loss(setup.loss_fn, setup.encoders, setup.batches, 4))
    after_step = torch.get_rng_state()
    torch.manual_seed(11)
    setup.full_batch_loss(chunk_size=4)
    assert torch.equal(after_step, torch.get_rng_state())


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process: DDP's reducer and all-reduce run as on many
    ranks."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def counted_ddp(encoder):
    """`encoder` in DistributedDataParallel with a communication hook that counts the gradient
    all-reduces."""
    ddp, counts = DistributedDataParallel(encoder), []
    ddp.register_comm_hook(
        counts, lambda counts, bucket: (counts.append(1), allreduce_hook(None, bucket))[1]
    )
    return ddp, counts


@pytest.mark.parametrize(
    "shared, chunk_size",
    [(True, 4), (True, BATCH), (False, 4), (False, BATCH)],
    ids=["shared_4", "shared_batch", "two_encoders_4", "two_encoders_batch"],
)
def test_ddp_runs_one_allreduce_per_module_per_call(one_rank_group, shared, chunk_size):
    setup = make_setup("symmetric", shared, dropout=0.1)
    torch.manual_seed(5)
    reference = setup.grads_of(setup.full_batch_loss(chunk_size=chunk_size))
    wrapped = [counted_ddp(e) for e in dict.fromkeys(setup.encoder_list())]
    encoders = wrapped[0][0] if shared else [ddp for ddp, _ in wrapped]
    torch.manual_seed(5)
    grads = setup.grads_of(cached_loss(setup.loss_fn, encoders, setup.batches, chunk_size))
    assert [len(counts) for _, counts in wrapped] == [1] * len(wrapped)
    assert max_relative_error(grads, reference) <= 1e-12


# ------------------------------------------------------------------ late interaction (ColBERT)


class TokenVectors(nn.Module):
    """A multi-vector encoder as ColBERT's: one unit vector per real token, each chunk padded with
    zero vectors to its own longest text, so chunks come back with different lengths."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, batch):
        length = int(batch["attention_mask"].sum(dim=1).max())
        vectors = self.mix(self.embed(batch["input_ids"][:, :length]))
        return F.normalize(vectors, dim=-1) * batch["attention_mask"][:, :length, None]


def late_interaction_setup(n: int = 2 * BATCH, seed: int = 0):
    torch.manual_seed(seed)
    encoder = TokenVectors().double()
    generator = torch.Generator().manual_seed(seed)
    queries, docs = (random_token_batch(n, LENGTH, VOCAB, generator) for _ in "qd")
    return encoder, queries, docs


def test_late_interaction_scores_sum_each_query_tokens_best_match_and_skip_padding():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])  # two tokens and a padded one
    d = torch.tensor(
        [[[0.6, 0.8], [-1.0, 0.0], [0.0, 0.0]], [[-0.6, -0.8], [0.0, 0.0], [0.0, 0.0]]]
    )
    # query 0 vs doc 0: max(0.6, -1) + max(0.8, 0) = 1.4; vs doc 1 only -0.6 and -0.8 count
    assert torch.allclose(similarity(q, d), torch.tensor([[1.4, -1.4]]))


@pytest.mark.parametrize("chunk_size", [1, 5, 2 * BATCH])
def test_late_interaction_through_gradcache_gives_the_full_batch_gradients(chunk_size):
    encoder, queries, docs = late_interaction_setup()
    lengths = [
        int(queries["attention_mask"][s : s + chunk_size].sum(dim=1).max())
        for s in range(0, 2 * BATCH, chunk_size)
    ]
    assert chunk_size == 2 * BATCH or len(set(lengths)) > 1  # the chunks really differ
    full = info_nce(encoder(queries), encoder(docs))
    full.backward()
    reference = [p.grad.clone() for p in encoder.parameters()]
    encoder.zero_grad()
    cached = cached_loss(info_nce, encoder, [queries, docs], chunk_size)
    cached.backward()
    assert relative_error(cached, full) <= 1e-12
    for ours, truth in zip([p.grad for p in encoder.parameters()], reference):
        assert relative_error(ours, truth) <= 1e-12


def late_interaction_on_ranks(chunk_size: int) -> list:
    """A `launch` target: this rank's shard of the pairs through GradCache over a DDP token-vector
    encoder, loss = its share of InfoNCE over the gathered embeddings; the averaged gradients."""
    rank, world_size = rank_and_world_size()
    encoder, queries, docs = late_interaction_setup()
    share = len(queries["input_ids"]) // world_size
    mine = [
        {k: v[rank * share : (rank + 1) * share] for k, v in b.items()} for b in (queries, docs)
    ]
    ddp = DistributedDataParallel(encoder)

    def rank_loss(q, d):
        # every rank pads its token vectors to the longest text of all (gather needs one shape)
        q, d = (F.pad(z, (0, 0, 0, LENGTH - z.shape[1])) for z in (q, d))
        return rank_info_nce(gather_with_grad(q), gather_with_grad(d))

    cached_loss(rank_loss, ddp, mine, chunk_size).backward()
    return [p.grad for p in encoder.parameters()]


def test_late_interaction_through_gradcache_across_two_gloo_ranks_gives_the_full_batch_gradients():
    encoder, queries, docs = late_interaction_setup()
    info_nce(encoder(queries), encoder(docs)).backward()
    ranked = launch(late_interaction_on_ranks, nproc=2, args={"chunk_size": 4}, echo=False)
    for ours, truth in zip(ranked, [p.grad for p in encoder.parameters()]):
        assert relative_error(ours, truth) <= 1e-12
