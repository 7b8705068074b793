"""Types of the compiled per-block loops (sim/model/_poolops.c)."""

from collections.abc import Callable, Iterable, Sequence

def take(ids: list[int], ref: list[int], bhash: list[int | None], incache: bytearray, bgrp: list[int],
         isdup: bytearray, caches: list[dict[int, int]], dups: list[dict[int, list[int]]],
         uncache: Callable[[int, int], None]) -> int: ...
def release(ids: Iterable[int], ref: list[int], bhash: list[int | None], head: list[int],
            tail: list[int]) -> int: ...
def commit(ids: Sequence[int], hashes: Sequence[int], bhash: list[int | None], bgrp: list[int],
           incache: bytearray, cache: dict[int, int] | None, g: int,
           add_dup: Callable[[int, int, int], None]) -> None: ...
