"""`kvdiet golden` on layer plans other than tiny-fp8's: a random checkpoint in the released format for the
released 40-layer plan (shared/golden/bench-40layer-tiny: Engram with a compressed vocabulary, Reindex layers,
MTP entries in ``compress_ratios``), reference outputs made from kvdiet's own run, accepted; one changed decode
token or top-k row is not, and the first difference names it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvdiet.config import load_config
from kvdiet.model.checkpoint_token_map import REFERENCE_OUTPUTS_FILE
from kvdiet.model.export import write_random_checkpoint
from kvdiet.model.golden import compare_golden
from kvdiet.model.loader import load_checkpoint

PLAN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "bench-40layer-tiny" / "config.json"
PROMPT = 9  # one past the window of 8: ring wrap, odd against ratio 2
DECODE = 2


def _own_outputs(directory: Path, token_map: torch.Tensor) -> dict[str, torch.Tensor]:
    """kvdiet's outputs for a short prompt, in reference_outputs.safetensors's names and shapes."""
    model, _ = load_checkpoint(directory, token_map=token_map)
    cfg = model.cfg
    prompt = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    topk: dict[int, torch.Tensor] = {}

    def observe(sel) -> None:
        rows = torch.where(sel.valid, sel.idx, torch.full_like(sel.idx, -1))
        topk[sel.attn.info.layer_id] = rows.sort(-1, descending=True).values

    state = model.new_state()
    with model.observe_selection(observe):
        logits = model.prefill(state, prompt, decoder_replay=False, all_logits=True)
    out = {"prompt_tokens": prompt, "prompt_logits": logits, "engram.token_map": token_map}
    out |= {f"select.L{layer}.compress_topk": rows for layer, rows in topk.items()}
    for layer, ring in enumerate(state.windows):
        kv, pos = ring.read()
        window = torch.zeros(cfg.sliding_window, kv.shape[-1])
        window[pos % cfg.sliding_window] = kv.float()
        out[f"cache.L{layer}.window_kv"] = window
    for layer in model.plan.kv_sources:
        out[f"cache.L{layer}.compress_kv"] = state.main[layer].read().float()
        out[f"cache.L{layer}.index_k"] = state.index_keys[layer].read().float()
    tokens, rows = [int(logits[-1].argmax())], []
    for _ in range(DECODE):
        rows.append(model.decode([state], [tokens[-1]])[0])
        tokens.append(int(rows[-1].argmax()))
    out["decode_tokens"] = torch.tensor(tokens[:-1])
    out["decode_logits"] = torch.stack(rows)
    return {name: t.contiguous() for name, t in out.items()}


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    if not PLAN.is_file():
        if os.environ.get("CI"):  # as test_model_golden: CI has ../shared
            pytest.fail(f"{PLAN} is missing: CI must have ../shared/golden")
        pytest.skip(f"{PLAN} is not on this machine")
    cfg = load_config(PLAN)
    directory = tmp_path_factory.mktemp("plan40")
    write_random_checkpoint(cfg, directory, seed=3)  # Engram's compressed vocabulary is not the vocabulary
    token_map = torch.arange(cfg.vocab_size) * cfg.engram_compressed_vocab_size // cfg.vocab_size
    return directory, _own_outputs(directory, token_map)


@pytest.mark.slow
def test_golden_takes_the_40_layer_plan_and_names_a_changed_token_or_row(plan_dir) -> None:
    directory, outputs = plan_dir
    save_file(outputs, str(directory / REFERENCE_OUTPUTS_FILE))
    r = compare_golden(directory)
    assert r.numerics == "fp8" and r.rows == r.rows_within_tol == r.argmax_equal == PROMPT
    assert set(r.topk_rows_equal) == set(range(2, 40))  # every compressed layer of the plan, Reuse included
    assert all(n == PROMPT for n in r.topk_rows_equal.values())
    assert len(r.caches) == 40 + 2 * 4  # every window ring; main KV and index keys of sources 2, 8, 14, 20
    assert all(d == 0.0 for d in r.caches.values())
    assert r.decode_tokens_equal == DECODE and r.accepted

    changed = dict(outputs)
    changed["decode_tokens"] = outputs["decode_tokens"].clone()
    changed["decode_tokens"][1] = (changed["decode_tokens"][1] + 1) % 1024
    save_file(changed, str(directory / REFERENCE_OUTPUTS_FILE))
    r = compare_golden(directory)
    assert not r.accepted and r.decode_tokens_equal == DECODE - 1 and r.first_diverging_decode_step == 1

    changed = dict(outputs)
    rows = outputs["select.L30.compress_topk"].clone()
    rows[PROMPT - 1, 0] = -1  # the last row loses its first entry
    changed["select.L30.compress_topk"] = rows
    save_file(changed, str(directory / REFERENCE_OUTPUTS_FILE))
    r = compare_golden(directory)
    assert not r.accepted and r.topk_rows_equal[30] == PROMPT - 1
    assert r.first_diverging_topk == (PROMPT - 1, 30)
