"""KV caches: one sequence's contiguous cache, and the service's paged cache with a fixed budget.

GQA layers keep keys and values [S, Hkv, Dh]; MLA layers keep the compressed latent [S, C] and the
shared rotated key [S, R], as the reference implementation does (the cache is what makes MLA small).
Both kinds give attention the same thing per layer: `update(*new)` writes this step's entries and
returns everything cached for the sequence.
The paged cache keeps full blocks for reuse (automatic prefix caching, as vLLM's): a full block is
keyed by its tokens and its parent block's key, so equal keys mean equal prefixes and equal entries;
a block no sequence holds stays cached, evictable least recently used first, and counts as free.
S cached positions, T tokens of a step, Hkv key/value heads, Dh head size, C kv_lora_rank,
R rotated dims, B block size, N blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.common.errors import InvalidRequestError, ResourceExhaustedError
from services.common.model_config import ModelConfig


def entry_shapes(config: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """Shapes of one position's cache entries in one layer."""
    attn = config.attention
    if attn.kind == "mla":
        return (attn.kv_lora_rank,), (attn.qk_rope_head_dim,)
    return (attn.num_kv_heads, attn.head_dim), (attn.num_kv_heads, attn.head_dim)


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    per_layer = sum(int(torch.Size(s).numel()) for s in entry_shapes(config))
    return per_layer * config.num_layers * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: its rows of the batch, its layer cache, its mask [T, S]."""

    rows: slice
    kv: object
    mask: torch.Tensor


class LayerKV:
    def __init__(self, shapes: tuple[tuple[int, ...], ...], capacity: int, dtype: torch.dtype, device: torch.device):
        self.buffers = tuple(torch.empty((capacity, *s), dtype=dtype, device=device) for s in shapes)
        self.arrays = _arrays(self.buffers)
        self.cache: SequenceKV | None = None

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write this step's entries [T, ...] at the step's offset; return everything cached [S, ...]."""
        start, end = self.cache.start, self.cache.start + new[0].shape[0]
        for buf, x in zip(self.buffers, new):
            buf[start:end] = x
        return tuple(buf[:end] for buf in self.buffers)

    def span(self) -> tuple[tuple, int, int, None] | None:
        """Where a native call writes the step's entries and reads the cache: (the buffers as float32
        arrays [capacity, ...], the sequence's first row in them, the step's offset from it, the rows
        of its positions where they are not first + s: None here); None where the buffers are not
        float32 on the CPU."""
        if self.arrays is None:
            return None
        return self.arrays, 0, self.cache.start, None


def _arrays(buffers: tuple[torch.Tensor, ...]) -> tuple | None:
    """float32 CPU buffers as numpy arrays over the same memory (None for others): made once, as a
    decode step's native layer call passes them every layer."""
    if any(b.dtype != torch.float32 or b.device.type != "cpu" for b in buffers):
        return None
    return tuple(b.numpy() for b in buffers)


class SequenceKV:
    """A single sequence's cache, preallocated for `capacity` positions."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device):
        shapes = entry_shapes(config)
        self.capacity = capacity
        self.length = 0  # positions committed so far
        self.start = 0  # offset of the step in progress
        self.layers = [LayerKV(shapes, capacity, dtype, device) for _ in range(config.num_layers)]
        for layer in self.layers:
            layer.cache = self

    def begin(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.capacity:
            raise InvalidRequestError(
                f"sequence of {self.length + num_tokens} tokens exceeds the KV cache capacity of {self.capacity}"
            )
        self.start = self.length

    def commit(self, num_tokens: int) -> None:
        self.length = self.start + num_tokens


ROOT = 0  # the parent key of a sequence's first block


class BlockPool:
    """The service's KV memory: per layer, entries for N blocks of B positions, handed out by block,
    with full blocks kept for reuse when `caching` (they are evicted before anything is refused)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, caching: bool = False):
        shapes = entry_shapes(config)
        self.num_blocks, self.block_size, self.device, self.caching = num_blocks, block_size, device, caching
        # zeros, not empty: every page is touched here, so the service holds its whole KV budget from
        # the start (memory that is not there fails at startup, not under load) and its RSS stays flat
        # while the prefix cache spreads over the pool.
        self.layers = [
            tuple(torch.zeros((num_blocks * block_size, *s), dtype=dtype, device=device) for s in shapes)
            for _ in range(config.num_layers)
        ]
        self.arrays = [_arrays(layer) for layer in self.layers]
        self._free = list(range(num_blocks - 1, -1, -1))  # holding nothing reusable
        self._refs = [0] * num_blocks
        self._cached: dict[int, int] = {}  # key -> block
        self._content: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # block -> (key, parent key, tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self.queries = self.hits = 0  # prompt tokens looked up, and found

    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._content)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > self.free_blocks:
            raise ResourceExhaustedError(f"KV cache: {count} blocks wanted, {self.free_blocks} free")
        out = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:  # the least recently used cached block
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """A sequence's blocks, first to last: its tail is evicted before its head."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._content:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def match(self, tokens: list[int], most: int) -> tuple[list[int], list[int]]:
        """(blocks, keys) of the longest cached run of tokens' full blocks, at most `most`, now held."""
        blocks, keys, parent, b = [], [], ROOT, self.block_size
        for i in range(most if self.caching else 0):
            chunk = tuple(tokens[i * b:(i + 1) * b])
            key = hash((parent, chunk))
            block = self._cached.get(key)
            if block is None or self._content[block] != (key, parent, chunk):
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        for block in blocks:
            self._refs[block] += 1
            self._evictable.pop(block, None)
        return blocks, keys

    def register(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Offers a block just filled with tokens for reuse; returns its key."""
        key = hash((parent, tokens))
        if self.caching and key not in self._cached and block not in self._content:
            self._cached[key] = block
            self._content[block] = (key, parent, tokens)
        return key

    def _forget(self, block: int) -> None:
        key, _, _ = self._content.pop(block)
        del self._cached[key]


class PagedLayer:
    def __init__(self, seq: PagedSequence, layer: int):
        self.seq, self.layer, self.buffers = seq, layer, seq.pool.layers[layer]

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seq, t = self.seq, new[0].shape[0]
        if seq.base is not None:  # blocks side by side in the pool: a view, nothing gathered
            for buf, x in zip(self.buffers, new):
                buf[seq.base + seq.start:seq.base + seq.start + t] = x
            return tuple(buf[seq.base:seq.base + seq.start + t] for buf in self.buffers)
        slots = seq.slots  # [S] flat positions in the pool of this sequence's entries
        step = slots[seq.start:seq.start + t]
        for buf, x in zip(self.buffers, new):
            buf[step] = x
        return tuple(buf.index_select(0, slots) for buf in self.buffers)

    def span(self) -> tuple[tuple, int, int, object] | None:
        """As LayerKV.span: the pool's buffers, and the sequence's base slot while its blocks are one run
        in the pool, else its slots [S] int64 (the block table, position by position)."""
        seq = self.seq
        arrays = seq.pool.arrays[self.layer]
        if arrays is None:
            return None
        if seq.base is not None:
            return arrays, seq.base, seq.start, None
        return arrays, 0, seq.start, seq.slots_array


class PagedSequence:
    """One sequence's block table in a BlockPool; grows block by block as positions are added."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0
        self.start = 0
        self.slots = torch.empty(0, dtype=torch.long, device=pool.device)
        self.slots_array = None  # the slots as a numpy array, on the CPU
        self.base: int | None = None  # the first slot, while the blocks are one run in the pool
        self.layers = [PagedLayer(self, i) for i in range(len(pool.layers))]
        self.tokens: list[int] = []  # whose entries are cached, in order (for the pool's keys)
        self.keys: list[int] = []  # of its full blocks

    def reuse(self, tokens: list[int]) -> int:
        """Takes the pool's cached blocks for the longest full-block prefix of tokens, leaving at
        least one token to compute; returns how many tokens it starts with."""
        assert not self.blocks, "reuse() is for a new sequence"
        blocks, self.keys = self.pool.match(tokens, (len(tokens) - 1) // self.pool.block_size)
        if blocks:
            self._grow(blocks)
        self.length = self.start = len(blocks) * self.pool.block_size
        self.tokens = list(tokens[:self.length])
        return self.length

    def record(self, tokens: list[int]) -> None:
        """The tokens of the step just committed: full blocks are offered to the pool."""
        self.tokens += tokens
        b = self.pool.block_size
        while len(self.keys) < len(self.tokens) // b:
            i = len(self.keys)
            parent = self.keys[-1] if self.keys else ROOT
            self.keys.append(self.pool.register(self.blocks[i], parent, tuple(self.tokens[i * b:(i + 1) * b])))

    def begin(self, num_tokens: int) -> None:
        end = self.length + num_tokens
        missing = self.pool.blocks_for(end) - len(self.blocks)
        if missing > 0:
            self._grow(self.pool.allocate(missing))
        if self.base is None:
            b = self.pool.block_size
            table = torch.tensor(self.blocks, dtype=torch.long, device=self.pool.device)
            positions = torch.arange(end, device=self.pool.device)
            self.slots = table[positions // b] * b + positions % b
            self.slots_array = self.slots.numpy() if self.slots.device.type == "cpu" else None
        self.start = self.length

    def _grow(self, blocks: list[int]) -> None:
        """Appends blocks; the sequence keeps a base slot while all its blocks lie in one run."""
        run = self.blocks + blocks
        if run == list(range(run[0], run[0] + len(run))):
            self.base = run[0] * self.pool.block_size
        else:
            self.base = None
        self.blocks = run

    def commit(self, num_tokens: int) -> None:
        self.length = self.start + num_tokens

    def free(self) -> None:
        self.pool.release(self.blocks)
        self.blocks, self.base = [], None
