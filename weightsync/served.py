"""What a job serves to its clients: where its OpenAI endpoint is, and which weights made a completion.

The operator injects ``WEIGHTSYNC_OPENAI_URL`` into trainer pods: the job's OpenAI Service
(``http://<job>-openai.<namespace>.svc:<port>``, no ``/v1``; OpenAI SDK clients append it), so a
trainer's rollout code reaches the replicas without being told where they are. ``weightsync
run`` sets the same variable for a trainer on one machine.

Every completion the proxy returns says which weight versions generated it: the header
``x-weightsync-versions: 12``, or ``12,13`` when an update finished while it was in flight (its
tokens may come from both). ``Served`` is that header parsed; a trainer compares it with the
version it last published to count off-policy samples. The proxy writes the header; this is the
clients' reading of the same contract (tests/unit pins the two names together).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from weightsync.errors import PermanentError

OPENAI_URL_ENV = "WEIGHTSYNC_OPENAI_URL"
VERSIONS_HEADER = "x-weightsync-versions"


@dataclass(frozen=True)
class Served:
    """The weight versions a completion was generated with: ``low == high`` unless an update landed mid-way."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise PermanentError(f"served versions {self.low},{self.high} must satisfy 0 <= low <= high")

    @classmethod
    def parse(cls, text: str | None) -> Served | None:
        """The header's value (``"12"`` or ``"12,13"``); None when it is absent (a server that does not say)."""
        if text is None:
            return None
        low, comma, high = text.strip().partition(",")
        if not low.isdigit() or (comma and not high.isdigit()):
            raise PermanentError(f"{VERSIONS_HEADER}: {text!r} is not 'N' or 'N,M' (weight versions)")
        return cls(int(low), int(high or low))

    @classmethod
    def span(cls, parts: Iterable[Served | None]) -> Served | None:
        """One sample made of several completions (turns): the versions of them all; None if any is unknown."""
        seen = list(parts)
        if not seen or any(p is None for p in seen):
            return None
        return cls(min(p.low for p in seen if p), max(p.high for p in seen if p))

    def on_policy(self, version: int) -> bool:
        """Generated entirely by ``version``."""
        return self.low == self.high == version

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low},{self.high}"
