"""The verify-cost surface T(B, m): seconds of one target forward over B rows of m new tokens each, every
row after ``context`` cached tokens, measured on this machine.

A speculative step at batch size B verifies m = 1 + (draft tokens) per row in one forward, so whether
drafting pays at B depends on T(B, m) / T(B, 1): near 1 where the forward is bound by reading the
weights (small B on a GPU: more tokens per row are almost free), growing towards m where it is bound
by compute (large B, or a CPU). :class:`CostSurface` holds the measured grid and reads it between
grid points; :func:`cost_surface` measures it once per (machine, target, dtype, device, threads, grid)
and caches it as JSON beside the batch-1 cost curve (inference/schedule.py). ``selfdraft costs``
prints it as a table and plots it.

Before it allocates anything, the measurement checks that the largest batch's key/value cache fits
the memory left on the device and names the largest batch that does when it does not.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import random
import statistics
import time
from dataclasses import asdict, dataclass

from selfdraft.errors import SelfdraftError
from selfdraft.files import write_atomic
from selfdraft.inference.schedule import COST_CONTEXT, cost_dir
from selfdraft.machine import available_host_bytes, describe


@dataclass(frozen=True)
class CostSurface:
    """``seconds[i][j]`` = T(batch_sizes[i], tokens[j])."""

    batch_sizes: tuple[int, ...]
    tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    target: str
    dtype: str
    device: str
    context: int
    machine: dict

    def __post_init__(self):
        for name in ("batch_sizes", "tokens"):
            values = getattr(self, name)
            if not values or values[0] < 1 or list(values) != sorted(set(values)):
                raise SelfdraftError(f"a cost surface needs increasing positive {name}, got {list(values)}")
        if len(self.seconds) != len(self.batch_sizes) or any(len(r) != len(self.tokens) for r in self.seconds):
            raise SelfdraftError(f"a cost surface needs {len(self.batch_sizes)} x {len(self.tokens)} times")

    def __call__(self, batch: int, m: int) -> float:
        """T(batch, m), linear in each of batch and m between grid points (clamped at the grid's edges)."""
        return _interpolate(self.batch_sizes, [_interpolate(self.tokens, row, m) for row in self.seconds], batch)

    def relative(self, batch: int, m: int) -> float:
        """T(batch, m) / T(batch, 1): what verifying m - 1 drafts per row costs, in plain steps."""
        return self(batch, m) / self(batch, 1)

    def table(self) -> str:
        """Markdown: T in ms per (batch, tokens per row), and T(B, m) / T(B, 1) below each time."""
        head = "| batch \\ tokens per row | " + " | ".join(str(m) for m in self.tokens) + " |"
        rule = "|---|" + "---|" * len(self.tokens)
        rows = [f"| {b} | " + " | ".join(f"{1e3 * t:.1f} ms ({t / r[0]:.2f}x)" for t in r) + " |"
                for b, r in zip(self.batch_sizes, self.seconds)]
        return "\n".join([head, rule, *rows])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostSurface":
        return cls(**{**d, "batch_sizes": tuple(d["batch_sizes"]), "tokens": tuple(d["tokens"]),
                      "seconds": tuple(tuple(r) for r in d["seconds"])})


def _interpolate(xs, ys, x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] if len(xs) == 1 else ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            w = (x - xs[i]) / (xs[i + 1] - xs[i])
            return ys[i] + w * (ys[i + 1] - ys[i])
    raise AssertionError("unreachable: xs are increasing")


def kv_bytes_per_row(model, tokens: int) -> int:
    """Bytes of the key/value cache of one row holding ``tokens`` tokens."""
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * tokens * next(model.parameters()).element_size()


def free_bytes(device) -> int:
    """Memory the device can still give: CUDA's free memory, else the host's MemAvailable."""
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    available = available_host_bytes()
    return 1 << 62 if available is None else available  # unknown: no limit


def check_batch_fits(model, batch: int, tokens: int, *, share: float = 0.8) -> None:
    """Refuse, before allocating, a batch whose key/value cache (plus its logits) would take more than
    ``share`` of the memory left on the model's device, naming the largest batch that fits."""
    text = model.config.get_text_config()
    row = kv_bytes_per_row(model, tokens) + 4 * tokens * text.vocab_size  # the cache, and float logits
    budget = share * free_bytes(model.device)
    if batch * row > budget:
        fits = int(budget // row)
        raise SelfdraftError(f"a batch of {batch} rows of {tokens} tokens needs about {batch * row / 2**30:.1f} GiB for its "
                             f"key/value cache and logits, more than {share:.0%} of the {budget / share / 2**30:.1f} GiB left "
                             f"on {model.device}; the largest batch that fits is {fits}")


def measure_cost_surface(target, batch_sizes, tokens, *, context: int = COST_CONTEXT, reps: int = 3) -> CostSurface:
    """Time the target's forward over B rows x m new tokens after ``context`` cached tokens per row, for
    every B in ``batch_sizes`` and m in ``tokens`` (median of ``reps`` after one warm-up; random ids)."""
    import torch

    from selfdraft.heads.target_layers import TargetLayers

    model = target.model
    text = model.config.get_text_config()
    layers = TargetLayers.of(model)  # the decoder's cache, masks and rollback for this family (any layer kinds)
    mask_dtype = next(model.parameters()).dtype
    batch_sizes, tokens = tuple(sorted(set(batch_sizes))), tuple(sorted(set(tokens)))
    CostSurface(batch_sizes, tokens, tuple((0.0,) * len(tokens) for _ in batch_sizes), "", "", "", 0, {})  # checks the grid
    check_batch_fits(model, batch_sizes[-1], context + tokens[-1])
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    with torch.inference_mode():
        for b in batch_sizes:
            cache = layers.new_cache(model)
            ids = torch.randint(text.vocab_size, (b, context), generator=gen).to(model.device)
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            layers.start_recording(cache)  # recurrent layers: so that crop() rolls them back
            row = []
            for m in tokens:
                positions = torch.arange(context, context + m, device=model.device).expand(b, m)
                # The masks a batched verify of a chain feeds (inference/batch.py): every cached token visible,
                # causal among the new ones; sliding and chunked layers get their windows.
                keys = torch.arange(context + m, device=model.device).expand(b, context + m)
                visible = keys[:, None, :] <= positions[:, :, None]  # (b, m, context + m)
                mask = layers.masks(visible, positions, keys, mask_dtype)
                samples = []
                for _ in range(reps + 1):
                    new = torch.tensor([[rng.randrange(text.vocab_size) for _ in range(m)] for _ in range(b)],
                                       device=model.device)
                    start = time.perf_counter()
                    out = model(input_ids=new, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
                    float(out.logits[-1, -1, 0])  # wait for the device
                    samples.append(time.perf_counter() - start)
                    cache.crop(-m)  # back to the context (transformers: a negative count drops tokens)
                row.append(statistics.median(samples[1:]))
            for j in range(1, len(row)):  # a larger forward costs at least what a smaller one does
                row[j] = max(row[j], row[j - 1])
            seconds.append(tuple(row))
            del cache
    return CostSurface(batch_sizes, tokens, tuple(seconds), target.identity.name,
                       str(model.dtype).replace("torch.", ""), str(model.device), context, describe(str(model.device)))


def cost_surface(target, batch_sizes, tokens, cache_dir: str | os.PathLike | None = None) -> CostSurface:
    """:func:`measure_cost_surface`, measured once per (machine, target, dtype, device, grid) and cached
    (written atomically; a damaged file is measured again)."""
    model = target.model
    batch_sizes, tokens = tuple(sorted(set(batch_sizes))), tuple(sorted(set(tokens)))
    from selfdraft.heads.small_batch import kernel_signature

    key = json.dumps({"machine": describe(str(model.device)), "target": target.identity.to_dict(), "dtype": str(model.dtype),
                      "device": str(model.device), "batch_sizes": batch_sizes, "tokens": tokens, "context": COST_CONTEXT,
                      "few_row_kernel": kernel_signature(model)}, sort_keys=True, default=str)
    path = cost_dir(cache_dir) / f"surface-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        try:
            return CostSurface.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError, SelfdraftError):
            pass
    surface = measure_cost_surface(target, batch_sizes, tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(surface.to_dict(), indent=1))
    return surface


def plot_cost_surface(surface: CostSurface, path: str | os.PathLike) -> pathlib.Path:
    """A PNG: T(B, m) / T(B, 1) against m, one line per batch size (written atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0, 3.8))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    for b, row in zip(surface.batch_sizes, surface.seconds):
        ax.plot(surface.tokens, [t / row[0] for t in row], marker="o", label=f"batch {b} ({1e3 * row[0]:.0f} ms at 1)")
    ax.plot(surface.tokens, surface.tokens, linestyle=":", color="grey", label="proportional to tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens per row (root + drafts)")
    ax.set_ylabel("T(B, m) / T(B, 1)")
    ax.set_title(f"verify cost, {surface.target} {surface.dtype} on {surface.device}", fontsize=9)
    ax.legend(fontsize=7)
    figure.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=110)
    write_atomic(out, png.getvalue())
    return out
