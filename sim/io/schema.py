"""Shared pieces of the file formats: the strict base model and the KV group entry.

Every format (run/1, model/1, hardware/1, check/1, sweep/1) is declared with
pydantic models that reject unknown keys, never coerce, and are frozen
(:class:`Strict`). A KV cache group is written the same way in ``check/1``
and ``model/1`` files (:class:`GroupEntry`; ``model/1`` adds the tensor
shape), and becomes the model layer's :class:`~sim.model.layout.GroupSpec`
through :meth:`GroupEntry.spec`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sim.model.layout import GroupKind, GroupSpec, KVShape

__all__ = ["GroupEntry", "Strict"]


class Strict(BaseModel):
    """Base of every format's models: unknown keys rejected, no coercion, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class GroupEntry(Strict):
    """One KV cache group as a file states it (``check/1`` groups; ``model/1`` adds its shape)."""

    kind: Literal["full", "sliding_window", "chunked_local", "mamba"] = Field(description="attention kind")
    tokens_per_block: int = Field(gt=0, description="GPU block size in tokens (vLLM block_size)")
    window: int | None = Field(default=None, gt=0,
                               description="sliding window in tokens (sliding_window only)")
    attention_chunk: int | None = Field(default=None, gt=0,
                                        description="attention chunk in tokens (chunked_local)")
    extra_retained_tokens: int = Field(default=0, ge=0,
                                       description="tokens kept left of the window (multi-module MTP)")
    eagle: bool = Field(default=False, description="the group holds EAGLE/MTP draft KV")

    def spec(self, shape: KVShape | None = None) -> GroupSpec:
        """The model layer's group (with ``shape`` when the file gives one)."""
        return GroupSpec(GroupKind(self.kind), self.tokens_per_block, self.window, self.attention_chunk,
                         self.extra_retained_tokens, self.eagle, shape=shape)
