"""The seed's correctness checks, as values the harness prints and logs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    ok: bool
    line: str  # printed as "[verify] <line>"
    detail: dict
    reason: str = ""  # why ok is False, in a few words ("" when ok)


def degenerate_reason(reference: list[int], logits_finite: bool = True) -> str:
    """Why a greedy reference cannot serve as one, or "": non-finite logits (the model's arithmetic broke down, so
    its argmax is arbitrary), or one token repeated (any stream that repeats it agrees with it whatever state
    produced it, so the check could not fail; random weights can do this)."""
    if not logits_finite:
        return "the reference run produced non-finite logits"
    if len(reference) > 1 and len(set(reference)) == 1:
        return f"the reference is token {reference[0]} repeated, so agreement with it proves nothing"
    return ""


def verify_greedy(streams: list[list[int]], reference: list[int], logits_finite: bool = True) -> Verdict:
    """Greedy over copies of one prompt: every stream identical and equal to the single-stream run, whose stream
    must be one that could tell right outputs from wrong ones."""
    identical = all(s == streams[0] for s in streams)
    mismatched = [i for i, s in enumerate(streams) if s != reference]
    first_div = None
    if mismatched:
        s = streams[mismatched[0]]
        first_div = next((j for j, (a, b) in enumerate(zip(s, reference)) if a != b), min(len(s), len(reference)))
    degenerate = degenerate_reason(reference, logits_finite)
    agree = identical and not mismatched
    ok = agree and not degenerate
    line = f"mode=greedy: all {len(streams)} streams identical (== single-stream greedy ref): {str(ok).lower()}"
    reason = ""
    if not agree:
        reason = f"{len(mismatched)} streams differ from the reference; first divergence at token {first_div}"
        line += f" ({reason})"
    if degenerate:
        reason = degenerate if not reason else f"{reason}; {degenerate}"
        line += f" (degenerate reference: {degenerate})"
    return Verdict(ok, line, {"identical": identical, "mismatched_streams": len(mismatched),
                              "first_divergence": first_div, "reference_distinct_tokens": len(set(reference))},
                   reason)


def verify_sampled(streams: list[list[int]], temperature: float) -> Verdict:
    """Temperature sampling: independent per-slot KV and RNG make every stream distinct."""
    distinct = len({tuple(s) for s in streams})
    ok = distinct == len(streams)
    line = (f"mode=sample temp={temperature:.2f}: {distinct}/{len(streams)} streams distinct "
            f"(independent per-slot KV): {str(ok).lower()}")
    return Verdict(ok, line, {"distinct_streams": distinct}, "" if ok else f"only {distinct} of {len(streams)} "
                   "sampled streams are distinct")
