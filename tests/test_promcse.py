"""Specification of the PromCSE experiment: SimCSE's recipe on a frozen encoder where only the deep
prompt and the MLP learn, trained through `gcbs_lib.train` with GradCache on the planted files of
test_simcse."""

import torch
from test_simcse import paper_root, tiny_config  # noqa: F401 (paper_root is a fixture)

from gcbs_lib.experiments import get
from gcbs_lib.train import load_checkpoint, load_config, train


def test_promcse_updates_only_the_prompt_and_the_mlp_through_gradcache(paper_root, tmp_path):  # noqa: F811
    config = tiny_config(
        "promcse", paper_root, pre_seq_len=3, chunk_size=3, checkpoint_every=1, max_steps=1
    )
    exp = get("promcse")(config.options, seed=0, device="cpu")
    exp.load_data()
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in exp.build_model().state_dict().items()}
    train(config, tmp_path)
    after = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"backbone.prompt", "mlp.0.weight", "mlp.0.bias"}
    assert before["backbone.prompt"].shape[3] == 3


def test_the_profiles_carry_promcses_recipe():
    promcse = load_config("promcse", "paper")
    assert (promcse.lr, promcse.batch_size, promcse.options.pre_seq_len) == (3e-2, 256, 16)
    assert (
        promcse.options.pooling == load_config("simcse", "paper").options.pooling == "cls_mlp_train"
    )
    # a measurement's size: every stand-in sentence once, from SimCSE's masked-LM start
    cpu = load_config("promcse", "cpu")
    simcse_start = load_config("simcse", "cpu").options.encoder
    assert (cpu.epochs, cpu.options.train_limit, cpu.options.encoder) == (1, None, simcse_start)
    assert load_config("promcse", "ci").chunk_size == 16  # the smoke test goes through GradCache
