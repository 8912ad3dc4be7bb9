"""Progress bars for the command line's large transfers (publish, fetch).

A bar appears only on a terminal (in CI logs and pipes a redrawn line is noise), and only for
transfers of at least `PROGRESS_MIN_BYTES`: smaller ones finish before a bar would tell anyone
anything.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from weightserver.config import MiB

if TYPE_CHECKING:
    from tqdm import tqdm

PROGRESS_MIN_BYTES = 8 * MiB


class TransferProgress:
    """A tqdm bar on `stream` (stderr), driven by calls of ``progress(done, total)`` as the
    client's transfer methods make them; `bar` is None while none is shown.

    >>> import io
    >>> with TransferProgress("fetch", stream=io.StringIO()) as progress:
    ...     progress(16 * MiB, 16 * MiB)
    >>> progress.bar is None
    True
    """

    def __init__(self, description: str, *, stream: TextIO | None = None, min_bytes: int = PROGRESS_MIN_BYTES) -> None:
        self.description = description
        self.stream = stream or sys.stderr
        self.min_bytes = min_bytes
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self.enabled = False
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_bytes:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=self.description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                dynamic_ncols=True,
            )
        if done < self.bar.n or total != self.bar.total:
            self.bar.reset(total=total)  # the transfer started over
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> TransferProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.close()
