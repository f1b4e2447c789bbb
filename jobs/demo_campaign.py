"""Write a demo campaign (spec + requests) for a model directory: the embedded default of
`scripts/campaign_demo.sh`. Requests name random training samples of the model (seeded).

The method is the variant ``newton-head`` (configs/methods/newton-head.yaml: the decision layer
retrained by converged matrix-free Newton over the frozen layers' cached outputs, from the state
prepared once per model version and carried from batch to batch): the removal a classifier is
served by in seconds. It adds no privacy noise, so the budget allows non-private releases."""
from __future__ import annotations

import csv
from pathlib import Path

import click
import torch
import yaml

from pipeline.removal import training_set
from pipeline.models.card import read_card

DEMO_METHOD = "newton-head"


@click.command()
@click.option("--model-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--store", type=click.Path(path_type=Path), required=True)
@click.option("--name", required=True, help="model name in the store")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--requests", "count", type=click.IntRange(min=1), default=8)
@click.option("--batch-size", type=click.IntRange(min=1), default=2)
@click.option("--seed", type=int, default=0)
def main(model_dir: Path, store: Path, name: str, out: Path, count: int, batch_size: int, seed: int) -> None:
    ids = training_set(read_card(model_dir)).sample_ids
    picks = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))[:count]].tolist()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["request_id", "subject", "sample_ids"])
        for i, sample in enumerate(picks):
            writer.writerow([f"demo-{i:04d}", f"subject-{i:04d}", str(sample)])
    spec = {
        "name": "demo", "model": {"store": str(store.resolve()), "name": name}, "method": DEMO_METHOD,
        "batch_size": batch_size, "seed": seed,
        "limits": {"budget": {"epsilon": 50.0, "delta": 1.0e-4, "composition": "pld", "allow_non_private": True},
                   "retain_accuracy_margin": 0.05},
        "requests": "requests.csv",
    }
    (out / "campaign.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    click.echo(f"wrote {out / 'campaign.yaml'} with {count} requests")


if __name__ == "__main__":
    main()
