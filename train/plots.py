"""Training curves from ``metrics.jsonl``: one PNG a person can glance at instead of reading numbers."""

from __future__ import annotations

import json
import pathlib


def plot_metrics(metrics: pathlib.Path, out: pathlib.Path) -> pathlib.Path | None:
    """Plot the training loss and the per-head top-1 accuracy (train and held-out) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    train = [r for r in rows if "train/loss" in r]
    if not train:
        return None
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    heads = sorted({k.split("head")[-1] for r in train for k in r if k.startswith("train/top1/head")}, key=int)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["train/loss"] for r in train], label="train loss (weighted sum)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    for h in heads:
        key = f"top1/head{h}"
        line, = ax_acc.plot([r["step"] for r in train if f"train/{key}" in r],
                            [r[f"train/{key}"] for r in train if f"train/{key}" in r], label=f"head {h} (train)")
        held = [r for r in evals if f"eval/{key}" in r]
        if held:
            ax_acc.scatter([r["step"] for r in held], [r[f"eval/{key}"] for r in held], color=line.get_color(),
                           marker="o", label=f"head {h} (held-out)")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("top-1 accuracy")
    ax_acc.legend(fontsize="small")
    fig.suptitle(metrics.parent.name)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
