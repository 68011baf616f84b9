"""Specification of MIL-NCE (`gcbs_lib.losses.mil_nce`) against cross-entropy, the official code and
loops."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gcbs_lib.check import relative_error
from gcbs_lib.losses import mil_nce

pytestmark = pytest.mark.usefixtures("float64_default")


def embeddings(b, n, d=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, d, generator=generator).requires_grad_(),
        torch.randn(n, d, generator=generator).requires_grad_(),
    )


def disjoint_bags(b, k):
    return torch.arange(b * k).view(b, k)


def reference(video, text, bag_idx, temperature, direction, exclude_idx=None, groups=None):
    """ℓ_i written as a loop over the sums of the definition; with `groups` (clip i's group
    groups[i], caption j's that of the clips whose bags hold it), the pairs (clip, caption of its
    group outside its bag) are excluded too."""
    s = video @ text.T / temperature
    excluded = (
        {(i, j) for i, row in enumerate(exclude_idx.tolist()) for j in row if j >= 0}
        if exclude_idx is not None
        else set()
    )
    if groups is not None:
        bags = [[j for j in row if j >= 0] for row in bag_idx.tolist()]
        caption_group = {j: groups[i] for i, bag in enumerate(bags) for j in bag}
        for i, bag in enumerate(bags):
            excluded |= {
                (i, j) for j, g in caption_group.items() if g == groups[i] and j not in bag
            }
    losses = []
    for i, row in enumerate(bag_idx.tolist()):
        bag = [j for j in row if j >= 0]
        terms = [s[i, j] for j in range(len(text)) if (i, j) not in excluded]
        if direction == "both":
            terms += [s[k, j] for k in range(len(video)) for j in bag if (k, j) not in excluded]
        losses.append(
            torch.stack(terms).logsumexp(0) - torch.stack([s[i, j] for j in bag]).logsumexp(0)
        )
    return torch.stack(losses)


def official_milnce(video, text):
    """The official MIL-NCE loss (antoine77340/MIL-NCE_HowTo100M, loss.py): B clips, B·K captions,
    bag i = rows i·K…"""
    x = (video @ text.T).view(video.shape[0], video.shape[0], -1)
    nominator = (x * torch.eye(x.shape[0])[:, :, None]).sum(dim=1).logsumexp(dim=1)
    denominator = torch.cat((x, x.permute(1, 0, 2)), dim=1).view(x.shape[0], -1).logsumexp(dim=1)
    return (denominator - nominator).mean()


def test_k1_v2t_is_cross_entropy_over_scores_over_temperature():
    video, text = embeddings(5, 5)
    s = video @ text.T / 0.1
    expected = F.cross_entropy(s, torch.arange(5))
    torch.testing.assert_close(
        mil_nce(video, text, disjoint_bags(5, 1), 0.1, "v2t"), expected, rtol=1e-14, atol=0
    )


def test_k1_both_is_cross_entropy_over_scores_beside_their_transpose():
    video, text = embeddings(5, 5)
    s = video @ text.T / 0.1
    expected = F.cross_entropy(torch.cat([s, s.T], dim=1), torch.arange(5))
    torch.testing.assert_close(
        mil_nce(video, text, disjoint_bags(5, 1), 0.1, "both"), expected, rtol=1e-14, atol=0
    )


def test_both_equals_the_official_code_on_disjoint_bags_of_k():
    video, text = embeddings(4, 12)
    torch.testing.assert_close(
        mil_nce(video, text, disjoint_bags(4, 3), 1.0, "both"),
        official_milnce(video, text),
        rtol=1e-14,
        atol=0,
    )


@pytest.mark.parametrize("direction", ["v2t", "both"])
def test_a_bag_of_k_identical_captions_equals_k1(direction):
    video, text = embeddings(4, 4)
    repeated = text.repeat_interleave(3, dim=0)
    torch.testing.assert_close(
        mil_nce(video, repeated, disjoint_bags(4, 3), 0.5, direction),
        mil_nce(video, text, disjoint_bags(4, 1), 0.5, direction),
        rtol=1e-13,
        atol=0,
    )


@pytest.mark.parametrize("direction", ["v2t", "both"])
def test_permuting_captions_within_a_bag_padding_included_changes_nothing(direction):
    video, text = embeddings(3, 9)
    bags = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1], [5, 6, 7, 8]])
    permuted = torch.stack(
        [
            row[torch.randperm(4, generator=torch.Generator().manual_seed(i))]
            for i, row in enumerate(bags)
        ]
    )
    assert not torch.equal(permuted, bags)
    torch.testing.assert_close(
        mil_nce(video, text, permuted, 0.3, direction, reduction="none"),
        mil_nce(video, text, bags, 0.3, direction, reduction="none"),
        rtol=1e-14,
        atol=0,
    )


@pytest.mark.parametrize(
    "direction, expected", [("v2t", lambda b: math.log(b)), ("both", lambda b: math.log(2 * b))]
)
def test_all_equal_scores_give_log_b_and_log_2b(direction, expected):
    b, k = 6, 4
    video, text = torch.ones(b, 3), torch.ones(b * k, 3)
    loss = mil_nce(video, text, disjoint_bags(b, k), 0.07, direction, reduction="none")
    torch.testing.assert_close(loss, torch.full((b,), expected(b)), rtol=1e-14, atol=0)


@pytest.mark.parametrize("direction", ["v2t", "both"])
def test_ragged_shared_bags_and_exclusions_follow_the_definition(direction):
    video, text = embeddings(4, 10)
    # caption 1 in two bags, 5 and 9 in none
    bags = torch.tensor([[0, 1, -1], [1, 2, 3], [4, -1, -1], [6, 7, 8]])
    exclude = torch.tensor([[9, 2], [0, -1], [-1, -1], [5, 4]])
    for ex in (None, exclude):
        torch.testing.assert_close(
            mil_nce(video, text, bags, 0.5, direction, reduction="none", exclude_idx=ex),
            reference(video, text, bags, 0.5, direction, ex),
            rtol=1e-13,
            atol=0,
        )


# clips 0, 1, 4 of one video (group 7), clips 2, 3 of another (group 2); caption 1 in two bags of
# group 7, captions 5 and 9 in none
GROUPED_BAGS = torch.tensor([[0, 1, -1], [1, 2, 3], [4, -1, -1], [6, 7, 8], [10, -1, -1]])
GROUPS = torch.tensor([7, 7, 2, 2, 7])


@pytest.mark.parametrize("direction", ["v2t", "both"])
@pytest.mark.parametrize("chunk_size", [None, 2, 100])
def test_same_group_captions_outside_the_bag_leave_both_sums(direction, chunk_size):
    video, text = embeddings(5, 11)
    exclude = torch.tensor([[9, 2], [0, -1], [-1, -1], [5, 4], [-1, -1]])
    options = dict(reduction="none", exclude_idx=exclude)
    masked = mil_nce(
        video, text, GROUPED_BAGS, 0.5, direction, chunk_size, groups=GROUPS, **options
    )
    expected = reference(video, text, GROUPED_BAGS, 0.5, direction, exclude, GROUPS.tolist())
    assert relative_error(masked, expected) <= 1e-13
    unmasked = mil_nce(video, text, GROUPED_BAGS, 0.5, direction, chunk_size, **options)
    assert not torch.isclose(masked.mean(), unmasked.mean())
    grads = [torch.autograd.grad(loss.sum(), (video, text)) for loss in (masked, expected)]
    assert max(map(relative_error, *grads)) <= 1e-12


@pytest.mark.parametrize("direction", ["v2t", "both"])
def test_clips_of_groups_that_never_repeat_give_exactly_the_unmasked_mil_nce(direction):
    video, text = embeddings(4, 9)
    bags = torch.tensor([[0, 1], [2, -1], [3, 4], [6, 7]])  # captions 5 and 8 in no bag
    losses = [mil_nce(video, text, bags, 0.5, direction, groups=g) for g in (None, torch.arange(4))]
    grads = [torch.autograd.grad(loss, (video, text)) for loss in losses]
    assert torch.equal(*losses) and all(map(torch.equal, *grads))


def test_groups_of_the_wrong_length_or_split_captions_are_refused():
    video, text = embeddings(5, 11)
    with pytest.raises(ValueError, match=r"one id per clip \(5\), got \(4,\)"):
        mil_nce(video, text, GROUPED_BAGS, groups=GROUPS[:4])
    with pytest.raises(ValueError, match="bags of clips of different groups"):
        mil_nce(video, text, GROUPED_BAGS, groups=torch.tensor([7, 8, 2, 2, 7]))


@pytest.mark.parametrize("direction", ["v2t", "both"])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
def test_chunked_denominator_equals_full_in_value_and_gradient(direction, chunk_size):
    video, text = embeddings(5, 13)
    temperature = torch.tensor(0.2, requires_grad=True)
    bags = torch.tensor([[0, 1, 2], [3, 4, -1], [5, -1, -1], [6, 7, 8], [2, 9, 10]])
    exclude = torch.tensor([[11, -1], [12, 0], [-1, -1], [5, 9], [-1, -1]])
    results = []
    for chunk in (None, chunk_size):
        loss = mil_nce(video, text, bags, temperature, direction, chunk, exclude_idx=exclude)
        results.append((loss, *torch.autograd.grad(loss, (video, text, temperature))))
    for full, chunked in zip(*results):
        assert relative_error(chunked, full) < 1e-13


class LargestTensor(TorchDispatchMode):
    """Records the most elements any single operation produced."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.largest = max(
            [self.largest] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        )
        return out


@pytest.mark.parametrize("direction", ["v2t", "both"])
def test_the_chunked_denominator_holds_nothing_larger_than_a_block_or_the_captions(direction):
    b, k, d, chunk = 64, 4, 8, 16
    video, text = embeddings(b, b * k, d=d)
    sizes = {}
    for name, chunk_size in (("full", None), ("chunked", chunk)):
        with LargestTensor() as probe:
            mil_nce(video, text, disjoint_bags(b, k), 0.1, direction, chunk_size).backward()
        sizes[name] = probe.largest
    assert sizes["full"] >= b * b * k
    # not even one N × chunk block
    assert sizes["chunked"] <= max(chunk * chunk, b * k * d) < b * k * chunk


def test_out_of_range_bag_indices_are_refused():
    video, text = embeddings(2, 4)
    for bad in (4, -2):
        with pytest.raises(ValueError, match="outside"):
            mil_nce(video, text, torch.tensor([[0, 1], [2, bad]]))


def test_empty_bags_duplicate_captions_and_bad_shapes_are_refused():
    video, text = embeddings(2, 4)
    with pytest.raises(ValueError, match="empty bag"):
        mil_nce(video, text, torch.tensor([[0, 1], [-1, -1]]))
    with pytest.raises(ValueError, match="twice in one bag"):
        mil_nce(video, text, torch.tensor([[0, 0], [2, 3]]))
    with pytest.raises(ValueError, match="long tensor"):
        mil_nce(video, text, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="long tensor"):
        mil_nce(video, text, torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    with pytest.raises(ValueError, match=r"video \[B, D\]"):
        mil_nce(video, text[:, :3], torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="both in clip"):
        mil_nce(video, text, torch.tensor([[0], [1]]), exclude_idx=torch.tensor([[0], [-1]]))


def test_nan_embeddings_and_bad_settings_are_refused():
    video, text = embeddings(2, 4)
    bags = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="NaN or inf"):
        mil_nce(video, text.detach().index_fill(0, torch.tensor([2]), float("nan")), bags)
    with pytest.raises(ValueError, match="NaN or inf"):
        mil_nce(video.detach().index_fill(0, torch.tensor([0]), float("inf")), text, bags)
    for kwargs, message in [
        ({"temperature": 0.0}, "temperature"),
        ({"direction": "t2v"}, "direction"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"reduction": "sum"}, "reduction"),
    ]:
        with pytest.raises(ValueError, match=message):
            mil_nce(video, text, bags, **kwargs)
