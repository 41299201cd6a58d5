"""Helpers the CLI's commands share: an argument type, tables, progress."""

import argparse
import sys


def comma_list(convert, allowed=None):
    """An argparse type: a comma-separated list of ``convert``ed values, each in ``allowed``
    (any value ``convert`` accepts when None); repeats are dropped."""

    def parse(text: str) -> list:
        try:
            values = [convert(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             "valid values") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: no values")
        bad = [x for x in values if allowed is not None and x not in allowed]
        if bad:
            choices = (f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range)
                       else list(allowed))
            raise argparse.ArgumentTypeError(f"{text!r}: {bad} not allowed; choose from "
                                             f"{choices}")
        return list(dict.fromkeys(values))

    return parse


def format_table(header, rows, left=()) -> str:
    """Aligned columns: numbers right-aligned, the column indices in ``left`` left-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return "\n".join(
        "  ".join(str(x).ljust(w) if i in left else str(x).rjust(w)
                  for i, (x, w) in enumerate(zip(row, widths))).rstrip()
        for row in [header, *rows])


class Progress:
    """A one-line ``\\r`` counter on stderr. Only on a terminal: in a log, hundreds of
    carriage-return updates would bury the table."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self._width = total, label, 0, 0
        self.enabled = sys.stderr.isatty()

    def step(self, what: str) -> None:
        """Announce the next unit of work (shown while it runs)."""
        self.done += 1
        if self.enabled:
            line = f"\r[{self.label} {self.done}/{self.total}] {what}"
            sys.stderr.write(line.ljust(self._width))  # pad over a longer previous line
            sys.stderr.flush()
            self._width = len(line)

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
