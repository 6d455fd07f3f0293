"""Stop strings (the API's ``stop``): the reply ends just before the first one in its decoded text.

A stop string may span several tokens and arrive split over any number of text deltas, so the finder holds back the
end of the text that could still grow into one -- and only that: "Count to 5" with stop "5." streams "Count to "
at once and holds the "5" until the next delta says whether a "." follows.
"""

from __future__ import annotations


class StopFinder:
    """Feed text deltas; get the text that can go out. ``stopped`` once a stop string was met: everything from it on
    is dropped."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.found: str | None = None  # the stop string that ended the reply (Anthropic's ``stop_sequence``)
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        at, found = min(((buf.find(s), s) for s in self.stops if s in buf), default=(-1, None))
        if found is not None:
            self.stopped, self.found, self._held = True, found, ""
            return buf[:at]
        hold = max(_partial(buf, s) for s in self.stops)
        self._held = buf[len(buf) - hold:]
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The end of the reply: what was held back was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.stopped else out


def _partial(text: str, stop: str) -> int:
    """How many characters at the end of ``text`` are the start of ``stop`` (less than all of it)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
