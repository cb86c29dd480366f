"""The seed's correctness checks, as values the harness prints and logs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    ok: bool
    line: str  # printed as "[verify] <line>"
    detail: dict


def constant_reference_note(reference: list[int]) -> str:
    """A warning for the [verify] line when the reference is one token repeated: streams that all repeat it agree
    whatever state produced them (random weights can do this: the uncentred synthetic Q4_0 27B did), so the check
    could not fail. Empty when the reference varies."""
    if len(reference) > 1 and len(set(reference)) == 1:
        return (f" (warning: the reference is token {reference[0]} repeated, so this check cannot tell right "
                "outputs from wrong ones)")
    return ""


def verify_greedy(streams: list[list[int]], reference: list[int]) -> Verdict:
    """Greedy over copies of one prompt: every stream identical and equal to the single-stream run."""
    identical = all(s == streams[0] for s in streams)
    mismatched = [i for i, s in enumerate(streams) if s != reference]
    first_div = None
    if mismatched:
        s = streams[mismatched[0]]
        first_div = next((j for j, (a, b) in enumerate(zip(s, reference)) if a != b), min(len(s), len(reference)))
    ok = identical and not mismatched
    line = (f"mode=greedy: all {len(streams)} streams identical (== single-stream greedy ref): "
            f"{str(ok).lower()}")
    if not ok:
        line += f" ({len(mismatched)} differ from the reference; first divergence at token {first_div})"
    line += constant_reference_note(reference)
    return Verdict(ok, line, {"identical": identical, "mismatched_streams": len(mismatched),
                              "first_divergence": first_div, "reference_distinct_tokens": len(set(reference))})


def verify_sampled(streams: list[list[int]], temperature: float) -> Verdict:
    """Temperature sampling: independent per-slot KV and RNG make every stream distinct."""
    distinct = len({tuple(s) for s in streams})
    ok = distinct == len(streams)
    line = (f"mode=sample temp={temperature:.2f}: {distinct}/{len(streams)} streams distinct "
            f"(independent per-slot KV): {str(ok).lower()}")
    return Verdict(ok, line, {"distinct_streams": distinct})
