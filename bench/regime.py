"""Each comparison's GCBS regime at epoch 0, planned from its start model by the trainer's own
`gcbs` arm: N, the batch B, k = (1 − q)·N neighbours per item (or the profile's
`gcbs_neighbours`), k / B, and the published graph's `edges_per_item` and `isolated_share` as
`_plan_epoch` logs them. Far below the paper's k (about 20 to 1,000), most items have no edge and
RCM's tie order places them.

    # every experiment's ci profile (tiny data: the numbers say how to read, not what holds)
    python bench/regime.py
    python bench/regime.py --experiments codesearch --profile cpu   # builds missing stand-ins
"""

from __future__ import annotations

import argparse
import tempfile

from gcbs_lib.train import Trainer, load_config

EXPERIMENTS = ["codesearch", "milnce", "moco", "simcse", "promcse"]


def regime(experiment: str, profile: str, seed: int) -> dict:
    """The epoch-0 graph of `experiment`'s `profile` at `seed` as the trainer's gcbs arm logs it."""
    config = load_config(experiment, profile, {"seed": seed, "sampler": "gcbs"})
    config.progress = False
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(config, folder)  # data and the start model (init stream of `seed`)
        trainer.run.resume(trainer.stateful, trainer.total_steps, trainer.world_size)  # as `fit`
        trainer._plan_epoch()
        logged = trainer.run.records("epoch")[-1]
        n = len(trainer._items(0))
    graph = {name: logged[name] for name in ("edges_per_item", "isolated_share")}
    k, b = logged["neighbours"], config.batch_size
    return dict(experiment=experiment, n=n, b=b, k=k, k_over_b=k / b, **graph)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiments", nargs="+", default=EXPERIMENTS, choices=EXPERIMENTS)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"| experiment ({args.profile}) | N | B | k | k / B | edges per item | isolated share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for experiment in args.experiments:
        r = regime(experiment, args.profile, args.seed)
        print(
            f"| {experiment} | {r['n']:,} | {r['b']} | {r['k']:.2f} | {r['k_over_b']:.3f} | "
            f"{r['edges_per_item']:.2f} | {r['isolated_share']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
