"""The distillation loss every drafter student trains on (moa.py, sar.py): the paper's
(Zimmer et al., arXiv 2410.03804, section 4) forward KL through the shared head plus the
SmoothL1 distance to the target's normed state, weighted by the run's settings. A drafter with
Target Layer Inference (section 3.3) also predicts the target's state after layer L - N - 1:
its feature loss is split evenly between that state and the last one."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cloud_server.moa.model import EdgeHalf

if TYPE_CHECKING:
    from cloud_server.training.settings import TrainSettings


def distill_loss(edge: EdgeHalf, hidden: torch.Tensor, target_hidden: torch.Tensor,
                 settings: TrainSettings, predicted: torch.Tensor | None = None,
                 target_state: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """hidden, target_hidden: [n, width] at the selected positions -> loss, stats.
    predicted, target_state: [n, width], a TLI drafter's own output and the target's state
    it stands for (an unnormed residual stream, compared relative to its RMS); None without."""
    log_q = edge.logits(hidden).log_softmax(-1)  # [n, vocab]
    with torch.no_grad():
        log_p = edge.logits(target_hidden).log_softmax(-1)  # [n, vocab]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    feature = F.smooth_l1_loss(hidden, target_hidden)
    if predicted is not None and target_state is not None:
        scale = target_state.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6  # [n, 1]
        feature = (feature + F.smooth_l1_loss(predicted / scale, target_state / scale)) / 2
    loss = settings.kl_weight * kl + settings.feature_weight * feature
    top1 = (log_q.argmax(-1) == log_p.argmax(-1)).float().mean()
    return loss, {"loss": loss.item(), "kl": kl.item(), "feature": feature.item(),
                  "top1": top1.item()}
