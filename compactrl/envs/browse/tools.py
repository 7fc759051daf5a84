"""The browse env's tools over one world: BM25 search and opening linked pages, and how their
outputs are rendered. Every output is a cursor, rendered starting with ``[Cursor c]`` as in
gpt-oss's browser tool; its links are what ``open(cursor=c, id=k)`` can follow."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from compactrl.envs.browse.world import World, build_world

SNIPPET_CHARS = 110


@dataclass(frozen=True)
class Output:
    """One tool output (a cursor): its text, its links (link k leads to page links[k - 1]) and the
    page it shows, if it is an opened page."""

    text: str
    links: tuple[int, ...]
    page: int | None = None


class Corpus:
    """A world and its BM25 index, built once (see :func:`corpus`)."""

    def __init__(self, world: World):
        import bm25s  # here, not at import: code that never builds a browse world (vLLM's
        # virtualenv running compactrl's episodes) need not install it

        self.world = world
        texts = [f"{p.title}. {p.plain}" for p in world.pages]
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, k: int) -> list[int]:
        """The ids of the top ``k`` pages for ``query``, best first; pages that match no term are left out."""
        import bm25s

        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        k = min(k, len(self.world.pages))
        docs, scores = self.bm25.retrieve(tokens, k=k, show_progress=False)
        return [int(d) for d, s in zip(docs[0], scores[0]) if s > 0]

    def results(self, cursor: int, query: str, k: int) -> Output:
        ids = self.search(query, k)
        lines = [f'[Cursor {cursor}] Search results for "{query}":']
        for i, pid in enumerate(ids, 1):
            page = self.world.pages[pid]
            snippet = page.plain.split(". ")[0].rstrip(".") + "."
            if len(snippet) > SNIPPET_CHARS:
                snippet = snippet[: SNIPPET_CHARS - 3].rstrip() + "..."
            lines.append(f"[{i}] {page.title}: {snippet}")
        if not ids:
            lines.append("No results.")
        return Output("\n".join(lines), tuple(ids))

    def open(self, cursor: int, page_id: int) -> Output:
        page = self.world.pages[page_id]
        return Output(f"[Cursor {cursor}] {page.title}\n{page.text}", page.links, page_id)


@lru_cache(maxsize=32)
def corpus(seed: int, size: int) -> Corpus:
    """The corpus of world ``seed``, cached: a GRPO group replays one seed several times."""
    return Corpus(build_world(seed, size))
