"""The prepared GPU check (issue 13): what a session lent a GPU runs there in one call.

    python scripts/gpu_check.py --prepare --assets .gpu_assets         # here: configs, tokenizer, prompts
    python scripts/gpu_check.py --device cuda --assets .gpu_assets --out OUT    # there (gpu_check.sh run)
    python scripts/gpu_check.py --device cpu --tiny --assets .gpu_assets --out OUT  # here: the smoke run
    python scripts/gpu_check.py --predict CPU_BENCH/results.json --gpu OUT/gpu_check.json

The device machine has no network and no datasets, wandb, deepspeed or gguf, and a 98 MB GGUF does not
travel, so every target here is built from a config with random weights: the SmolLM2-135M shape with
its real tokenizer (exactness, sampling, training steps, a bench) and the Llama-3.1-8B shape in bf16
(the verify-cost curve, the EAGLE-3 drafter's cost per depth, a training step at a 128k vocabulary).
Acceptance lengths do not depend on the hardware: the CPU measures them with trained drafters, this
check measures what a forward costs on the GPU, and ``--predict`` combines the two:

    predicted speed-up = tau * T_verify(1) / (T_verify(1 + nodes) + T_draft)

(tau: tokens per target forward; T_verify(M): one target forward over M tokens at the context;
T_draft: the drafter's cost per step at the tree's depth). Each section runs on its own: a failure is
recorded in gpu_check.json and the rest still runs. Every figure goes to OUT/gpu_check.json, the
bench to OUT/bench/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]

LLAMA_31_8B = {
    # meta-llama/Llama-3.1-8B-Instruct's config.json (the shape; the weights are random here).
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "attention_bias": False, "mlp_bias": False,
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
"""--tiny: the same vocabularies and tokenizer, a toy body (the smoke run on a CPU)."""
BLOCKED = ("datasets", "wandb", "deepspeed", "gguf")
"""Packages the device machine lacks: the check hides them here too, so a smoke run that passes here
does not need them there."""


BLOCKER = f"""
import sys

BLOCKED = {BLOCKED!r}


class _Without:
    \"\"\"A meta-path finder that finds nothing of the BLOCKED packages (as if not installed) and asks the
    finder it wraps for everything else.\"\"\"

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [_Without(f) for f in sys.meta_path]
"""
"""Makes the BLOCKED packages invisible to imports and to ``importlib.util.find_spec`` (transformers'
availability checks), in this process and, as a sitecustomize, in the pytest subprocess."""


def log(message: str) -> None:
    print(message, flush=True)


# --- here: what travels ------------------------------------------------------------------------------

def prepare(assets: pathlib.Path) -> None:
    """The SmolLM2 config and tokenizer files, the 8B config, and the bench prompts as JSONL."""
    from selfdraft.heads.target import target_folder
    from selfdraft.inference.bench.tasks import task_prompts

    assets.mkdir(parents=True, exist_ok=True)
    smol = assets / "smollm2"
    smol.mkdir(exist_ok=True)
    source = target_folder("smollm2-135m")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy2(source / name, smol / name)
    (assets / "llama-3.1-8b.json").write_text(json.dumps(LLAMA_31_8B, indent=1) + "\n")
    for task in ("mt_bench", "humaneval"):
        rows = [{"id": p.id, "prompt": p.text, "chat": p.chat} for p in task_prompts(task, 8)]
        (assets / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip())
    (assets / "MANIFEST.json").write_text(json.dumps({"commit": commit, "dirty": dirty, "smollm2_from": str(source)}) + "\n")
    log(f"prepared {assets}: {sorted(p.name for p in assets.rglob('*') if p.is_file())}")


# --- the check ---------------------------------------------------------------------------------------

class Check:
    """Runs sections against a deadline; collects every figure into one JSON-able dict."""

    def __init__(self, args):
        import torch

        self.args, self.torch = args, torch
        self.device = torch.device(args.device)
        self.tiny = args.tiny
        self.assets = pathlib.Path(args.assets)
        self.out = pathlib.Path(args.out)
        self.deadline = time.monotonic() + args.budget
        self.report: dict = {"sections": {}}
        self.work = self.out / "work"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def section(self, name: str, needs: float = 0.0):
        """Record a section's seconds and status; skip it when less than ``needs`` seconds are left."""
        entry = self.report["sections"].setdefault(name, {})
        if self.args.sections and name != "environment" and name not in self.args.sections.split(","):
            entry.update(status="skipped", reason="not in --sections")
            yield None
            return
        if self.left() < needs:
            entry.update(status="skipped", reason=f"{self.left():.0f} s left of the budget, it needs about {needs:.0f}")
            log(f"== {name}: skipped ({entry['reason']})")
            yield None
            return
        log(f"== {name} ({self.left():.0f} s left)")
        start = time.monotonic()
        try:
            yield entry
            entry["status"] = "ok"
        except Exception as err:  # recorded, then the next section runs
            entry.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:])
            log(f"!! {name} failed: {type(err).__name__}: {err}\n{traceback.format_exc()[-2500:]}")
        finally:
            entry["seconds"] = round(time.monotonic() - start, 1)
            self.sync()
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()
            self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str) + "\n")

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def clock(self) -> float:
        self.sync()
        return time.perf_counter()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return round(self.torch.cuda.max_memory_allocated(self.device) / 2**30, 2) if self.device.type == "cuda" else None

    # --- targets --------------------------------------------------------------------------------------

    def config(self, which: str):
        from transformers import AutoConfig, LlamaConfig

        if which == "smollm2":
            cfg = AutoConfig.from_pretrained(self.assets / "smollm2")
        else:
            data = json.loads((self.assets / "llama-3.1-8b.json").read_text())
            data.pop("architectures"), data.pop("model_type")
            cfg = LlamaConfig(**data)
            cfg.architectures = ["LlamaForCausalLM"]
        if self.tiny:
            for key, value in TINY.items():
                setattr(cfg, key, value)
        return cfg

    def target(self, which: str, dtype):
        """A selfdraft Target with random weights of the ``which`` shape, built on the device."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from selfdraft.heads.target import Target, target_identity

        torch = self.torch
        torch.manual_seed(0)
        cfg = self.config(which)
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        model.eval().requires_grad_(False)
        if which == "smollm2":
            tokenizer = AutoTokenizer.from_pretrained(self.assets / "smollm2")
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        else:
            tokenizer = None
        return Target(model=model, tokenizer=tokenizer,
                      identity=target_identity(f"random-{which}", model.config, tokenizer, type(model).__name__))

    def prompts(self, task: str, n: int, tokenizer) -> list[list[int]]:
        from selfdraft.inference.api import encode_prompt
        from selfdraft.inference.prompts import jsonl_prompts

        return [encode_prompt(tokenizer, p.text, p.chat) for p in jsonl_prompts(self.assets / f"{task}.jsonl", n)]

    # --- sections -------------------------------------------------------------------------------------

    def environment(self, entry: dict) -> None:
        import transformers

        torch = self.torch
        entry.update(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                     cuda=torch.version.cuda, device=str(self.device), tiny=self.tiny, machine=platform.machine())
        manifest = self.assets / "MANIFEST.json"
        if manifest.is_file():
            entry["prepared_from"] = json.loads(manifest.read_text())
        if self.device.type == "cuda":
            from selfdraft.inference.bench.run import _gpu

            entry["gpu"] = _gpu(self.device)
            entry["bf16_supported"] = torch.cuda.is_bf16_supported()
        else:
            from selfdraft.machine import cpu_flags, cpu_name

            entry.update(cpu=cpu_name(), cpu_flags=cpu_flags(), threads=torch.get_num_threads())
        log(json.dumps(entry))

    def drafters(self, target, which: set[str] | None = None) -> dict:
        """name -> a function making a drafter around random drafter weights (and the target itself as a
        draft model: it accepts almost everything, which exercises long accepted paths)."""
        import torch

        from selfdraft.configs.decode import DRAFT_MODEL_TREE, GPU_TREE, TreeConfig
        from selfdraft.heads.kinds.eagle import new_drafter
        from selfdraft.heads.kinds.medusa.module import MedusaHeads
        from selfdraft.inference.drafters import DraftModelDrafter, NoDrafter, PromptLookupDrafter
        from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter
        from selfdraft.heads.kinds.medusa.decode import MedusaDrafter

        model = target.model
        text = model.config.get_text_config()

        def eagle(kind, tree):
            torch.manual_seed(1)
            module = new_drafter(model, kind, draft_vocab_size=4096 if kind == "eagle3" else None)
            if kind == "eagle3":
                module.set_vocab_map(torch.randperm(text.vocab_size)[:4096].sort().values)
            return EagleTreeDrafter(module, model, tree)

        def medusa():
            torch.manual_seed(2)
            heads = MedusaHeads(text.hidden_size, text.vocab_size, num_heads=4, num_layers=1)
            with torch.no_grad():
                for p in heads.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            return MedusaDrafter(heads, model)

        def block(kind):
            from selfdraft.heads.kinds.block.decode import BlockDrafter
            from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims

            torch.manual_seed(3)
            dims = (DSparkDims if kind == "dspark" else DFlashDims).shaped_like(
                text, block_size=8, num_layers=1, draft_vocab_size=4096, mask_token_id=text.vocab_size - 1,
                target_layers=tuple(sorted({2, text.num_hidden_layers // 2, text.num_hidden_layers - 2})),
                **({"markov_rank": 64} if kind == "dspark" else {}))
            module = BlockHead(dims)
            module.set_vocab_map(torch.randperm(text.vocab_size)[:4096].sort().values)
            return BlockDrafter(module, model, TreeConfig(depth=dims.drafts_per_block, top_k=1, max_nodes=8))

        makers = {
            "none": NoDrafter,
            "dflash-block-8": lambda: block("dflash"),
            "dspark-block-8": lambda: block("dspark"),
            "prompt-lookup": PromptLookupDrafter,
            "eagle3-60-nodes": lambda: eagle("eagle3", GPU_TREE),
            "eagle-cpu-tree": lambda: eagle("eagle", TreeConfig()),
            "medusa": medusa,
            "self-draft-tree": lambda: DraftModelDrafter.for_target(target, target, dataclasses.replace(DRAFT_MODEL_TREE, depth=4, top_k=2, max_nodes=30)),
        }
        return {k: v for k, v in makers.items() if which is None or k in which}

    def exactness(self, entry: dict) -> None:
        """fp32: every drafter's greedy output equals transformers' generate(), token for token; sampling
        with one seed twice gives the same tokens on this device."""
        from selfdraft.configs.decode import DecodeConfig
        from selfdraft.inference.decode import speculative_decode
        from selfdraft.inference.session import CausalLMSession

        torch = self.torch
        target = self.target("smollm2", torch.float32)
        n_new = 24 if self.tiny else 64
        per_task = 1 if self.tiny else 2
        prompts = self.prompts("mt_bench", per_task, target.tokenizer) + self.prompts("humaneval", per_task, target.tokenizer)
        references = []
        for ids in prompts:
            x = torch.tensor([ids], device=self.device)
            out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new,
                                        eos_token_id=None, pad_token_id=0)
            references.append(out[0, len(ids):].tolist())
        rows = {}
        for name, make in self.drafters(target).items():
            drafter = make()
            same, forwards, tokens, start = 0, 0, 0, self.clock()
            for ids, ref in zip(prompts, references):
                session = CausalLMSession(target.model, hidden_layers=drafter.hidden_layers)
                out = speculative_decode(session, ids, drafter, DecodeConfig(max_new_tokens=n_new, stop_on_eos=False))
                same += out.token_ids == ref
                forwards += out.stats.target_forwards
                tokens += len(out.token_ids)
            seconds = self.clock() - start
            sampled = []
            for _ in range(2):
                session = CausalLMSession(target.model, hidden_layers=drafter.hidden_layers)
                sampled.append(speculative_decode(session, prompts[0], drafter, DecodeConfig(
                    max_new_tokens=n_new, temperature=0.8, top_p=0.95, seed=7, stop_on_eos=False)).token_ids)
            rows[name] = {"exact_prompts": f"{same}/{len(prompts)}", "tau": round(tokens / forwards, 3),
                          "tokens_per_second": round(tokens / seconds, 1), "sampling_reproducible": sampled[0] == sampled[1],
                          "syncs_per_step": self.syncs_per_step(target, drafter, prompts[0], n_new)}
            log(f"   {name:16s} exact {same}/{len(prompts)}  tau {tokens / forwards:.2f}  {tokens / seconds:7.1f} tok/s  "
                f"seeded sampling reproducible: {sampled[0] == sampled[1]}  "
                f"CUDA syncs per target forward (greedy, sampled): {rows[name]['syncs_per_step']}")
        entry["drafters"] = rows
        entry["all_exact"] = all(r["exact_prompts"] == f"{len(prompts)}/{len(prompts)}" for r in rows.values())
        entry["new_tokens"] = n_new
        del target

    def syncs_per_step(self, target, drafter, prompt: list[int], n_new: int) -> list[float] | None:
        """Synchronising CUDA operations per target forward, as torch's sync debug mode reports them (it
        sees what a Python-level count cannot: nonzero, boolean indexing, blocking copies), greedy and
        sampled; None off CUDA."""
        import warnings

        from selfdraft.configs.decode import DecodeConfig
        from selfdraft.inference.decode import speculative_decode
        from selfdraft.inference.session import CausalLMSession

        if self.device.type != "cuda":
            return None
        torch = self.torch
        counts = []
        for config in (DecodeConfig(max_new_tokens=n_new, stop_on_eos=False),
                       DecodeConfig(max_new_tokens=n_new, temperature=0.8, top_p=0.95, seed=7, stop_on_eos=False)):
            session = CausalLMSession(target.model, hidden_layers=drafter.hidden_layers)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = speculative_decode(session, prompt, drafter, config)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            counts.append(round(syncs / out.stats.target_forwards, 1))
        return counts

    def pytest_subset(self, entry: dict) -> None:
        """The exactness suites with SELFDRAFT_TEST_DEVICE set to this device."""
        # The quick files first, the chi-square file (minutes on a GPU: many small sampled steps) last.
        files = ["tests/test_tree_session.py", "tests/test_decode_devices.py", "tests/test_greedy_exact.py",
                 "tests/test_sampling_exact.py"]
        env = dict(os.environ, SELFDRAFT_TEST_DEVICE=str(self.device))
        limit = max(30, int(self.left()) - 10)  # the last section: what is left of the budget
        # -P: not the working directory first on sys.path, where the repository's own selfdraft/ folder (without
        # heads/, configs/, ...) would hide the package-dir shim that gpu_check.sh builds.
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        args = [sys.executable, *safe_path, "-m", "pytest", "-v", "-p", "no:cacheprovider", *files]
        if self.args.pytest_k:
            args += ["-k", self.args.pytest_k]
        if self.tiny:  # the smoke run checks the files import without the blocked packages; CI runs them
            args.append("--collect-only")
            env["PYTHONPATH"] = os.pathsep.join([str(self.work / "blocker"), env.get("PYTHONPATH", "")])
            (self.work / "blocker").mkdir(parents=True, exist_ok=True)
            (self.work / "blocker" / "sitecustomize.py").write_text(BLOCKER)
        # A line per test, straight into OUT/pytest.log: what ran comes back even if the device call is cut short.
        log_path = self.out / "pytest.log"
        with open(log_path, "w") as sink:
            try:
                code = subprocess.run(args, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        lines = log_path.read_text(errors="replace").strip().splitlines()
        tail = lines[-25:]
        log("\n".join("   " + line for line in tail))
        entry.update(command=" ".join(args[1:]), returncode=code, summary=tail[-1] if tail else "", tail=tail,
                     passed=sum(" PASSED" in line for line in lines), failed=sum(" FAILED" in line for line in lines))
        if code != 0:
            raise RuntimeError(f"pytest exited {code}: {entry['summary']}")

    def training(self, entry: dict, which: str, kinds: list[str], batch: int, length: int, steps: int) -> None:
        """A few optimizer steps of each drafter kind on a bf16 target under bf16 autocast: peak memory,
        tokens/s, finite losses."""
        from selfdraft.configs.run import load_run_config
        from selfdraft.train.objectives import build_objective

        torch = self.torch
        target = self.target(which, torch.bfloat16)
        vocab = target.model.config.get_text_config().vocab_size
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        attention = torch.ones(batch, length, dtype=torch.long)
        loss_mask = torch.ones(batch, length, dtype=torch.long)
        loss_mask[:, : length // 8] = 0  # a prompt
        data = [(ids[b].numpy(), loss_mask[b].numpy()) for b in range(batch)]
        batch_tensors = [t.to(self.device) for t in (ids, attention, loss_mask)]
        presets = {"eagle3": ["drafter.kind=eagle3", "drafter.eagle.draft_vocab_size=32000"], "medusa": [], "eagle": ["drafter.kind=eagle"],
                   "dflash": ["drafter.kind=dflash", "drafter.block.draft_vocab_size=32000"],
                   "dspark": ["drafter.kind=dspark", "drafter.block.draft_vocab_size=32000"]}
        rows = {}
        for kind in kinds:
            config = load_run_config("smoke_cpu", presets[kind])
            objective = build_objective(config, target.model, data).to(self.device)
            objective.train()
            params = [p for p in objective.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            losses, times = [], []
            self.reset_peak()
            for step in range(steps + 1):  # the first step warms up (kernels, allocator), untimed
                start = self.clock()
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    loss, _ = objective(*batch_tensors)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if step:
                    times.append(self.clock() - start)
            per_step = statistics.median(times)
            rows[kind] = {"batch": f"{batch}x{length}", "vocab": vocab, "trainable_params_m": round(sum(p.numel() for p in params) / 1e6, 1),
                          "seconds_per_step": round(per_step, 4), "tokens_per_second": round(batch * length / per_step),
                          "peak_memory_gib": self.peak_gib(), "losses": [round(x, 4) for x in losses],
                          "finite": all(x == x and abs(x) != float("inf") for x in losses)}
            log(f"   {which} {kind:7s} {batch}x{length}: {per_step * 1e3:8.1f} ms/step  {batch * length / per_step:9.0f} tok/s  "
                f"peak {self.peak_gib()} GiB  losses {rows[kind]['losses']}")
            del objective, optimizer, params
        entry[which] = rows
        del target

    def verify_curve(self, entry: dict) -> dict:
        """One target forward over M tree tokens at two contexts, bf16, 8B shape; and the EAGLE-3 drafter's
        proposal cost by depth. Returns the target for the next section."""
        import random

        from selfdraft.inference.session import CausalLMSession
        from selfdraft.inference.tree import DraftTree, build_tree_buffers

        torch = self.torch
        dtype = torch.bfloat16 if (self.device.type == "cuda" or not self.tiny) else torch.float32
        target = self.target("llama8b", dtype)
        vocab = target.model.config.get_text_config().vocab_size
        sizes = [1, 2, 4, 8, 16, 32, 64, 128]
        contexts = [512, 2048] if not self.tiny else [64, 256]
        reps = 10 if not self.tiny else 3
        rng = random.Random(0)
        curve = {}
        for ctx in contexts:
            session = CausalLMSession(target.model)
            session.prefill([rng.randrange(vocab) for _ in range(ctx)])
            row = {}
            for m in sizes:
                # A bushy tree (each node's parent drawn among the earlier ones) and a chain: the tree takes
                # the 4D mask path, a chain the model's own causal mask.
                parents = [-1] + [rng.randrange(-1, i) for i in range(1, m - 1)] if m > 1 else []
                tokens = [rng.randrange(vocab) for _ in range(m - 1)]
                timing = {}
                for shape, tree in (("tree", DraftTree.from_lists(tokens, parents[: m - 1])), ("chain", DraftTree.chain(tokens))):
                    if shape == "chain" and m <= 2:
                        timing[shape] = timing.get("tree")
                        continue
                    buffers = build_tree_buffers(tree)
                    samples = []
                    for rep in range(reps + 2):
                        start = self.clock()
                        session.verify(rng.randrange(vocab), tree, buffers)
                        elapsed = self.clock() - start
                        session.crop(ctx)
                        if rep >= 2:
                            samples.append(elapsed)
                    timing[shape] = round(statistics.median(samples) * 1e3, 3)
                row[str(m)] = timing
                log(f"   ctx {ctx:5d}  M {m:4d}: tree {timing['tree']:8.3f} ms  chain {timing['chain']:8.3f} ms")
            curve[str(ctx)] = row
        entry["verify_ms"] = curve
        entry["dtype"] = str(dtype).replace("torch.", "")
        entry["shape"] = "llama-3.1-8b" + (" (tiny body)" if self.tiny else "")
        return target

    def verify_surface(self, entry: dict, target) -> None:
        """The batched verify-cost surface T(batch, tokens per row) of the 8B shape in bf16 at context 512:
        one forward of B rows x M new tokens over a cache of B x 512 (a chain per row: the causal mask), the
        cost model batched decoding and the speculation schedule need (issue 27)."""
        import random

        from transformers import DynamicCache

        torch = self.torch
        model = target.model
        vocab = model.config.get_text_config().vocab_size
        batches = [1, 2, 4, 8, 16, 32, 64] if not self.tiny else [1, 4]
        per_row = [1, 2, 4, 8, 16, 32] if not self.tiny else [1, 4]
        ctx = 512 if not self.tiny else 64
        reps = 5 if not self.tiny else 2
        rng = random.Random(2)
        surface = {}
        for b in batches:
            cache = DynamicCache(config=model.config)
            prompt = torch.tensor([[rng.randrange(vocab) for _ in range(ctx)] for _ in range(b)], device=self.device)
            with torch.inference_mode():
                model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            row = {}
            for m in per_row:
                ids = torch.randint(0, vocab, (b, m), device=self.device)
                positions = torch.arange(ctx, ctx + m, device=self.device)
                samples = []
                for rep in range(reps + 2):
                    start = self.clock()
                    with torch.inference_mode():
                        model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=positions,
                              position_ids=positions.expand(b, m))
                    elapsed = self.clock() - start
                    cache.crop(-m)  # transformers 5.24+: a negative count drops the newest tokens
                    if rep >= 2:
                        samples.append(elapsed)
                row[str(m)] = round(statistics.median(samples) * 1e3, 3)
            surface[str(b)] = row
            log(f"   B {b:3d}: " + "  ".join(f"M {m}: {row[str(m)]:7.2f} ms" for m in per_row))
            del cache
        entry["verify_ms"] = surface
        entry.update(context=ctx, dtype=str(model.dtype).replace("torch.", ""),
                     shape="llama-3.1-8b" + (" (tiny body)" if self.tiny else ""),
                     layout="verify_ms[batch][tokens per row], full logits over the 128k vocabulary at every new token")

    def drafter_cost(self, entry: dict, target) -> None:
        """EAGLE-3 (draft vocabulary 32k) proposal time by tree depth, top_k 10 and 60 nodes, at context 512."""
        import random

        from selfdraft.configs.decode import TreeConfig
        from selfdraft.heads.kinds.eagle import new_drafter
        from selfdraft.heads.kinds.eagle.decode import EagleTreeDrafter

        torch = self.torch
        model = target.model
        vocab = model.config.get_text_config().vocab_size
        torch.manual_seed(3)
        module = new_drafter(model, "eagle3", draft_vocab_size=32000)
        module.set_vocab_map(torch.randperm(vocab)[:32000].sort().values)
        rng = random.Random(1)
        ctx = 512 if not self.tiny else 64
        ids = [rng.randrange(vocab) for _ in range(ctx)]
        sequence = ids + [rng.randrange(vocab)]  # the prompt and the prefill's token: the root of every tree
        reps = 10 if not self.tiny else 3
        rows = {}
        for depth in range(1, 9):
            drafter = EagleTreeDrafter(module, model, TreeConfig(depth=depth, top_k=10, max_nodes=60))
            rows[str(depth)] = self.propose_cost(drafter, model, ids, sequence, reps)
            log(f"   EAGLE-3 depth {depth}: {rows[str(depth)]['ms']:8.3f} ms per proposal ({rows[str(depth)]['nodes']} nodes)")
        entry["eagle3_propose"] = rows
        entry["context"] = ctx
        entry["block_propose"] = self.block_cost(model, ids, sequence, reps)

    def block_cost(self, model, ids: list[int], sequence: list[int], reps: int) -> dict:
        """DFlash / DSpark (draft vocabulary 32k): one drafter forward per block, by block size and draft
        layers, at the same context as EAGLE-3's rows (the drafting share that issue 26's aim compares)."""
        from selfdraft.configs.decode import TreeConfig
        from selfdraft.heads.kinds.block.decode import BlockDrafter
        from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims

        torch = self.torch
        text = model.config.get_text_config()
        n = text.num_hidden_layers
        rows = {}
        for kind in ("dflash", "dspark"):
            for block, layers in ((8, 1), (16, 1), (8, 5), (16, 5)) if not self.tiny else ((4, 1),):
                torch.manual_seed(5)
                dims = (DSparkDims if kind == "dspark" else DFlashDims).shaped_like(
                    text, block_size=block, num_layers=layers, draft_vocab_size=32000, mask_token_id=text.vocab_size - 1,
                    target_layers=tuple(sorted({1, n // 2, n - 2})), **({"markov_rank": 256} if kind == "dspark" else {}))
                module = BlockHead(dims).to(device=self.device, dtype=model.dtype)
                module.set_vocab_map(torch.randperm(text.vocab_size)[:32000].sort().values)
                drafter = BlockDrafter(module, model, TreeConfig(depth=dims.drafts_per_block, top_k=1, max_nodes=block))
                key = f"{kind} block {block} layers {layers}"
                rows[key] = self.propose_cost(drafter, model, ids, sequence, reps)
                log(f"   {key}: {rows[key]['ms']:8.3f} ms per proposal ({rows[key]['nodes']} nodes)")
                del drafter, module
        return rows

    def propose_cost(self, drafter, model, ids: list[int], sequence: list[int], reps: int) -> dict:
        """{ms: the median of ``reps`` timed proposals after two warm-ups, nodes: the tree's size} of a drafter
        started on the target's prefill of ``ids``."""
        from selfdraft.inference.session import CausalLMSession

        session = CausalLMSession(model, hidden_layers=drafter.hidden_layers)
        state = drafter.start(ids, session.prefill(ids))
        samples = []
        for rep in range(reps + 2):
            start = self.clock()
            tree, state = drafter.propose(state, sequence)
            if rep >= 2:
                samples.append(self.clock() - start)
        return {"ms": round(statistics.median(samples) * 1e3, 3), "nodes": tree.num_nodes}

    def bench(self, entry: dict) -> None:
        """``selfdraft bench`` on the device, fp32, with a random EAGLE-3 drafter folder: exactness and the
        machinery (timing with synchronisation, results.json's GPU record), not speed-ups (random drafts)."""
        from selfdraft.heads.kinds.eagle import new_drafter
        from selfdraft.heads.io import DrafterRecord, save_drafter
        from selfdraft.inference.bench.run import run_bench

        torch = self.torch
        target = self.target("smollm2", torch.float32)
        torch.manual_seed(4)
        module = new_drafter(target.model, "eagle3", draft_vocab_size=4096)
        module.set_vocab_map(torch.arange(4096))
        folder = save_drafter(self.work / "random-eagle3", module,
                              DrafterRecord(kind="eagle3", dims=module.dims, target=target.identity))
        tasks = [str(self.assets / "mt_bench.jsonl"), str(self.assets / "humaneval.jsonl")]
        # The drafter drafts every step (policy=fixed): its acceptance and proposal depth are what the
        # prediction reads; the default policy would soon stop drafting random drafts.
        results = run_bench(target, ["prompt-lookup", f"{folder}@policy=fixed"], tasks, max_new_tokens=32 if self.tiny else 96,
                            limit=2 if self.tiny else 4, out=self.out / "bench", plots=False, progress=False,
                            command="scripts/gpu_check.py bench", fresh=True)
        entry["rows"] = [{k: r[k] for k in ("task", "method", "tokens_per_second", "speedup", "acceptance_length", "exact")}
                         for r in results["rows"]]
        entry["machine"] = results["meta"].get("machine")
        for r in entry["rows"]:
            log(f"   {pathlib.Path(r['task']).stem:10s} {pathlib.Path(r['method']).name:16s} {r['tokens_per_second']:8.1f} tok/s  "
                f"x{r['speedup']:.2f}  tau {r['acceptance_length']}  exact {r['exact']}")
        if not all(r["exact"] for r in entry["rows"]):
            raise RuntimeError("a method was not token-identical to the baseline on the device")

    def run(self) -> dict:
        torch = self.torch
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda, but CUDA is not available here")
        self.work.mkdir(parents=True, exist_ok=True)
        tiny = self.tiny
        with self.section("environment") as entry:
            if entry is not None:
                self.environment(entry)
        with self.section("exactness_fp32", needs=20) as entry:
            if entry is not None:
                self.exactness(entry)
        with self.section("training_bf16", needs=20) as entry:
            if entry is not None:
                self.training(entry, "smollm2", ["eagle3", "medusa", "eagle", "dflash", "dspark"], *((2, 128, 2) if tiny else (4, 2048, 5)))
        with self.section("training_bf16_128k_vocab", needs=30) as entry:
            if entry is not None:
                self.training(entry, "llama8b", ["eagle3", "dspark"], *((1, 128, 1) if tiny else (2, 2048, 3)))
        target = None
        with self.section("verify_cost", needs=30) as entry:
            if entry is not None:
                target = self.verify_curve(entry)
        with self.section("drafter_cost", needs=20) as entry:
            if entry is not None:
                if target is None:  # verify_cost not asked for: the same bf16 8B-shape target
                    target = self.target("llama8b", torch.bfloat16 if (self.device.type == "cuda" or not tiny) else torch.float32)
                self.drafter_cost(entry, target)
        with self.section("verify_cost_batched", needs=30) as entry:
            if entry is not None and target is not None:
                self.verify_surface(entry, target)
        del target
        with self.section("bench", needs=30) as entry:
            if entry is not None:
                self.bench(entry)
        with self.section("pytest", needs=60) as entry:
            if entry is not None:
                self.pytest_subset(entry)
        failed = [k for k, v in self.report["sections"].items() if v.get("status") == "failed"]
        self.report["failed"] = failed
        self.save()
        shutil.rmtree(self.work, ignore_errors=True)
        log(f"== done: {len(self.report['sections'])} sections, failed: {failed or 'none'}; "
            f"{self.out / 'gpu_check.json'}")
        return self.report


# --- the prediction ----------------------------------------------------------------------------------

def _surface(curve: dict[str, dict]):
    """The measured curve as batch 1's row of the product's cost model (seconds; one interpolation for all)."""
    from selfdraft.inference.costs import CostSurface

    points = sorted((int(k), v["tree"] if v["tree"] is not None else v["chain"]) for k, v in curve.items())
    return CostSurface.row([ms / 1e3 for _, ms in points], [m for m, _ in points])


def predict(bench_json: pathlib.Path, gpu_json: pathlib.Path, context: str | None = None) -> list[dict]:
    """For each drafter row of a CPU bench at temperature 0: the speed-up its acceptance length gives with
    the GPU's verify cost (and, for EAGLE rows, the measured EAGLE-3 proposal cost at its depth), by the
    product's own cost model (inference/costs.py)."""
    from selfdraft.inference.costs import speedup

    bench = json.loads(pathlib.Path(bench_json).read_text())
    gpu = json.loads(pathlib.Path(gpu_json).read_text())["sections"]
    curves = gpu["verify_cost"]["verify_ms"]
    context = context or max(curves, key=int)
    cost = _surface(curves[context])
    propose = gpu.get("drafter_cost", {}).get("eagle3_propose", {})
    rows = []
    for r in bench["rows"]:
        if r["temperature"] != 0 or r["baseline"] or r.get("acceptance_length") is None or r.get("draft_nodes_per_step") is None:
            continue
        depth = max((int(d) for d in (r.get("per_depth_acceptance") or {})), default=0)
        eagle = "eagle" in r["method"] and not r["method"].startswith("vllm")
        draft_ms = propose.get(str(depth), {}).get("ms", 0.0) if eagle else 0.0
        nodes = r["draft_nodes_per_step"]
        verify_ms, plain_ms = 1e3 * cost(1, 1 + nodes), 1e3 * cost(1, 1)
        predicted = speedup(r["acceptance_length"], verify_ms + draft_ms, plain_ms)
        rows.append({"task": r["task"], "method": r["method"], "tau": round(r["acceptance_length"], 3),
                     "nodes": round(nodes, 1), "depth": depth, "verify_ms": round(verify_ms, 3),
                     "draft_ms": round(draft_ms, 3), "plain_ms": round(plain_ms, 3),
                     "predicted_speedup": round(predicted, 2), "cpu_speedup": round(r["speedup"], 2), "context": int(context)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="write the assets folder (here, with the registries)")
    parser.add_argument("--assets", default=".gpu_assets")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy bodies and sizes: the smoke run on a CPU")
    parser.add_argument("--out", default="gpu_check_out")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds; sections that no longer fit are skipped")
    parser.add_argument("--sections", help="comma-separated: run only these sections (environment always)")
    parser.add_argument("--pytest-k", default=os.environ.get("GPU_CHECK_PYTEST_K"), help="the pytest section: only the tests this -k expression selects (a rerun of those "
                        "a cut-short run did not reach)")
    parser.add_argument("--predict", metavar="BENCH_RESULTS_JSON", help="predict GPU speed-ups from a CPU bench")
    parser.add_argument("--gpu", metavar="GPU_CHECK_JSON", help="with --predict: the check's gpu_check.json")
    parser.add_argument("--context", help="with --predict: which measured context to use (default the longest)")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(pathlib.Path(args.assets))
        return 0
    exec(BLOCKER, {})
    if args.predict:
        if not args.gpu:
            parser.error("--predict needs --gpu GPU_CHECK_JSON")
        rows = predict(pathlib.Path(args.predict), pathlib.Path(args.gpu), args.context)
        print("| task | method | tau | nodes | verify ms | draft ms | plain ms | predicted GPU speed-up | CPU speed-up |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {pathlib.Path(r['task']).stem} | {r['method']} | {r['tau']:.2f} | {r['nodes']} | {r['verify_ms']:.2f} | "
                  f"{r['draft_ms']:.2f} | {r['plain_ms']:.2f} | {r['predicted_speedup']:.2f}x | {r['cpu_speedup']:.2f}x |")
        return 0
    report = Check(args).run()
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
