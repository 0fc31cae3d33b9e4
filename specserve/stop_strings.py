"""Stop strings in streamed text (the engine's per-request matcher; torch-free)."""

from __future__ import annotations


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back text that may still start one.

    Rule: the stop whose occurrence ends first fires (ties: the longer one); the output is cut
    before it, or after it with `include_stop`. Text is held back only while it is a proper
    prefix of some stop string, so the result does not depend on how the text was chunked.
    """

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(dict.fromkeys(stops))
        self.include_stop = include_stop
        self.matched: str | None = None  # the stop string that fired
        self._held = ""
        # per stop: proper-prefix lengths k (longest first) keyed by the prefix's last char
        self._prefix_ends: list[dict[str, list[int]]] = []
        for s in self.stops:
            ends: dict[str, list[int]] = {}
            for k in range(len(s) - 1, 0, -1):
                ends.setdefault(s[k - 1], []).append(k)
            self._prefix_ends.append(ends)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop matched). After a match, feeds are ignored."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            end, neg_len, stop = best
            self.matched = stop
            self._held = ""
            return buf[:end] if self.include_stop else buf[: end + neg_len], True
        hold = self._longest_partial(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of stream: release the held-back text (nothing after a match)."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop."""
        if not buf:
            return 0
        best = 0
        for s, ends in zip(self.stops, self._prefix_ends):
            for k in ends.get(buf[-1], ()):
                if k <= best:
                    break
                if k <= len(buf) and buf.endswith(s[:k]):
                    best = k
                    break
        return best
