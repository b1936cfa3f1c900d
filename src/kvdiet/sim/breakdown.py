"""Where a simulated run's hits, replays and bytes come from: split by context-length regime, by traffic kind
and by session.

The split the decision table of seed 003 asks for before a policy is chosen: a policy that wins on the whole
trace may lose on the part of the traffic a deployment cares about. Regimes are by prompt length (tokens,
K = 1,024): ``≤32K`` (N ≤ 32,768), ``32K-200K``, ``≥200K`` (N ≥ 204,800). Kinds (``agent``, ``subagent``,
``chat``) and sessions come from the trace (`kvdiet.sim.traces.TraceRequest.kind` / ``.session``) when it
carries them; when only some requests carry one, the others form the group `UNTAGGED`, so every split
adds up to the whole run. Bytes are what the request's own forwards wrote (global KV and window state), per
tier.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvdiet.cache.plan import Provenance, WindowSource

__all__ = ["REGIMES", "UNTAGGED", "Breakdown", "GroupFigures", "regime_of"]

REGIMES = ("≤32K", "32K-200K", "≥200K")
"""The context-length regimes, shortest first."""
UNTAGGED = "(untagged)"
"""The kind or session group of the requests a trace gives none (shown only beside tagged ones)."""


def regime_of(prompt_tokens: int) -> str:
    """The regime of a prompt of ``prompt_tokens`` tokens (see the module docstring)."""
    if prompt_tokens <= 32 * 1024:
        return REGIMES[0]
    return REGIMES[1] if prompt_tokens < 200 * 1024 else REGIMES[2]


@dataclass(slots=True)
class GroupFigures:
    """One group's figures (tokens, requests, bytes)."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    restores: int = 0
    replays: int = 0
    recomputed_tokens: int = 0
    persistent_bytes_written: int = 0
    swa_pool_bytes_written: int = 0

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = asdict(self)
        out["hit_ratio"] = round(self.hit_tokens / self.prompt_tokens, 6) if self.prompt_tokens else 0.0
        return out


class Breakdown:
    """Figures per regime, per traffic kind and per session, added up request by request."""

    def __init__(self) -> None:
        self.figures: dict[tuple[str, str], GroupFigures] = {}
        self._groups: dict[tuple[str, str | None, str | None], tuple[GroupFigures, ...]] = {}

    def groups(self, prompt_tokens: int, kind: str | None, session: str | None) -> tuple[GroupFigures, ...]:
        """The figures of the groups a request belongs to: its regime, its kind and its session (`UNTAGGED`
        when the trace names none); what `add_request` and `add_bytes` count into."""
        key = (regime_of(prompt_tokens), kind, session)
        got = self._groups.get(key)
        if got is None:
            names = (
                ("regime", key[0]),
                ("kind", kind if kind is not None else UNTAGGED),
                ("session", session if session is not None else UNTAGGED),
            )
            got = self._groups[key] = tuple(self.figures.setdefault(n, GroupFigures()) for n in names)
        return got

    def add_request(self, groups: tuple[GroupFigures, ...], p: Provenance) -> None:
        """Count one request's lookup (`Provenance`) in its ``groups``."""
        restored = p.window_source in (
            WindowSource.SWA_POOL,
            WindowSource.PERSISTENT,
            WindowSource.WINDOW_BLOCKS,
        )
        for g in groups:
            g.requests += 1
            g.prompt_tokens += p.prompt_tokens
            g.hit_tokens += p.hit_tokens
            g.restores += restored
            g.replays += p.window_source is WindowSource.REPLAY
            g.recomputed_tokens += p.replayed_tokens + p.computed_tokens

    def add_bytes(self, groups: tuple[GroupFigures, ...], persistent: int, swa_pool: int) -> None:
        """Count bytes a request's forwards wrote to the persistent tier and the SWA pool in its ``groups``."""
        for g in groups:
            g.persistent_bytes_written += persistent
            g.swa_pool_bytes_written += swa_pool

    def as_dict(self) -> dict[str, dict[str, dict[str, int | float]]]:
        """``{"by_regime": {...}, "by_kind": {...}, "by_session": {...}}`` (regimes in order, the rest sorted;
        a split the trace does not carry — every request `UNTAGGED` — is absent)."""
        out: dict[str, dict[str, dict[str, int | float]]] = {}
        for split in ("regime", "kind", "session"):
            names = [n for s, n in self.figures if s == split]
            if split == "regime":
                names = [r for r in REGIMES if r in names]
            else:
                names.sort()
            if names and names != [UNTAGGED]:
                out[f"by_{split}"] = {n: self.figures[(split, n)].as_dict() for n in names}
        return out
