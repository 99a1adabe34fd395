"""A line per round that a person can read while the node runs."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from node.metrics import RoundMetrics


class Progress:
    def __init__(self, total_rounds: int, name: str = "", console: Console | None = None):
        """`name`: the run folder's, so that nodes sharing a terminal say which wrote each line."""
        self.total = total_rounds
        self.name = name
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)

    def round(self, m: RoundMetrics) -> None:
        width = len(str(self.total))
        parts = [f"[bold]{escape(f'[{self.name}] ') if self.name else ''}round {m.round:>{width}}/{self.total}[/]"]
        if m.reward_mean is not None:
            parts.append(f"reward {m.reward_mean:5.3f}  train acc {m.accuracy_train:5.3f}")
        if m.eval_accuracy is not None:
            parts.append(f"[cyan]eval acc {m.eval_accuracy:5.3f}[/]")
        if m.n_local:
            parts.append(f"groups {m.groups_trained}/{m.n_local + m.n_external} trained")
            if m.n_external or m.peers or m.external_inspected:
                parts.append(f"peers {m.peers} external {m.n_external} of {m.external_inspected} inspected "
                             f"({m.n_external_used} used)")
            parts.append(f"gen {m.seconds_generate:4.1f}s train {m.seconds_train:4.1f}s other {m.seconds_other:4.1f}s")
        self.console.print("  ".join(parts))


def print_table(console: Console, table: Table) -> None:
    """Where the output is not a terminal (a log, a pipe), rich would fit the table to 80 columns and wrap
    every cell; there it prints at the table's own width, so that each row stays one line to read and grep."""
    if console.is_terminal:
        console.print(table)
        return
    natural = Console(file=console.file, width=10_000).measure(table).maximum
    Console(file=console.file, width=max(console.width, natural)).print(table)
