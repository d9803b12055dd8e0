"""What of an answer's text a client sees: the text up to the first stop string, without surrounding whitespace.

Text arrives in pieces as tokens decode, and a stop string may straddle pieces, so the gate holds back a tail
that could still begin one and the whitespace before it (released when more text follows): a streamed answer
then concatenates to exactly the text a non-streamed one returns.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextGate:
    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""          # what has been released
        self.stopped = False    # a stop string appeared: the answer should end
        self._held = ""

    def feed(self, piece: str) -> str:
        """Take the next piece of decoded text; return what can be released now."""
        if self.stopped:
            return ""
        text = self._held + piece
        if not self.text:
            text = text.lstrip()
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return self._release(text[:cut].rstrip())
        keep = text[:len(text) - self._stop_prefix(text)].rstrip()  # and the whitespace before a stop's start
        self._held = text[len(keep):]
        return self._release(keep)

    def finish(self) -> str:
        """The answer ended: release a held tail that never became a stop string, less trailing whitespace."""
        held, self._held = self._held, ""
        return "" if self.stopped else self._release(held.rstrip())

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that begins a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, text: str) -> str:
        self.text += text
        return text
