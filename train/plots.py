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
    fig, (ax_loss, ax_acc, ax_tau) = plt.subplots(1, 3, figsize=(16, 4))
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
    taus = [r for r in evals if "eval/predicted_tau" in r]
    ax_tau.plot([r["step"] for r in taus], [r["eval/predicted_tau"] for r in taus], marker="o")
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("acceptance length predicted (held-out)")
    ax_tau.set_title("for the run's tree", fontsize="small")
    fig.suptitle(metrics.parent.name)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out


def learning_curve_table(metrics: pathlib.Path) -> str:
    """Markdown table of every held-out evaluation in ``metrics.jsonl``: step, top-1 by depth and the
    acceptance length those accuracies predict for the run's tree; '' when there is none."""
    rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    evals = [r for r in rows if "eval/predicted_tau" in r]
    if not evals:
        return ""
    depths = sorted({int(k.rsplit("head", 1)[1]) for r in evals for k in r if k.startswith("eval/top1/head")})
    lines = ["| step | " + " | ".join(f"top-1 depth {d + 1}" for d in depths) + " | predicted tau |",
             "|---:|" + "---:|" * (len(depths) + 1)]
    for r in evals:
        cells = [f"{r[f'eval/top1/head{d}']:.3f}" if f"eval/top1/head{d}" in r else "-" for d in depths]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + f" | {r['eval/predicted_tau']:.2f} |")
    return "\n".join(lines)
