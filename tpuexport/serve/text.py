"""Text as an OpenAI client reads it: a row's tokens detokenized as they come, and its stop strings
found in that text across token boundaries.

Detokenizing token by token: a token's text is what decoding the recent tokens gives beyond what
decoding them without it gave (offsets into the ids, as Hugging Face's text-generation-inference
does), so that a tokenizer's spacing at a word's start and a character whose UTF-8 bytes span
several tokens come out whole: while the decoded text ends in U+FFFD (incomplete bytes) nothing is
released. The first generated token is decoded after the prompt's last tokens, as the prompt
continues.

Stop strings: the text released so far never holds one; text that could be the start of one (a
suffix of the text that is a prefix of a stop string) is held back until the next tokens show it is
not, or is released when the row ends for another reason (`flush`). On a match the text before the
stop string is released and the row stops (the stop string is not part of the text, as OpenAI's API
returns it).
"""

from __future__ import annotations

import contextlib

# Prompt tokens decoded ahead of the first generated one (a word's leading space depends on what precedes it).
PROMPT_CONTEXT = 5
_INCOMPLETE = "\ufffd"


class TextRow:
    """One row's text and stop strings (module docstring).

    Args:
      tokenizer: the artifact's Hugging Face tokenizer.
      prompt: the row's prompt token ids (its last PROMPT_CONTEXT are decoded ahead of the first
        generated token).
      stops: the stop strings (empty: none).
      lock: held while the tokenizer decodes (ServedModel.tokenizer_lock).

    Attributes:
      text: the text released so far.
    """

    def __init__(self, tokenizer, prompt: list[int], stops: tuple[str, ...] = (), lock=contextlib.nullcontext()):
        self.tokenizer = tokenizer
        self.lock = lock
        self.stops = tuple(stop for stop in stops if stop)
        self.ids = list(prompt[-PROMPT_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.held = ""
        self.text = ""

    def push(self, token: int) -> tuple[str, bool]:
        """Takes the row's next token.

        Returns:
          (the text released now, whether a stop string ended the row).
        """
        self.ids.append(token)
        candidate = self.held + self._new_text()
        found = [index for index in (candidate.find(stop) for stop in self.stops) if index >= 0]
        if found:
            released, self.held = candidate[:min(found)], ""
            self.text += released
            return released, True
        keep = self._possible_stop_start(candidate)
        released, self.held = candidate[:len(candidate) - keep], candidate[len(candidate) - keep:]
        self.text += released
        return released, False

    def flush(self) -> str:
        """The rest of the text, released (the row ended otherwise than by a stop string): what was held
        back as a possible stop string's start, and the text of tokens whose bytes never completed a
        character (as decoding the whole row gives it)."""
        released, self.held = self.held + self._new_text(final=True), ""
        self.text += released
        return released

    def _new_text(self, final: bool = False) -> str:
        decode = self.tokenizer.decode
        with self.lock:
            before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
            after = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith(_INCOMPLETE) and not final):
            return ""  # nothing new yet, or a character whose bytes are not all here
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def _possible_stop_start(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
