"""The model's own token probabilities, computed here independently of the rollout engine's
sampling code (no `target_probs`, no KV cache): the reference the sampling-distribution tests
compare sampled tokens against."""

import torch


def reference_probs(logits: torch.Tensor, banned: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """float64 next-token probabilities from logits [..., V]: softmax(logits / T) without the banned
    tokens, cut to the nucleus (the fewest most probable tokens whose mass reaches top_p) and
    renormalised; one-hot argmax when T = 0."""
    logits = logits.double().index_fill(-1, banned, float("-inf"))
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    p = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    flat = p.reshape(-1, p.shape[-1])
    out = torch.zeros_like(flat)
    for i, row in enumerate(flat.tolist()):
        mass = 0.0
        for t in sorted(range(len(row)), key=lambda t: -row[t]):  # most probable first
            out[i, t] = row[t]
            mass += row[t]
            if mass >= top_p:  # the token that makes the mass reach top_p is the last one kept
                break
    out = out.view(p.shape)
    return out / out.sum(-1, keepdim=True)


@torch.no_grad()
def next_token_probs(
    model, prompt_ids: list[int], prefixes: list[tuple], temperature: float, top_p: float
) -> torch.Tensor:
    """[len(prefixes), V]: the model's distribution of the token after prompt + each prefix (text
    prompt, one full forward; all prefixes of one length, so no padding)."""
    ids = torch.tensor([list(prompt_ids) + list(p) for p in prefixes])
    mask = torch.ones_like(ids)
    media = [[] for _ in prefixes]
    was_training = model.training
    model.eval()
    positions, _ = model.position_ids(ids, mask, media)
    logits, _ = model.forward_embeds(model.embed(ids, media, model.encode_media([])), mask, positions=positions)
    model.train(was_training)
    return reference_probs(logits[:, -1], model.banned_token_ids, temperature, top_p)


def prefix_probs(
    model, prompt_ids: list[int], depth: int, temperature: float, top_p: float, min_p: float
) -> dict[tuple, float]:
    """Probability of each completion prefix of `depth` tokens (shorter: one that ends with EOS),
    for every prefix of probability >= min_p (the others are left out: a goodness-of-fit test pools
    them)."""
    probs: dict[tuple, float] = {}
    level = {(): 1.0}
    for d in range(depth):
        grow = sorted(p for p, q in level.items() if q >= min_p)
        nxt: dict[tuple, float] = {}
        if grow:
            table = next_token_probs(model, prompt_ids, grow, temperature, top_p)
            for pre, row in zip(grow, table.tolist()):
                for t, q in enumerate(row):
                    if q > 0:
                        (probs if t == model.eos_token_id or d == depth - 1 else nxt)[pre + (t,)] = level[pre] * q
        level = nxt
    return {p: q for p, q in probs.items() if q >= min_p}
