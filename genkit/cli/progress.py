"""Progress bars for the command line (tqdm on stderr, only when stderr is a terminal).

Library code reports progress through callbacks and logs; drawing belongs here."""

from __future__ import annotations

import shutil
import sys
from typing import Any


class StageBars:
    """A ``progress(stage, done, total)`` callback that draws one tqdm bar per stage on stderr:
    a counting bar when ``total`` is known, a line naming the stage when it is not."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.stage: str | None = None
        self.bar: Any = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm.auto import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            if stage == "done":
                return
            # a terminal that reports no size (0x0) gets 80x24: tqdm would draw nothing at all
            size = shutil.get_terminal_size()
            self.bar = tqdm(total=total or None, desc=f"genkit: {stage}", file=self.stream, leave=True,
                            unit="tensor" if total else "it", ncols=size.columns, nrows=size.lines,
                            bar_format=None if total else "{desc}...")
        if self.bar is not None and total:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class BatchBar:
    """``run_batch``'s callbacks: one tqdm bar on ``stream`` (stderr) counting the rows done
    (written or waiting for their chunk's commit, and bad) with the job's rows/s and tokens/s beside
    it. Pass it as ``progress`` (redrawn at every committed chunk) and :meth:`result` as
    ``on_result`` (advanced at every row, redrawn at most every ``mininterval`` seconds)."""

    def __init__(self, stream: Any = None, mininterval: float = 0.1) -> None:
        from tqdm.auto import tqdm

        size = shutil.get_terminal_size()
        self.bar = tqdm(desc="genkit batch", unit="row", file=stream if stream is not None else sys.stderr,
                        ncols=size.columns, nrows=size.lines, mininterval=mininterval)

    def __call__(self, summary: Any) -> None:
        self._show(summary)
        self.bar.refresh()

    def result(self, summary: Any) -> None:
        self._show(summary)

    def _show(self, summary: Any) -> None:
        seconds = summary.seconds or float("inf")
        rows, tokens = (summary.done - summary.bad) / seconds, summary.done_tokens / seconds
        self.bar.set_postfix_str(f"{rows:.2f} rows/s, {tokens:.1f} tokens/s", refresh=False)
        self.bar.update(summary.done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def install_stage_bars() -> StageBars | None:
    """Draw the demo model's first-run set-up on stderr when it is a terminal; nothing otherwise."""
    if not sys.stderr.isatty():
        return None
    from genkit.models.demo import set_progress

    bars = StageBars()
    set_progress(bars)
    return bars
