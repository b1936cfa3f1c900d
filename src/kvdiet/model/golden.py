"""Hold a reference dump against kvdiet: ``kvdiet golden DIR``.

A directory in the ``shared/golden`` layout holds a checkpoint (``config.json`` + safetensors, any layout
`kvdiet.model.checkpoint` reads) and ``reference_outputs.safetensors`` with what another implementation
computed from it (DeepSeek's reference for ``tiny-fp8``):

| tensor | shape | meaning |
|---|---|---|
| ``prompt_tokens`` | int [T] | the prompt |
| ``prompt_logits`` | fp32 [T, V] | row t predicts token t+1 |
| ``decode_tokens`` | int [N] | greedy continuation; the first is the argmax of the last prompt row |
| ``decode_logits`` | fp32 [N, V] | after feeding ``decode_tokens[i]`` at position T+i |
| ``select.L{l}.compress_topk`` | int [T, k] | entries row t attends at layer l, −1 = none (optional) |
| ``engram.token_map`` | int [V] | the Engram compressed-token map used (optional; else the checkpoint's) |
| ``cache.L{l}.window_kv`` / ``compress_kv`` / ``index_k`` | fp32 | caches after the prompt, as values (opt.) |

kvdiet runs the same prompt in one chunk (no decoder-side replay: the reference has none), then feeds the
reference's decode tokens one at a time, and counts agreement: prompt rows with ``max|Δlogit| ≤ tol ·
max|logit|`` (shared/golden/README.md's acceptance uses tol = 1e-3), argmax per row, greedy decode tokens
(kvdiet's argmax at each step against the reference's token), per-layer top-k sets per row, and caches. The
first diverging row and the first layer whose top-k differs point at where to look.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kvdiet.model.checkpoint_token_map import NOT_WEIGHTS, REFERENCE_OUTPUTS_FILE, find_token_map
from kvdiet.model.loader import load_checkpoint
from kvdiet.model.placement import place
from kvdiet.model.rounding_ties import Tie, find_ties, flip
from kvdiet.model.state import RequestState
from kvdiet.model.transformer import Transformer
from kvdiet.setting_error import SettingError

__all__ = ["GoldenReport", "compare_golden", "run_golden_command"]

DEFAULT_TOL = 1e-3  # shared/golden/README.md


@dataclass(frozen=True, slots=True)
class GoldenReport:
    """Agreement between kvdiet and a reference dump (counts; ``worst_rel`` and errors relative to max|logit|).

    ``topk_rows_equal`` maps each compressed layer to the prompt rows whose selected set equals the
    reference's (of ``topk_rows``); ``caches`` maps ``"L{l}.{kind}"`` to the max absolute difference of the
    cache values (0.0 = bit-identical). ``first_diverging_*`` are None when nothing diverges.
    """

    directory: str
    numerics: str
    tol: float
    rows: int
    rows_within_tol: int
    worst_rel: float
    worst_row: int
    argmax_equal: int
    decode_steps: int
    decode_tokens_equal: int
    decode_rows_within_tol: int
    decode_worst_rel: float
    decode_tokens_equal_strict: int
    rounding_ties: list[tuple[int, dict]]
    first_diverging_row: int | None
    first_diverging_decode_step: int | None
    topk_rows: int
    topk_rows_equal: dict[int, int] = field(default_factory=dict)
    first_diverging_topk: tuple[int, int] | None = None  # (row, layer)
    caches: dict[str, float] = field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        """shared/golden/README.md's acceptance: ≥ 95% of rows within tol, every argmax, every decode token
        and every top-k set equal."""
        return (
            self.rows_within_tol >= 0.95 * self.rows
            and self.argmax_equal == self.rows
            and self.decode_tokens_equal == self.decode_steps
            and all(n == self.topk_rows for n in self.topk_rows_equal.values())
        )

    def as_dict(self) -> dict:
        out = asdict(self)
        out["accepted"] = self.accepted
        out["topk_rows_equal"] = {str(k): v for k, v in self.topk_rows_equal.items()}
        return out


def compare_golden(
    directory: str | Path, *, numerics: str = "auto", tol: float = DEFAULT_TOL, device: str = "cpu"
) -> GoldenReport:
    """Run kvdiet on a golden directory and count agreement (see the module docstring). The model and the
    reference outputs sit on ``device`` (`kvdiet.device`); only the counts come back to the host.

    Raises:
        FileNotFoundError: ``directory`` is empty, not a folder, or holds no ``reference_outputs.safetensors``
            or no checkpoint.
        kvdiet.model.checkpoint.WeightsError / kvdiet.config.ConfigError: the checkpoint does not load.
        ValueError: the outputs file lacks ``prompt_tokens`` or ``prompt_logits``, or a bad ``tol`` (a
            `kvdiet.setting_error.SettingError`: ``--tol`` on the command line).
    """
    if not 0 < tol < float("inf"):
        raise SettingError(
            "{tol} must be a finite number > 0, got {got}", got=tol
        )  # --tol on the command line
    if not str(directory).strip():  # Path("") is "." (the working folder), which no one meant
        raise FileNotFoundError("the golden folder's path is empty")
    directory = Path(directory)
    if not directory.is_dir():
        kind = "a file, not a folder" if directory.exists() else "no such folder"
        raise FileNotFoundError(f"{directory}: {kind}")
    outputs = directory / REFERENCE_OUTPUTS_FILE
    if not outputs.is_file():
        raise FileNotFoundError(f"no {REFERENCE_OUTPUTS_FILE} in {directory}")
    if not any(f.name not in NOT_WEIGHTS for f in directory.glob("*.safetensors")):
        raise FileNotFoundError(
            f"no checkpoint (safetensors weights besides {' and '.join(NOT_WEIGHTS)}) in {directory}"
        )
    ref = _read_outputs(outputs)
    token_map = ref.get("engram.token_map")  # the reference's own map, else the checkpoint's
    if token_map is None and (found := find_token_map(directory)) is not None:
        token_map = found[0]
    model, report = load_checkpoint(directory, token_map=token_map, numerics=numerics)
    model = place(model, device)
    ref = {name: t.to(model.device) for name, t in ref.items()}
    prompt = ref["prompt_tokens"].long()
    selections: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    with model.observe_selection(
        lambda sel: selections.setdefault(sel.attn.info.layer_id, []).append((sel.idx, sel.valid))
    ):
        state = model.new_state()
        logits = model.prefill(state, prompt, decoder_replay=False, all_logits=True)
    caches = _compare_caches(ref, model, state)  # before decode moves the state on
    want = ref["prompt_logits"].float()
    rel = _row_errors(logits, want)
    within = rel <= tol
    decode_tokens = ref.get("decode_tokens", torch.zeros(0, dtype=torch.int64)).long().tolist()
    decode_logits = ref.get("decode_logits")
    first = int(logits[-1].argmax())
    strict = _decode(model, prompt, first, decode_tokens, decode_logits, tol, resolve_ties=False)
    resolved = strict
    if decode_logits is not None and any(e > tol for e in strict.errors):
        resolved = _decode(model, prompt, first, decode_tokens, decode_logits, tol, resolve_ties=True)
    topk_equal, first_topk = _compare_topk(ref, selections)
    bad_rows = (~within).nonzero().flatten().tolist()
    return GoldenReport(
        directory=str(directory),
        numerics=report.numerics,
        tol=tol,
        rows=int(prompt.numel()),
        rows_within_tol=int(within.sum()),
        worst_rel=float(rel.max()),
        worst_row=int(rel.argmax()),
        argmax_equal=int((logits.argmax(-1) == want.argmax(-1)).sum()),
        decode_steps=len(decode_tokens),
        decode_tokens_equal=resolved.tokens_equal(decode_tokens),
        decode_rows_within_tol=sum(e <= tol for e in resolved.errors),
        decode_worst_rel=max(resolved.errors, default=0.0),
        decode_tokens_equal_strict=strict.tokens_equal(decode_tokens),
        rounding_ties=[(step, asdict(tie)) for step, tie in resolved.flips.items()],
        first_diverging_row=bad_rows[0] if bad_rows else None,
        first_diverging_decode_step=strict.first_divergence(decode_tokens, tol),
        topk_rows=int(prompt.numel()),
        topk_rows_equal=topk_equal,
        first_diverging_topk=first_topk,
        caches=caches,
    )


@dataclass(slots=True)
class _Decode:
    choices: list[int]  # kvdiet's greedy token before each step (argmax of the previous logits)
    errors: list[float]  # each step's logit row error (empty without reference decode logits)
    flips: dict[int, Tie]  # steps whose divergence one FP8 rounding tie explains

    def tokens_equal(self, tokens: list[int]) -> int:
        return sum(a == b for a, b in zip(self.choices, tokens, strict=True))

    def first_divergence(self, tokens: list[int], tol: float) -> int | None:
        bad = [i for i, (a, b) in enumerate(zip(self.choices, tokens, strict=True)) if a != b]
        bad += [i for i, e in enumerate(self.errors) if e > tol]
        return min(bad, default=None)


def _decode(
    model: Transformer,
    prompt: torch.Tensor,
    first: int,
    tokens: list[int],
    want: torch.Tensor | None,
    tol: float,
    *,
    resolve_ties: bool,
) -> _Decode:
    """Feed the reference's decode tokens one by one. With ``resolve_ties``, a step whose logits miss the
    reference is re-run with each FP8 activation within 4 ulps of a rounding midpoint rounded the other way
    (nearest first, up to 16); the first that brings the step within ``tol`` is kept for the rest of the run."""
    flips: dict[int, Tie] = {}

    def replay(upto: int) -> RequestState:
        state = model.new_state()
        model.prefill(state, prompt, decoder_replay=False)
        for step in range(upto):
            with flip(flips[step]) if step in flips else contextlib.nullcontext():
                model.decode([state], [tokens[step]])
        return state

    state = replay(0)
    out = _Decode([first], [], flips)
    for step, token in enumerate(tokens):
        with find_ties(model) as ties:
            logits = model.decode([state], [token])[0]
        if want is not None:
            err = float(_row_errors(logits[None], want[step][None].float())[0])
            for tie in sorted(ties, key=lambda t: t.ulps)[:16] if resolve_ties and err > tol else ():
                candidate = replay(step)
                with flip(tie):
                    again = model.decode([candidate], [token])[0]
                again_err = float(_row_errors(again[None], want[step][None].float())[0])
                if again_err <= tol:
                    state, logits, err, flips[step] = candidate, again, again_err, tie
                    break
            out.errors.append(err)
        out.choices.append(int(logits.argmax()))
    out.choices.pop()  # the choice after the last step has no reference token
    return out


def _read_outputs(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as exc:  # safetensors raises its own SafetensorError on a damaged file
        raise ValueError(f"{path} is not a readable safetensors file (damaged or truncated?): {exc}") from exc
    missing = [n for n in ("prompt_tokens", "prompt_logits") if n not in out]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}")
    return out


def _row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: max |got − want| / max |want| (fp32 [R])."""
    return (got - want).abs().amax(-1) / want.abs().amax(-1).clamp(min=1e-30)


def _compare_topk(
    ref: dict[str, torch.Tensor], selections: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]
) -> tuple[dict[int, int], tuple[int, int] | None]:
    equal: dict[int, int] = {}
    first: tuple[int, int] | None = None
    names = [n for n in ref if n.startswith("select.L") and n.endswith(".compress_topk")]
    for name in sorted(names, key=lambda n: int(n[len("select.L") : -len(".compress_topk")])):
        layer = int(name[len("select.L") : -len(".compress_topk")])
        theirs = ref[name].long()
        ours = selections.get(layer)
        if not ours:
            equal[layer] = 0
            continue
        idx = torch.cat([i for i, _ in ours])
        valid = torch.cat([v for _, v in ours])
        count = 0
        for row in range(theirs.shape[0]):
            a = set(idx[row][valid[row]].tolist()) if row < idx.shape[0] else None
            b = {v for v in theirs[row].tolist() if v >= 0}
            if a == b:
                count += 1
            elif first is None or row < first[0]:
                first = (row, layer)
        equal[layer] = count
    return equal, first


def _compare_caches(
    ref: dict[str, torch.Tensor], model: Transformer, state: RequestState
) -> dict[str, float]:
    out: dict[str, float] = {}
    window = model.cfg.sliding_window
    for layer, ring in enumerate(state.windows):
        want = ref.get(f"cache.L{layer}.window_kv")
        if want is None:
            continue
        kv, pos = ring.read()
        slots = pos % window
        full = torch.zeros_like(want)
        full[slots] = kv.float()
        present = torch.zeros(want.shape[0], dtype=torch.bool, device=want.device)
        present[slots] = True
        out[f"L{layer}.window_kv"] = (
            float((full - want.float())[present].abs().max()) if present.any() else 0.0
        )
    for layer in model.plan.kv_sources:
        for kind, store in (("compress_kv", state.main[layer]), ("index_k", state.index_keys[layer])):
            want = ref.get(f"cache.L{layer}.{kind}")
            if want is not None:
                got = store.read().float()
                n = min(got.shape[0], want.shape[0])
                diff = float((got[:n] - want[:n].float()).abs().max()) if n else 0.0
                out[f"L{layer}.{kind}"] = diff if got.shape[0] == want.shape[0] else float("inf")
    return out


# --- command line ---------------------------------------------------------------------------------


def _or_none(value: int | None) -> str:
    return "none" if value is None else str(value)


def run_golden_command(args: argparse.Namespace, console) -> int:
    """Run ``kvdiet golden``; returns the exit code."""
    from rich.table import Table

    report = compare_golden(args.directory, numerics=args.numerics, tol=args.tol, device=args.device)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        table = Table(title=f"kvdiet vs {report.directory} ({report.numerics} numerics)")
        table.add_column("measure")
        table.add_column("agree", justify="right")
        table.add_column("detail")
        table.add_row(
            f"prompt rows within {report.tol:g}·max|logit|",
            f"{report.rows_within_tol}/{report.rows}",
            f"worst {report.worst_rel:.2e} at row {report.worst_row}",
        )
        table.add_row("prompt argmax", f"{report.argmax_equal}/{report.rows}", "")
        table.add_row(
            "greedy decode tokens",
            f"{report.decode_tokens_equal}/{report.decode_steps}",
            f"logit rows within tol {report.decode_rows_within_tol}/{report.decode_steps}, "
            f"worst {report.decode_worst_rel:.2e}",
        )
        if report.rounding_ties:
            table.add_row(
                "  … without rounding ties resolved",
                f"{report.decode_tokens_equal_strict}/{report.decode_steps}",
                "",
            )
            for step, tie in report.rounding_ties:
                table.add_row(
                    f"  FP8 rounding tie, decode step {step}",
                    "",
                    f"{tie['layer']} input [{tie['index']}] = {tie['value']:.9g}, {tie['ulps']:g} ulp from the "
                    f"E4M3 midpoint: kvdiet {tie['rounded']:g}, the reference {tie['other']:g}",
                )
        for layer, n in report.topk_rows_equal.items():
            table.add_row(f"top-k sets, layer {layer}", f"{n}/{report.topk_rows}", "")
        if report.caches:
            identical = sum(v == 0.0 for v in report.caches.values())
            worst = max(report.caches, key=report.caches.get)
            table.add_row(
                "caches bit-identical",
                f"{identical}/{len(report.caches)}",
                "" if identical == len(report.caches) else f"worst {worst}: {report.caches[worst]:.3g}",
            )
        console.print(table)
        firsts = [
            f"first diverging prompt row: {_or_none(report.first_diverging_row)}",
            f"first diverging decode step (ties unresolved): {_or_none(report.first_diverging_decode_step)}",
            "first top-k difference: "
            + (
                "none"
                if report.first_diverging_topk is None
                else "row {}, layer {}".format(*report.first_diverging_topk)
            ),
        ]
        console.print("; ".join(firsts))
        console.print("accepted" if report.accepted else "NOT accepted (shared/golden/README.md acceptance)")
    return 1 if args.check and not report.accepted else 0
