"""M-RoPE position ids (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): (temporal, height, width) rows per token.

A port of `get_rope_index` for images and clips: text tokens advance all three rows together; a
medium's placeholder tokens take (t, h, w) positions over its merged grid, offset by the position
where it starts (a clip's t: its temporal patch index, times Qwen2.5-VL's seconds per patch x
tokens_per_second, truncated); the text after it continues from its largest position + 1, as
vLLM (`get_mrope_input_positions`) and the Qwen reference do. transformers 5.19 continues from
start + max(h, w) instead: the same for an image, not for a clip whose temporal positions
outgrow its height and width (then transformers' text positions overlap the clip's). Padding (mask 0)
gets position 0 and is never attended to. Generated tokens continue from the prompt:
position = (index among the row's real tokens) + delta, delta = max position + 1 - real
tokens, the `mrope_position_deltas` of transformers.
"""

from __future__ import annotations

import torch


def image_positions(start: int, grid_thw: torch.Tensor, merge: int, time_interval: float = 1.0) -> torch.Tensor:
    """[3, tokens] positions of one image's or clip's placeholders, row-major over its merged grid;
    the temporal index is scaled by `time_interval` and truncated (Qwen2.5-VL's absolute time)."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    temporal = (torch.arange(t) * time_interval).long()
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def rope_index(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row_grids: list[list[tuple[torch.Tensor, float]]],
    placeholder_ids: set[int],
    merge: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [3, B, T] and deltas [B] for left- or right-padded rows.

    row_grids[b]: (the (t, h, w) patch grid, the temporal interval) of row b's images and clips,
    in prompt order; each fills t*h*w / merge**2 consecutive placeholders (any of
    `placeholder_ids`). The text after one continues at its largest position + 1."""
    b, width = input_ids.shape
    positions = torch.zeros(3, b, width, dtype=torch.long)
    deltas = torch.zeros(b, dtype=torch.long)
    for r in range(b):
        real = attention_mask[r].bool()
        ids = input_ids[r, real].tolist()
        grids = iter(row_grids[r])
        parts, pos, i = [], 0, 0
        while i < len(ids):
            if ids[i] in placeholder_ids:
                item = next(grids, None)
                if item is None:
                    raise ValueError(f"row {r}: more media placeholders than media")
                part = image_positions(pos, item[0], merge, item[1])
                i += part.shape[1]
                pos = int(part.max()) + 1
            else:
                j = i
                while j < len(ids) and ids[j] not in placeholder_ids:
                    j += 1
                part = torch.arange(pos, pos + j - i).expand(3, -1)
                pos += j - i
                i = j
            parts.append(part)
        if next(grids, None) is not None:
            raise ValueError(f"row {r}: more media than media placeholders")
        row = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        if row.shape[1] != len(ids):
            raise ValueError(
                f"row {r}: a medium's placeholders are cut off ({row.shape[1]} positions, {len(ids)} tokens)"
            )
        positions[:, r, real] = row
        deltas[r] = (int(row.max()) + 1 if len(ids) else 0) - len(ids)
    return positions, deltas
