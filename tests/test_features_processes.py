"""``selfdraft features`` on several processes (``accelerate launch -m selfdraft.features``), on the CPU
with gloo: the cache's files do not depend on how many processes wrote it or resumed it, a run trains
from it as from online features, and a cache for another process count is refused by name."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from selfdraft.configs.run import load_run_config
from selfdraft.errors import SelfdraftError

SHARD_TOKENS = 50  # several shards per split (8 train and 2 eval conversations, 640 tokens)


def _overrides(tiny_target, out, *more):
    # One thread everywhere: the launched processes and this one compute the same bits.
    return [f"target.spec={tiny_target}", f"train.output_dir={out}", "drafter.kind=eagle3",
            "drafter.eagle.draft_vocab_size=512", "data.max_conversations=24", "data.max_length=64",
            "data.eval_fraction=0.2", "train.micro_batch_size=2", "train.grad_accum=1", "train.max_steps=3",
            "train.eval_every=0", "train.save_every=3", "train.num_threads=1", *more]


def _config(tiny_target, out, *more):
    return load_run_config("smoke_cpu", _overrides(tiny_target, out, *more))


def _launch_features(tiny_target, run, cache, cwd, *flags, ok=True) -> subprocess.CompletedProcess:
    """A 2-process ``accelerate launch -m selfdraft.features`` into ``cache``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    accelerate = shutil.which("accelerate", path=str(pathlib.Path(sys.executable).parent))
    proc = subprocess.run(
        [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "-m", "selfdraft.features", "--config", "smoke_cpu", "--out", str(cache),
         "--shard-tokens", str(SHARD_TOKENS), *flags, *_overrides(tiny_target, run), "train.dist_timeout_minutes=5"],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert "by 2 processes" in proc.stdout, proc.stdout
    return proc


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("features-processes")


@pytest.fixture(scope="module")
def one_process(tiny_target, base):
    """The cache one process (this one) writes; it also renders base/run's data, which the launches reuse."""
    from selfdraft.train.features import write_features

    return write_features(_config(tiny_target, base / "run"), base / "one", shard_tokens=SHARD_TOKENS)


@pytest.fixture(scope="module")
def two_processes(tiny_target, base, one_process):
    cache = base / "two"
    _launch_features(tiny_target, base / "run", cache, base)
    return cache


@pytest.mark.slow
def test_two_processes_write_the_same_files_as_one(one_process, two_processes):
    one = _files(one_process)
    assert len([f for f in one if f.startswith("train/")]) > 2 and len([f for f in one if f.startswith("eval/")]) > 1, list(one)
    assert _files(two_processes) == one


@pytest.mark.slow
def test_two_processes_resume_a_cache_one_process_began(tiny_target, base, one_process):
    from selfdraft.train.features import write_features

    cache = base / "resumed"
    write_features(_config(tiny_target, base / "run"), cache, shard_tokens=SHARD_TOKENS, stop_after_shards=1)
    first = cache / "train" / "shard-00000.safetensors"
    stamp = first.stat().st_mtime_ns
    begun = _files(cache)
    # Other settings: refused by the launch before anything is written.
    refused = _launch_features(tiny_target, base / "run", cache, base, "--dtype", "bfloat16", ok=False)
    assert refused.returncode != 0 and "holds a feature cache for other settings (dtype differ)" in refused.stderr
    assert _files(cache) == begun
    shards = len(_files(one_process)) - 1  # less features.json
    out = _launch_features(tiny_target, base / "run", cache, base).stdout
    assert f"{shards - 1} of {shards} shards to write by 2 processes" in out
    assert first.stat().st_mtime_ns == stamp  # kept, not rewritten
    assert _files(cache) == _files(one_process)


@pytest.mark.slow
def test_a_run_trains_from_the_two_process_cache_as_online(tiny_target, base, two_processes):
    from selfdraft.train.loop import train

    online = train(_config(tiny_target, base / "online"))
    cached = train(_config(tiny_target, base / "cached", f"train.features={two_processes}"))
    a, b = online.objective.trainable_state_dict(), cached.objective.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_cache_for_another_process_count_names_processes(tiny_target, tmp_path, capsys):
    """Cached for 1 step of 2 processes (global batch 4: 4 of the 8 training examples); one process training
    3 steps visits 6."""
    from selfdraft.cli import main
    from selfdraft.train.loop import train

    cache = tmp_path / "features"
    assert main(["features", "--config", "smoke_cpu", "--out", str(cache), "--steps", "1", "--processes", "2",
                 "--shard-tokens", str(SHARD_TOKENS), *_overrides(tiny_target, tmp_path / "run")]) == 0
    assert "4 train + " in capsys.readouterr().out
    with pytest.raises(SelfdraftError, match=r"covers 1 steps of global batch 4.*--steps covering train\.max_steps "
                       r"and --processes equal to the run's process count"):
        train(_config(tiny_target, tmp_path / "run", f"train.features={cache}"))
