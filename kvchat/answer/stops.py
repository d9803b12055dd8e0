"""What of an answer's decoded text a reader sees: not the transcript the model may go on writing, nothing from a
stop string on, no surrounding whitespace.

A small model answering from a chat history often writes the history's next lines instead of an answer
("Dana: 12:30\\nDana: 12:30 ..."). An answer therefore ends where a line starts with a speaker's label from the
history ("Dana:"), or is a time line as the history is shown to the model ("[08/05/2023, 13:56]": a time in brackets,
alone or before a label); at the answer's start such a label or time line is dropped and what follows it kept (the
model answering in a speaker's voice).
Text arrives in pieces as tokens decode, and a label or a stop string may straddle pieces, so the gate holds back
the start of a line while it could still be a label, a tail that could still begin a stop string, and the
whitespace before either (released when more text follows): a streamed answer concatenates to exactly the text a
whole one gives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_HOLD, _FREE, _STOP, _DROP = "hold", "free", "stop", "drop"  # what the start of a line is


class TextGate:
    """`feed` decoded text as it comes and show what it returns; `finish` when decoding ends. `stopped`: the answer
    reached a stop string or a transcript line and decoding should end (`transcript_cut`: the latter)."""

    def __init__(self, stops: Sequence[str] = (), speakers: Iterable[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.labels = tuple(sorted({f"{name.strip()}:" for name in speakers if name and name.strip()}))
        self.text = ""          # what has been released
        self.stopped = False    # a stop string or a transcript line appeared: the answer should end
        self.transcript_cut = False  # ... a transcript line: the model went on writing the history
        self._line = ""         # the current line's text, while its start is undecided
        self._free = False      # the current line's start is decided: the rest of it passes
        self._said = False      # text other than whitespace has passed the line rule
        self._held = ""         # passed the line rule, held back for stop strings and whitespace

    def feed(self, piece: str) -> str:
        """Take the next piece of decoded text; return what can be released now."""
        if self.stopped:
            return ""
        return self._strings(self._lines(piece, final=False), final=False)

    def finish(self) -> str:
        """Decoding ended: release what was held back that never became a label or a stop string, less trailing
        whitespace."""
        if self.stopped:
            return ""
        return self._strings(self._lines("", final=True), final=True)

    # ----- the line rule: labels and time lines

    def _lines(self, piece: str, *, final: bool) -> str:
        """What of the text so far passes the line rule now."""
        self._line += piece
        passed: list[str] = []

        def pass_on(text: str) -> None:
            passed.append(text)
            self._said = self._said or bool(text.strip())

        while self._line and not self.stopped:
            if self._free:
                newline = self._line.find("\n")
                if newline < 0:
                    pass_on(self._line)
                    self._line = ""
                    break
                pass_on(self._line[: newline + 1])
                self._line, self._free = self._line[newline + 1 :], False
                continue
            newline = self._line.find("\n")
            line = self._line if newline < 0 else self._line[:newline]
            verdict, skip = self._judge(line, complete=newline >= 0 or final)
            if verdict == _HOLD:
                break
            if verdict == _STOP:
                self.stopped = self.transcript_cut = True
                self._line = ""
                break
            if verdict == _DROP:  # a time line before the answer: gone, with its line break
                self._line = self._line[len(line) + 1 :] if newline >= 0 else ""
                continue
            self._line, self._free = self._line[skip:], True  # skip: a label before the answer, dropped
        if not self.stopped and self._line and final:
            pass_on(self._line)
            self._line = ""
        return "".join(passed)

    def _judge(self, line: str, *, complete: bool) -> tuple[str, int]:
        """What `line` (the current line so far; `complete`: all of it) is, and for a label or time line at the
        answer's start the characters it takes. Without speakers (none known) every line is free."""
        if not self.labels:
            return _FREE, 0
        body = line.lstrip()
        offset = len(line) - len(body)
        label = self._label(body)
        if label:
            return (_STOP, 0) if self._said else (_FREE, offset + label)
        if body.startswith("["):
            close = body.find("]")
            if close < 0:
                return (_FREE, 0) if complete else (_HOLD, 0)
            if not _looks_like_time(body[1:close]):  # "[a list]": the model's own brackets
                return _FREE, 0
            rest = body[close + 1 :]
            after = rest.lstrip()
            label = self._label(after)
            if label or (complete and not after):
                if self._said:
                    return _STOP, 0
                if label:
                    return _FREE, offset + close + 1 + len(rest) - len(after) + label
                return _DROP, 0
            if not complete and any(lab.startswith(after) for lab in self.labels):
                return _HOLD, 0
            return _FREE, 0
        if not complete and any(lab.startswith(body) for lab in self.labels):
            return _HOLD, 0
        return _FREE, 0

    def _label(self, text: str) -> int:
        """The length of the speaker's label `text` starts with; 0 when it starts with none."""
        return max((len(label) for label in self.labels if text.startswith(label)), default=0)

    # ----- stop strings and whitespace

    def _strings(self, piece: str, *, final: bool) -> str:
        text = self._held + piece
        if not self.text:
            text = text.lstrip()
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:  # before any transcript line the line rule found (what passed it precedes that line)
            self.stopped, self.transcript_cut, self._held = True, False, ""
            return self._release(text[:cut].rstrip())
        if final or self.stopped:
            self._held = ""
            return self._release(text.rstrip())
        keep = text[: len(text) - self._stop_prefix(text)].rstrip()  # and the whitespace before a stop's start
        self._held = text[len(keep) :]
        return self._release(keep)

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


def _looks_like_time(inside: str) -> bool:
    """What the brackets of a history's time line hold (format_turns): a time (digits), or a conversation's title."""
    return any(c.isdigit() for c in inside) or inside.startswith("conversation:")
