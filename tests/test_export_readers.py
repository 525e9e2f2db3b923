"""Every layout selfdraft writes, it also reads: for each built-in kind, a native folder exported to
every engine layout its kind writes decodes through ``make_drafter`` (``selfdraft generate --drafter
FOLDER``), greedy-exactly, drafting the same tokens as the native folder."""

from __future__ import annotations

import pytest
import torch

from selfdraft.errors import SelfdraftError
from selfdraft.heads.io import DrafterRecord, save_drafter
from selfdraft.heads.kinds import get_kind, registered
from selfdraft.inference.api import generate
from selfdraft.train.export import export

BUILT_IN = ("medusa", "eagle", "eagle3", "dflash", "dspark")


def trained_looking(kind: str, target):
    """A module of ``kind`` for ``target`` with perturbed weights (so drafts are not all the target's)."""
    from selfdraft.heads.kinds.eagle import new_drafter
    from selfdraft.heads.kinds.medusa.module import MedusaDims, MedusaHeads

    torch.manual_seed(3)
    text = target.model.config.get_text_config()
    if kind == "medusa":
        module = MedusaHeads.from_dims(MedusaDims(text.hidden_size, text.vocab_size, 3, 1, False))
    elif kind in ("dflash", "dspark"):
        from selfdraft.heads.kinds.block.module import BlockHead, DFlashDims, DSparkDims

        extra = {"markov_rank": 8} if kind == "dspark" else {}
        dims = (DSparkDims if kind == "dspark" else DFlashDims).shaped_like(
            text, block_size=4, num_layers=1, draft_vocab_size=512, mask_token_id=text.vocab_size - 1,
            target_layers=(2, 4, 6), **extra)
        module = BlockHead(dims)
    else:
        module = new_drafter(target.model, kind, draft_vocab_size=512 if kind == "eagle3" else None)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    if kind in ("eagle3", "dflash", "dspark"):
        module.set_vocab_map(torch.arange(512))
    return module.eval()


@pytest.fixture(scope="module")
def target(tiny_target):
    from selfdraft.heads.target import load_target

    return load_target(str(tiny_target))


@pytest.mark.parametrize("kind", BUILT_IN)
def test_every_layout_a_kind_writes_decodes_through_make_drafter(kind, target, tmp_path):
    assert set(BUILT_IN) <= set(registered())
    module = trained_looking(kind, target)
    native = save_drafter(tmp_path / "native", module, DrafterRecord(kind, module.dims, target.identity))
    ids = target.tokenizer("def fibonacci(n):", add_special_tokens=True)["input_ids"]
    reference = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, max_new_tokens=20, pad_token_id=0)[0, len(ids):].tolist()
    first = generate(target, input_ids=ids, drafter=str(native), max_new_tokens=20, stop_on_eos=False)
    assert first.token_ids == reference
    writers = get_kind(kind).writers
    assert writers, f"{kind} has no engine writer"
    for writer in writers:
        if kind == "dflash" and writer.format == "sglang":  # SGLang drafts DFlash through the target's head only
            with pytest.raises(SelfdraftError, match="through the target's own LM head"):
                export(native, writer.format, tmp_path / writer.format, target=str(target.identity.name))
            assert not (tmp_path / writer.format).exists()
            continue
        folder, _ = export(native, writer.format, tmp_path / writer.format, target=str(target.identity.name))
        out = generate(target, input_ids=ids, drafter=str(folder), max_new_tokens=20, stop_on_eos=False)
        assert out.token_ids == reference, f"{kind} in the {writer.format} layout decodes differently"
        assert out.accept_histogram == first.accept_histogram, f"{kind} in the {writer.format} layout drafts differently"
