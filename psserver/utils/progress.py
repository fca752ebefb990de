"""Progress for long operations: a tqdm bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total: int | None, desc: str, enabled: bool | None = None, log_every_s: float = 10.0) -> None:
        self.total = total
        self.desc = desc
        self.n = 0
        self.log_every_s = log_every_s
        self._last_log = time.monotonic()
        use_bar = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, n: int = 1, *, loss: float | None = None, rate: float | None = None) -> None:
        self.n += n
        if self._bar is not None:
            post = {}
            if loss is not None:
                post["loss"] = f"{loss:.4f}"
            if rate is not None:
                post["samples/s"] = f"{rate:.0f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s or self.n == self.total:
            self._last_log = now
            extra = ""
            if loss is not None:
                extra += f" loss {loss:.4f}"
            if rate is not None:
                extra += f" {rate:.0f} samples/s"
            of = "" if self.total is None else f"/{self.total}"  # None: a stream of unknown length
            log.info("%s: step %d%s%s", self.desc, self.n, of, extra)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
