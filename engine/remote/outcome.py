"""What one task did on one host: `Outcome` (summary, error, run ids), and the exit code of many."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import KdtError

INTERNAL_ERROR_EXIT = 70


@dataclass
class Outcome:
    host: str
    task: str
    summary: str = ""
    error: KdtError | None = None
    run_ids: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.error is None:
            return 0
        return getattr(self.error, "exit_code", INTERNAL_ERROR_EXIT)

    def to_dict(self) -> dict:
        return {"host": self.host, "task": self.task, "exit_code": self.exit_code,
                "summary": self.summary, "error": str(self.error) if self.error else None,
                "run_ids": self.run_ids, "details": self.details}
