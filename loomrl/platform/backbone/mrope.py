"""M-RoPE position ids (Qwen2-VL / Qwen2.5-VL): (temporal, height, width) rows per token.

A port of transformers' `get_rope_index` for images: text tokens advance all three rows
together; an image's placeholder tokens take (t, h, w) positions over its merged grid,
offset by the position where the image starts; the text after it continues from that
start + max(h, w) (for a still image, the image's largest position + 1). Padding (mask 0)
gets position 0 and is never attended to. Generated tokens continue from the prompt:
position = (index among the row's real tokens) + delta, delta = max position + 1 - real
tokens, the `mrope_position_deltas` of transformers.
"""

from __future__ import annotations

import torch


def image_positions(start: int, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[3, tokens] positions of one image's placeholders, row-major over its merged grid."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def rope_index(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row_grids: list[list[torch.Tensor]],
    image_token_id: int,
    merge: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [3, B, T] and deltas [B] for left- or right-padded rows.

    row_grids[b]: the (t, h, w) patch grids of row b's images, in prompt order; each image
    fills t*h*w / merge**2 consecutive `image_token_id` placeholders."""
    b, width = input_ids.shape
    positions = torch.zeros(3, b, width, dtype=torch.long)
    deltas = torch.zeros(b, dtype=torch.long)
    for r in range(b):
        real = attention_mask[r].bool()
        ids = input_ids[r, real].tolist()
        grids = iter(row_grids[r])
        parts, pos, i = [], 0, 0
        while i < len(ids):
            if ids[i] == image_token_id:
                grid = next(grids, None)
                if grid is None:
                    raise ValueError(f"row {r}: more image placeholders than images")
                part = image_positions(pos, grid, merge)
                i += part.shape[1]
                pos += max(int(grid[1]), int(grid[2])) // merge
            else:
                j = i
                while j < len(ids) and ids[j] != image_token_id:
                    j += 1
                part = torch.arange(pos, pos + j - i).expand(3, -1)
                pos += j - i
                i = j
            parts.append(part)
        if next(grids, None) is not None:
            raise ValueError(f"row {r}: more images than image placeholders")
        row = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        if row.shape[1] != len(ids):
            raise ValueError(
                f"row {r}: an image's placeholders are cut off ({row.shape[1]} positions, {len(ids)} tokens)"
            )
        positions[:, r, real] = row
        deltas[r] = (int(row.max()) + 1 if len(ids) else 0) - len(ids)
    return positions, deltas
