"""Capture of a decoder LM over a paged KV cache (`--kv-cache paged`): one `step` entry point that
appends each row's new tokens (a prefill chunk or one decode token) into its pages and gives each
row's next-token logits.

  step(tokens[T], positions[T], token_rows[T], page_indices[rows, pages_per_row], kv_lens[rows], cache_kv)
      -> {logits[rows, vocab], cache_kv}
      Token t belongs to row token_rows[t] (-1: a padding token, which writes nothing and whose
      output nobody reads) at position positions[t]; a row's tokens are consecutive positions.
      Position p of row r lives at page page_indices[r, p // page_size], offset p % page_size.
      kv_lens[r] is row r's length once the step has appended its tokens. Token t of row r attends
      to row r's cached positions before the step's (< kv_lens[r] less its tokens in the step) and
      to the step's own tokens of row r at positions <= positions[t], as ragged paged attention
      does. logits[r] are those of row r's last token in the step (rows without a token give a row
      of values nobody reads). Keys and values must have one width (multi-head latent attention's
      do not: its export fails).

The cache is one tensor, `cache_kv` [layers, num_pages, page_size, kv_heads * 2 * head_dim]: per
position, per kv head, its keys (head_dim) then its values. Head-major lanes make a split of the lanes
a split of the heads: a tensor-parallel slice holds its kv heads' keys and values of every page
(tasks/generation.py `_paged_input_rules`), and attention needs no collective. Measured on v5e
(Llama-3.2-1B's 8 kv heads of 64, bf16, 2 layers x 2048 pages of 16, 8 tokens into 8 rows;
benchmarks/studies/paged_cache.py layouts): with a position's 1024 lanes minor, the step's write is
in place (0 temporaries, 0.5 MiB accessed) and a layer's gather + attention takes 64 MiB of
temporaries (the gathered pages) and 673 MiB accessed, head-major or with all keys before all values
(the layout before session 17, which a model axis would have split into keys and values, not heads).
The lanes are in the order of JAX's Pallas `ragged_paged_attention` layout, [pages, page_size,
2 * kv_heads, head_dim] with keys and values interleaved per head, but merged: in that 5-dimensional
shape (head_dim 64 minor) XLA copies the whole 128 MiB cache into another layout for the write
(256 MiB of temporaries, 768 MiB accessed) and the gather + attention takes 256 MiB and 993 MiB.

Attention here is the reference: each row's pages are gathered by its page table from the cache as
the step received it, the step's own keys are appended, and the model's own attention runs over them
with a mask that lets a token see its own row's earlier positions only (`paged_mask`). The writes
wait until the last layer has read (as export/functional_cache.py's DecodeCache does: no read of the cache
follows a write into it), one `write_pages` per layer. Appending the step's keys rather than
selecting them into the gathered pages saved a copy of the gathered pages per layer (Llama-3.2-1B
shape, v5e, 8 tokens x 8 rows at context 4096; benchmarks/studies/paged_cache.py).
"""

from __future__ import annotations

import math

import torch

from tpuexport.errors import TpuExportError
from tpuexport.export.cache_specs import DEFAULT_PAGE_SIZE, PAGES_DIM, PagedSpec, max_pages
from tpuexport.export.functional_cache import dequantize_kv, quantize_kv
from tpuexport.export.generation import (_EntryPoint, _masked_value, _text_config, _transformers_cache, attention_windows, base_model, cached_shapes,
                                         cached_shapes_per_layer_type, check_decoder, conv_layers, decoder_layers, indexed_layers, keys_seen,
                                         masks_as_bias)
from tpuexport.export.model_positions import positions_known

# --kv-cache: "static" is [layers, max_batch, kv_heads, max_context, head_dim] (export/generation.py);
# "paged" is pages a row takes as it grows (this module).
KV_CACHES = ("static", "paged")
def check_kv_cache(kv_cache: str) -> None:
    """Raises TpuExportError (one line) for a --kv-cache not in KV_CACHES."""
    if kv_cache not in KV_CACHES:
        raise TpuExportError(f"unknown --kv-cache {kv_cache!r}; use one of {', '.join(KV_CACHES)} "
                             "(static: max context per slot; paged: pages taken as rows grow)")


def check_page_options(page_size: int | None, num_pages: int | None, kv_cache: str, max_context: int | None = None) -> None:
    """Refuses --page-size / --num-pages that cannot hold a row, or given without --kv-cache paged, in one line."""
    if kv_cache != "paged":
        given = "--page-size" if page_size is not None else "--num-pages" if num_pages is not None else None
        if given:
            raise TpuExportError(f"{given} applies to the paged KV cache; add --kv-cache paged (or drop {given})")
        return
    if page_size is not None and not (isinstance(page_size, int) and page_size >= 1):
        raise TpuExportError(f"--page-size {page_size}: give a positive number of positions per page, e.g. --page-size {DEFAULT_PAGE_SIZE}")
    if max_context is not None and page_size is not None and page_size > max_context:
        raise TpuExportError(f"--page-size {page_size} exceeds --max-context {max_context}; give a page size <= {max_context}")
    if num_pages is not None:
        # At least 2 pages: the pages dim is dynamic, and torch.export makes a dim whose example is 1 static.
        needed = max(2, math.ceil(max_context / (page_size or DEFAULT_PAGE_SIZE)) if max_context else 1)
        if not (isinstance(num_pages, int) and num_pages >= needed):
            raise TpuExportError(f"--num-pages {num_pages}: the cache must hold at least one row of max context ({needed} pages of "
                                 f"{page_size or DEFAULT_PAGE_SIZE} positions); give --num-pages >= {needed}")
        if num_pages > max_pages(page_size or DEFAULT_PAGE_SIZE):
            raise TpuExportError(f"--num-pages {num_pages} exceeds the {max_pages(page_size or DEFAULT_PAGE_SIZE)} pages of "
                                 f"{page_size or DEFAULT_PAGE_SIZE} positions whose slots int32 indexes; give fewer pages")


def paged_spec(model: torch.nn.Module, max_batch: int, max_context: int, page_size: int | None, num_pages: int | None,
               token_buckets: tuple[int, ...] | None, row_buckets: tuple[int, ...] | None, kv_cache_dtype: str = "model") -> PagedSpec:
    """The paged cache a Hugging Face decoder LM needs at these limits.

    Args:
      model: a transformers causal LM.
      max_batch: rows per step; max_context: positions per row.
      page_size: positions per page (None: DEFAULT_PAGE_SIZE, or max context if smaller).
      num_pages: pages in the cache (None: max_batch rows of max context: the count verification and CPU
        targets run at; TPU targets then get what their HBM holds, tasks/page_count.py).
      token_buckets: token budgets T (None: 16, 128, 512, 2048 up to max_batch x max_context, and max_batch).
      row_buckets: row counts (max_batch is always one: a session's rows are its slots 0..max_batch-1).
      kv_cache_dtype: "model" or "int8" (PagedSpec).
    Raises:
      TpuExportError: a model or option the paged step does not take, or sizes out of range.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model") or model.get_output_embeddings() is None:
        raise TpuExportError(f"--kv-cache paged needs a Hugging Face causal LM (e.g. LlamaForCausalLM); got {type(model).__name__}")
    if max_batch < 1 or max_context < 2:
        raise TpuExportError(f"--max-batch {max_batch} / --max-context {max_context} out of range for --kv-cache paged; give max batch >= 1 "
                             "(rows of a step) and max context >= 2")
    check_decoder(model)
    if getattr(model, "_is_stateful", False):
        raise TpuExportError(f"--kv-cache paged: {type(model).__name__} keeps a recurrent state per row (state-space or linear-attention "
                             "layers), which the pages do not hold yet; use --kv-cache static")
    windows = attention_windows(model)  # refuses layer types no causal mask describes
    if conv_layers(model):
        raise TpuExportError(f"--kv-cache paged: {type(model).__name__}'s short-convolution layers keep a state per row, which the "
                             "pages do not hold yet; use --kv-cache static")
    if indexed_layers(model):
        raise TpuExportError(f"--kv-cache paged: {type(model).__name__}'s indexed attention layers keep indexer keys beside their own, "
                             "which the pages do not hold yet; use --kv-cache static")
    text = _text_config(config)
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if positions is not None and max_context > positions:
        raise TpuExportError(f"--max-context {max_context} exceeds the model's {positions} positions (max_position_embeddings); "
                             f"give --max-context <= {positions}")
    page_size = page_size or min(DEFAULT_PAGE_SIZE, max_context)
    check_page_options(page_size, num_pages, "paged", max_context)
    pages_per_row = math.ceil(max_context / page_size)
    num_pages = num_pages or max(2, max_batch * pages_per_row)
    row_buckets = tuple(sorted(set(row_buckets or ()) | {max_batch}))
    if not all(1 <= rows <= max_batch for rows in row_buckets):
        raise TpuExportError(f"--bucket rows={','.join(map(str, row_buckets))} is out of range: a step's rows are 1..{max_batch} (--max-batch)")
    most = max_batch * max_context
    if token_buckets is None:
        token_buckets = tuple(size for size in (16, 128, 512, 2048) if size < most) + (max_batch,)
    token_buckets = tuple(sorted(set(token_buckets)))
    if not all(1 <= tokens <= most for tokens in token_buckets):
        raise TpuExportError(f"--bucket tokens={','.join(map(str, token_buckets))} is out of range: a step's token budget is 1..{most} "
                             "(max batch x max context)")
    if "sliding_attention" in windows and len(windows) > 1:  # each type's first layer probed: one page layout holds both, or neither
        (kv_heads, head_dim), sliding = cached_shapes_per_layer_type(model)
        if sliding != (kv_heads, head_dim):
            raise TpuExportError(f"--kv-cache paged: {type(model).__name__}'s full and sliding layers cache {kv_heads} kv heads x "
                                 f"{head_dim} and {sliding[0]} x {sliding[1]}, which one page layout does not hold yet; use --kv-cache static")
    else:
        kv_heads, head_dim = cached_shapes(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return PagedSpec(max_batch, max_context, decoder_layers(model), kv_heads, head_dim, model.get_output_embeddings().weight.shape[0],
                     dtype, page_size, num_pages, token_buckets, row_buckets, kv_cache_dtype)


@torch.library.custom_op("tpuexport::write_pages", mutates_args=())
def write_pages(cache: torch.Tensor, new: torch.Tensor, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The cache with token t's keys and values ([tokens, kv_heads * 2 * head_dim]: per head, keys then values) at
    flat slot slots[t] (page * page_size + offset) of one layer; a slot < 0 (a padding token) writes
    nothing. One op so that its lowering (lower/paged.py) is one scatter that drops the padding
    tokens' updates; this is its eager meaning."""
    page_size = cache.shape[2]
    keep = slots >= 0
    written = cache.clone()
    written[layer, slots[keep] // page_size, slots[keep] % page_size] = new[keep].to(cache.dtype)
    return written


@write_pages.register_fake
def _(cache, new, layer, slots):
    return torch.empty_like(cache)


class PagedKVCache:
    """How the step reads and writes the pages; `KVCache` (export/generation.py) calls `update` per layer.

    Attention reads every row's pages in page-table order (row r's position p at r * row_positions
    + p) as the step received them, followed by the step's own keys: a concatenation, so that nothing
    is written into what attention reads (`paged_mask` says which of them each token sees). The
    step's keys are written to their slots after the last layer (`written`). An int8 cache (scales
    given) is quantized on write and dequantized on read, and the step's own keys are attended as
    they are stored (quantized and dequantized), so what a token sees does not depend on whether its
    prompt's earlier tokens came in the same step or an earlier one.
    """

    def __init__(self, cache: torch.Tensor, page_indices: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None = None):
        self.cache = cache
        self.scales = scales
        self.page_indices = page_indices
        self.slots = slots
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []

    def update(self, new_keys: torch.Tensor, new_values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's new keys/values [1, kv_heads, tokens, head_dim] -> attention's [1, kv_heads, rows * row positions + tokens, head_dim]."""
        _, kv_heads, count, head_dim = new_keys.shape
        # [tokens, kv_heads, 2, head_dim]: per head, its keys then its values (the lanes' order).
        new = torch.stack([new_keys[0].transpose(0, 1), new_values[0].transpose(0, 1)], dim=2)
        gathered = _layer_pages(self.cache, layer, self.page_indices).reshape(-1, 2 * kv_heads * head_dim)
        if self.scales is None:
            self.pending.append((layer, new.reshape(count, -1).to(self.cache.dtype), None))
        else:
            stored, scale = quantize_kv(new, self.scales.dtype)
            self.pending.append((layer, stored.reshape(count, -1), scale.reshape(count, -1)))
            new = dequantize_kv(stored, scale, new_keys.dtype)
            scales = _layer_pages(self.scales, layer, self.page_indices).reshape(-1, 2 * kv_heads)
            gathered = dequantize_kv(gathered.reshape(-1, 2 * kv_heads, head_dim), scales, new_keys.dtype)
        gathered = gathered.reshape(-1, kv_heads, 2 * head_dim)
        keys, values = (part.transpose(0, 1)[None].to(new_keys.dtype) for part in gathered.split(head_dim, dim=2))
        own_keys, own_values = (new[:, :, index].transpose(0, 1)[None].to(new_keys.dtype) for index in (0, 1))
        return torch.cat([keys, own_keys], dim=2), torch.cat([values, own_values], dim=2)

    def written(self) -> list[torch.Tensor]:
        """The cache (and its scales) with the step's keys and values in their slots."""
        cache, scales = self.cache, self.scales
        for layer, stored, scale in self.pending:
            cache = write_pages(cache, stored, layer, self.slots)
            if scale is not None:
                scales = write_pages(scales, scale, layer, self.slots)
        return [cache] if scales is None else [cache, scales]


def _layer_pages(cache: torch.Tensor, layer: int, page_indices: torch.Tensor) -> torch.Tensor:
    """`cache[layer][page_indices]` as one gather from the whole cache (its layers and pages merged: a
    bitcast). Sliced per layer first, XLA puts every layer's slice in a buffer of its own (the writes
    after the last layer may come before its reads): a cache-sized temporary on the TPU once the cache
    outgrows VMEM (benchmarks/studies/paged_cache_layout.py)."""
    return cache.flatten(0, 1)[page_indices + layer * cache.shape[1]]


def paged_mask(token_rows: torch.Tensor, positions: torch.Tensor, kv_lens: torch.Tensor, row_positions: int, dtype: torch.dtype,
               windows: dict[str, int | None] | None = None, chunks: dict[str, int] | None = None):
    """The additive mask [1, 1, tokens, rows * row_positions + tokens] of the step's tokens over the
    keys PagedKVCache gives attention: token t of row r sees the cached positions of row r before the
    step's (< kv_lens[r] - its tokens in the step) and the step's tokens of row r at positions <=
    positions[t]; within a sliding window W (`attention_windows`) only the keys at positions >
    positions[t] - W, within a chunk C (`attention_chunks`) only those in its chunk. A padding token
    (row -1) sees no cached key. One tensor when every layer attends
    alike, else {layer type: mask} (what transformers' models with mixed layer types take)."""
    rows = kv_lens.shape[0]
    keys = torch.arange(rows * row_positions, device=positions.device)
    key_rows, key_positions = keys // row_positions, keys % row_positions
    in_step = (token_rows[None, :] == torch.arange(rows, device=positions.device)[:, None]).sum(1)  # [rows]
    cached = (key_rows[None, :] == token_rows[:, None]) & (key_positions < kv_lens[key_rows] - in_step[key_rows])[None, :]
    own = (token_rows[None, :] == token_rows[:, None]) & (positions[None, :] <= positions[:, None])
    visible = torch.cat([cached, own], dim=1)
    every_key_position = torch.cat([key_positions, positions])
    masks = {}
    for layer_type, window in (windows or {"full_attention": None}).items():
        seen = visible & keys_seen(positions[:, None], every_key_position[None, :], window, (chunks or {}).get(layer_type))
        masks[layer_type] = torch.where(seen, 0.0, _masked_value(dtype)).to(dtype)[None, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


class Step(_EntryPoint):
    """The paged step (module docstring) over the model, registered as `model` like the static entry points."""

    def forward(self, tokens, positions, token_rows, page_indices, kv_lens, cache_kv, cache_kv_scale=None):
        count, rows = tokens.shape[0], page_indices.shape[0]
        torch._check(positions.shape[0] == count)
        torch._check(token_rows.shape[0] == count)
        torch._check(kv_lens.shape[0] == rows)
        spec = self.spec
        row_positions = spec.pages_per_row * spec.page_size
        mask = paged_mask(token_rows, positions, kv_lens, row_positions, self.model_dtype, self.windows, self.chunks)
        padding = token_rows < 0
        safe_rows, safe_positions = token_rows.clamp(min=0), positions.clamp(0, row_positions - 1)
        pages = page_indices[safe_rows, safe_positions // spec.page_size]
        slots = torch.where(padding, -1, pages * spec.page_size + safe_positions % spec.page_size)
        cache = PagedKVCache(cache_kv, page_indices, slots, cache_kv_scale)
        # The positions of the keys PagedKVCache gives attention (rows' cached positions, then the step's
        # tokens'), for models masking with a buffer of their own; paged_mask keeps each row to its keys.
        keys = torch.cat([torch.arange(rows * row_positions, device=tokens.device) % row_positions, safe_positions])
        with masks_as_bias(self.bias_windows, safe_positions[None], keys), positions_known(self.model, safe_positions[None], keys):
            hidden = base_model(self.model)(input_ids=tokens[None], attention_mask=mask, position_ids=safe_positions[None],
                                            past_key_values=_transformers_cache(cache), use_cache=True).last_hidden_state[0]
        index = torch.arange(count, device=tokens.device)
        last = torch.where(token_rows[None, :] == torch.arange(rows, device=tokens.device)[:, None], index[None, :], -1).amax(1).clamp(min=0)
        return {"logits": self.logits(hidden[last]), **dict(zip(spec.cache_inputs, cache.written(), strict=True))}


def step_example_arguments(spec: PagedSpec, device: str = "cpu") -> tuple[tuple, tuple]:
    """The step's example inputs and torch.export dynamic_shapes: tokens (1..largest budget) and rows
    (1..max_batch) are dims."""
    # Dims of at least 2: torch.export makes a dim whose example is 1 static (one row could not take a
    # row count again, and its stride guards on the keys could not be proven).
    rows = max(2, spec.max_batch)
    count = max(2, min(spec.token_buckets))
    caches = tuple(torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in spec.cache_tensors().values())
    args = (torch.ones(count, dtype=torch.long), torch.arange(count, dtype=torch.long), torch.zeros(count, dtype=torch.long),
            torch.zeros((rows, spec.pages_per_row), dtype=torch.long), torch.full((rows,), count, dtype=torch.long), *caches)
    tokens = torch.export.Dim("tokens", min=1, max=max(max(spec.token_buckets), 2))
    row_dim = {0: torch.export.Dim("rows", min=1, max=rows)}
    pages = {1: torch.export.Dim(PAGES_DIM, min=max(2, spec.pages_per_row), max=max_pages(spec.page_size))}
    return args, ({0: tokens}, {0: tokens}, {0: tokens}, row_dim, row_dim, *[pages] * len(caches))
