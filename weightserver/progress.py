"""Progress bars for the command line's large transfers (publish, fetch).

A bar appears only on a terminal: in CI logs and pipes a redrawn line is noise.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from weightserver.config import MiB

if TYPE_CHECKING:
    from tqdm import tqdm

# Smaller transfers finish before a bar would tell anyone anything.
PROGRESS_MIN_BYTES = 8 * MiB


class TransferProgress:
    """A tqdm bar on `stream` (stderr), driven by calls of ``progress(done, total)`` as the
    client's transfer methods make them. It stays silent unless `stream` is a terminal and the
    transfer is at least `min_bytes`.

    >>> import io
    >>> with TransferProgress("fetch", stream=io.StringIO()) as progress:
    ...     progress(16 * MiB, 16 * MiB)
    >>> progress.shown
    False
    """

    def __init__(self, description: str, *, stream: TextIO | None = None, min_bytes: int = PROGRESS_MIN_BYTES) -> None:
        self.description = description
        self.stream = stream or sys.stderr
        self.min_bytes = min_bytes
        self.enabled = _is_terminal(self.stream)
        self._bar: tqdm | None = None

    @property
    def shown(self) -> bool:
        """Whether a bar was drawn."""
        return self._bar is not None

    @property
    def done(self) -> int:
        """The bytes the bar shows as done (0 without a bar)."""
        return int(self._bar.n) if self._bar is not None else 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_bytes:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                desc=self.description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                dynamic_ncols=True,
            )
        if done < self._bar.n or total != self._bar.total:
            self._bar.reset(total=total)  # the transfer started over
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> TransferProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
