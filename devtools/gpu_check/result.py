"""What a stage reports, and the stages in their canonical order."""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = (
    "install",
    "tests",
    "attention",
    "train",
    "fused",
    "peer",
    "peer_32k",
    "peer_tuned",
    "cli",
    "rope",
    "rope_real",
    "generation",
    "figure6",
    "memory",
    "experiment",
)


@dataclass
class StageResult:
    stage: str
    status: str = "passed"  # passed | failed | error (could not run) | skipped (no time left)
    seconds: float = 0.0
    commands: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)  # {"name", "value", "goal", "met"}
    data: dict = field(default_factory=dict)

    def fail(self, note: str) -> None:
        self.status = "failed"
        self.notes.append(note)
