"""Evaluation metrics over sampled responses."""

from __future__ import annotations

import torch


def pass_at_k(num_samples, num_correct, k: int) -> torch.Tensor:
    """Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

    Given ``n`` sampled responses to a prompt, ``c`` of them correct, the probability that
    ``k`` of them drawn without replacement hold at least one correct one:

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

    The product form never builds the binomials (which overflow for large n) and is exactly
    1 when n - c < k (the factor at i = k is 0). Averaged over prompts it estimates pass@k of
    the policy with less variance than drawing k responses per prompt.

    Args:
        num_samples: n, an int or a tensor of per-prompt counts (broadcast with num_correct).
        num_correct: c, an int or a tensor of per-prompt counts, 0 <= c <= n.
        k: responses per attempt, 1 <= k <= n.
    Returns:
        float64 tensor of per-prompt estimates, shaped like the broadcast of n and c.
    """
    device = num_correct.device if isinstance(num_correct, torch.Tensor) else None
    n = torch.as_tensor(num_samples, dtype=torch.float64, device=device)
    c = torch.as_tensor(num_correct, dtype=torch.float64, device=device)
    n, c = torch.broadcast_tensors(n, c)
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"pass_at_k: k must be an integer >= 1, got {k!r}")
    if n.numel() == 0:
        return n.clone()
    if bool((n != n.round()).any() or (c != c.round()).any()):
        raise ValueError("pass_at_k: num_samples and num_correct must be whole counts")
    if bool((k > n).any()):
        raise ValueError(f"pass_at_k: k={k} is larger than num_samples (min {int(n.min())}); "
                         f"pass@k needs at least k samples per prompt")
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError("pass_at_k: num_correct must lie in [0, num_samples]")
    # factors (1 - k/i) for i = 1..max n, kept only where n - c < i <= n (1 elsewhere)
    i = torch.arange(1, int(n.max()) + 1, dtype=torch.float64, device=n.device)
    in_product = (i > (n - c).unsqueeze(-1)) & (i <= n.unsqueeze(-1))
    factors = torch.where(in_product, 1.0 - k / i, torch.ones_like(i))
    return 1.0 - factors.prod(dim=-1)
