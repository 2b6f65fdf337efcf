"""Prefix caching for a paged KV cache: full pages whose token prefix is identical are shared between
rows instead of being computed and stored again (vLLM's automatic prefix caching, by page).

A full page is keyed by a chain hash: SHA-256 of the previous page's key and the page's tokens, so two
rows' pages have one key only when everything before and in them is the same tokens, and hold the same
keys and values (a position's keys and values depend on its token and those before it only). The
pool keeps {key: page} and a reference count per page held by running rows:
  - a row that starts looks its prompt's full pages up, key after key, up to its first miss; it holds
    the hits (count + 1) and prefills from the first miss on. At most the pages before its last prompt
    token are taken, so every row prefills at least one token (the step must give its last prompt
    token's logits);
  - a page gets its key (becomes shareable) once it is full and the row that wrote it has run the
    step that filled it; a row only ever writes positions past its shared pages, so a shared page is
    never written (a row that diverges mid-page writes a page of its own);
  - a released page whose count drops to 0 keeps its key, cached: the next row with that prefix takes
    it again. Cached pages are handed out for writing only when no never-keyed page is free, least
    recently released first (a row's last page before its first), and lose their key then.
A page whose key another page already has (two rows that wrote the same prefix at the same time) is
not keyed: it is the writing row's alone and free again when the row ends.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

ROOT_KEY = b""  # the key before a row's first page


def page_keys(tokens: Sequence[int], page_size: int, previous: bytes = ROOT_KEY) -> list[bytes]:
    """The chain keys of the full pages of `tokens` (a row's tokens from a page boundary on, after the
    page keyed `previous`)."""
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        previous = hashlib.sha256(previous + np.asarray(tokens[start:start + page_size], np.int64).tobytes()).digest()
        keys.append(previous)
    return keys


class PrefixCache:
    """A paged session's page pool (lower/paged.FreePages' methods) whose full pages are shared by
    prefix (module docstring).

    Args:
      num_pages: the cache's pages.
      page_size: positions per page.
    Attributes:
      free: pages without a key and held by no row.
      held: {page: rows holding it} for pages some running row holds.
      cached: pages with a key that no row holds, least recently released first (evicted in this order).
      page_of, key_of: {key: page} and {page: key} of the keyed pages (held or cached).
      evictions: cached pages handed out for writing (their key dropped).
    """

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.free = list(range(num_pages))
        self.held: dict[int, int] = {}
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.evictions = 0

    def available(self) -> int:
        """Pages `take` can hand out: the free ones and the cached ones."""
        return len(self.free) + len(self.cached)

    def take(self) -> int:
        """A page for a row to write, held once: a free page, else the least recently released cached
        page (its key is dropped: its contents are about to change)."""
        if self.free:
            page = self.free.pop()
        else:
            page, _ = self.cached.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
            self.evictions += 1
        self.held[page] = 1
        return page

    def give_back(self, pages: list[int]) -> None:
        """A released row's pages, in its order: each is held once less; a page no row holds any more
        is cached if it has a key (the row's last page first, so it is evicted first), else free."""
        for page in reversed(pages):
            self.held[page] -= 1
            if self.held[page] == 0:
                del self.held[page]
                if page in self.key_of:
                    self.cached[page] = None
                else:
                    self.free.append(page)

    def lookup(self, prompt: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached prefix of a prompt: (the pages holding its leading full pages, up to the first
        miss and never the page of its last token, and their keys). Holds nothing: `hold` does."""
        pages, keys = [], []
        for key in page_keys(prompt[:len(prompt) - 1], self.page_size):
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
        return pages, keys

    def hold(self, pages: list[int]) -> None:
        """A starting row takes the pages `lookup` found: each is held once more (a cached one is held again)."""
        for page in pages:
            self.cached.pop(page, None)
            self.held[page] = self.held.get(page, 0) + 1

    def register(self, page: int, key: bytes) -> None:
        """A full page its row has written becomes shareable under `key`, unless another page has it already."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key] = page
            self.key_of[page] = key

    def taking(self, pages: list[int]) -> int:
        """How many of `pages` (a lookup's) `hold` would take out of what `take` can hand out: the cached ones."""
        return sum(page in self.cached for page in set(pages))
