#!/usr/bin/env bash
# selfdraft as a user gets it: its wheel in a fresh venv with only the runtime dependencies, used from a
# folder outside the checkout (so the source tree cannot be imported). CI runs this after setup.sh (.ci/run).
#
#   bash scripts/check_wheel.sh
#
# 1. builds the wheel from a clean copy of the checkout (scripts/build_wheel.py, with BUILD_PYTHON, default
#    .venv/bin/python: it needs setuptools>=68);
# 2. makes a venv in a temporary folder (with PYTHON, default python3), installs torch 2.13.0 first (the CPU
#    build, as setup.sh does, so nothing pulls a CUDA build), then the wheel with --no-deps, then the wheel's
#    runtime dependencies (its METADATA's Requires-Dist lines without an `extra ==` marker) from the registry;
# 3. there: `selfdraft --help`; every module of the installed package imported (one that needs a package of
#    an extra, e.g. accelerate for training, is reported and left out: those are not runtime dependencies);
#    every registered drafter kind's module, dims and decode adapter imported (its training objective too
#    where it imports without the extras); a greedy decode with prompt lookup on a tiny random Llama through
#    selfdraft.inference.api.generate, token for token equal to transformers' generate().
# Exits non-zero on any failure; the temporary folder is removed either way (CHECK_WHEEL_KEEP=1 keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
BUILD_PY=${BUILD_PYTHON:-.venv/bin/python}
[ -x "$BUILD_PY" ] || BUILD_PY=$PY
start=$SECONDS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/selfdraft-check-wheel.XXXXXX")
if [ -n "${CHECK_WHEEL_KEEP:-}" ]; then echo "check_wheel: keeping $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi
say() { echo "check_wheel: $* ($((SECONDS - start)) s)"; }
fail() { echo "check_wheel: FAILED: $*"; exit 1; }

wheel=$("$BUILD_PY" "$REPO/scripts/build_wheel.py" "$tmp/dist" | tail -1) || fail "the wheel could not be built"
[ -f "$wheel" ] || fail "no wheel built ($wheel)"
say "built $(basename "$wheel")"

"$PY" -m venv "$tmp/venv" || fail "could not make a venv with $PY"
VPY=$tmp/venv/bin/python
# The venv's own packages only: nothing from the user site or PYTHONPATH.
export PYTHONNOUSERSITE=1
unset PYTHONPATH
# pip's output goes to a log, shown where an install fails.
pip_install() { "$VPY" -m pip install --disable-pip-version-check "$@" >>"$tmp/pip.log" 2>&1 || { tail -30 "$tmp/pip.log"; return 1; }; }
pip_install "torch==2.13.0" || fail "torch==2.13.0 could not be installed"
say "torch installed"
pip_install --no-deps "$wheel" || fail "the wheel could not be installed"
mapfile -t deps < <("$VPY" - "$wheel" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    for line in zf.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(line.split(":", 1)[1].strip())
EOF
)
[ "${#deps[@]}" -gt 0 ] || fail "the wheel's METADATA declares no runtime dependency"
say "installing the runtime dependencies: ${deps[*]}"
pip_install "${deps[@]}" || fail "the runtime dependencies could not be installed"
"$VPY" -m pip check --disable-pip-version-check >/dev/null || { "$VPY" -m pip check; fail "pip check: broken dependencies"; }
say "installed in a fresh venv: $("$VPY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"

mkdir "$tmp/run"
cd "$tmp/run"  # outside the checkout: only the installed package can be imported
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
help=$("$tmp/venv/bin/selfdraft" --help 2>&1) || { echo "$help"; fail "selfdraft --help exited non-zero"; }
grep -q "usage" <<<"$help" || { echo "$help"; fail "selfdraft --help printed no usage"; }
say "selfdraft --help: ok"

"$VPY" - "$wheel" "$REPO" "$tmp" <<'EOF' || fail "the installed package (see above)"
import ast, importlib, importlib.util, pathlib, pkgutil, re, sys, zipfile

wheel, repo, tmp = sys.argv[1], pathlib.Path(sys.argv[2]).resolve(), pathlib.Path(sys.argv[3]).resolve()
failures = []


def check(ok, what):
    print(f"check_wheel:   {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


import selfdraft

where = pathlib.Path(selfdraft.__file__).resolve()
check(where.is_relative_to(tmp / "venv") and not where.is_relative_to(repo), f"selfdraft imported from {where.parent}")

# The packages of the wheel's extras (train, test, bench, ...): a module may need those, never anything else.
with zipfile.ZipFile(wheel) as zf:
    meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
extras = {re.split(r"[\s;<>=!~\[(]", line.split(":", 1)[1].strip(), maxsplit=1)[0].lower().replace("-", "_")
          for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" in line}
# inference/vllm_worker.py runs under vLLM's own interpreter (.venv-vllm), never in this one.
ELSEWHERE = {"vllm"}


def outside_runtime(err):
    """The extra's package a failed import needed, or None when it failed otherwise."""
    while err is not None:
        if isinstance(err, ModuleNotFoundError) and err.name:
            top = err.name.split(".")[0]
            if top in extras | ELSEWHERE:
                return top
        err = err.__cause__ or err.__context__
    return None


def runs_on_import(name):
    """Whether a module is a ``python -m`` entry point (a top-level ``sys.exit(...)``): run, not imported."""
    tree = ast.parse(pathlib.Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8"))
    return any(isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "sys.exit"
               for node in tree.body)


def import_every_module():
    """Import every module of the installed package; one that needs an extra's package is noted, not failed."""
    found = sorted(m.name for m in pkgutil.walk_packages(selfdraft.__path__, "selfdraft.", onerror=lambda name: None))
    entry_points = [name for name in found if runs_on_import(name)]
    print(f"check_wheel:   note {len(entry_points)} python -m entry point(s) not imported: {', '.join(entry_points)}")
    modules = [name for name in found if name not in entry_points]
    needs, broken = {}, 0
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - each failure is classified and reported
            top = outside_runtime(err)
            if top is None:
                broken += 1
                check(False, f"import {name}: {type(err).__name__}: {err}")
            else:
                needs.setdefault(top, []).append(name)
    imported = len(modules) - broken - sum(map(len, needs.values()))
    check(broken == 0 and imported > 40, f"{imported} of {len(modules)} modules imported with the runtime dependencies alone")
    for top, names in sorted(needs.items()):
        print(f"check_wheel:   note {len(names)} module(s) need {top} (an extra, not a runtime dependency): {', '.join(names)}")


def import_every_kind():
    """Every registered drafter kind, from every kind folder: its module, dims, decode adapter and (where it
    imports without the extras) its training objective."""
    import selfdraft.heads.kinds as kinds_package

    kinds = kinds_package.registered()
    folders = {m.name for m in pkgutil.iter_modules(kinds_package.__path__) if m.ispkg}
    covered = {kind.build.__module__.split(".")[3] for kind in kinds.values()}
    check(bool(kinds) and folders <= covered, f"registered drafter kinds {', '.join(sorted(kinds))} from every kind folder "
          f"of the wheel ({', '.join(sorted(folders))})")
    for name, kind in sorted(kinds.items()):
        try:
            for obj in (kind.build, kind.dims):
                importlib.import_module(obj.__module__)
            adapter = kind.adapter_factory()
            check(callable(adapter), f"kind {name}: module {kind.build.__module__}, decode adapter {kind.adapter}")
        except Exception as err:  # noqa: BLE001
            check(False, f"kind {name}: {type(err).__name__}: {err}")
        try:
            kind.objective_class()
            print(f"check_wheel:   ok   kind {name}: training objective {kind.objective} (imports without the extras)")
        except Exception as err:  # noqa: BLE001
            top = outside_runtime(err)
            if top is None:
                check(False, f"kind {name}: training objective {kind.objective}: {type(err).__name__}: {err}")
            else:
                print(f"check_wheel:   note kind {name}: training objective {kind.objective} not imported: it needs {top} (the train extra)")


def decode_exactly():
    """A greedy decode with prompt lookup on a tiny random Llama, token for token against transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from selfdraft.inference.api import generate

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.1,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    folder = tmp / "tiny-llama"
    model.save_pretrained(folder)
    prompt = [11, 23, 35, 47, 59, 71, 83, 95] * 4 + [11, 23, 35]
    new = 40
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    result = generate(str(folder), input_ids=prompt, drafter="prompt-lookup", temperature=0.0, max_new_tokens=new,
                      adaptive="off")
    check(result.drafter == "prompt-lookup" and result.drafted_steps > 0,
          f"prompt lookup drafted in {result.drafted_steps} step(s) (acceptance length {result.acceptance_length:.2f})")
    same = result.token_ids == expected
    check(same, f"greedy decode with prompt lookup equals model.generate(do_sample=False): {len(result.token_ids)} tokens"
          + ("" if same else f"\n    ours:         {result.token_ids}\n    transformers: {expected}"))


for part in (import_every_module, import_every_kind, decode_exactly):
    try:
        part()
    except Exception as err:  # noqa: BLE001 - reported as that part's failure
        check(False, f"{part.__name__}: {type(err).__name__}: {err}")

if failures:
    print(f"check_wheel: {len(failures)} check(s) failed")
    sys.exit(1)
EOF
say "passed: the wheel installs with its runtime dependencies alone and decodes exactly"
