"""A GRPOTrainer that reports how far the log-probs its rollouts came with are from its own recomputation of the
same tokens: `prorl/logprob_mismatch` (mean absolute difference per generated token; NeMo RL tracks the same as
`token_mult_prob_error`) and `prorl/logprob_mismatch_max`.

It reads the forward pass the loss makes anyway, so it costs nothing; that pass runs on the weights that generated
the batch when each batch trains once (`num_iterations: 1`, `steps_per_generation` equal to
`gradient_accumulation_steps`: TRL's defaults), which is when it reports.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer


class LogprobCheckingGRPOTrainer(GRPOTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        steps = self.args.steps_per_generation or self.args.gradient_accumulation_steps
        self._checks = self.args.num_iterations == 1 and steps == self.args.gradient_accumulation_steps
        self._sampled: tuple[torch.Tensor, torch.Tensor] | None = None

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        sampled = inputs.get("sampling_per_token_logps")
        if self._checks and sampled is not None and model.training:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            self._sampled = (sampled, mask.bool())
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._sampled = None

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if self._sampled is not None:  # the loss's own forward pass: the policy's log-probs of the batch's tokens
            sampled, mask = self._sampled
            self._sampled = None
            keep = mask & torch.isfinite(sampled)
            if keep.any():
                difference = (result[0].detach() - sampled).abs()[keep]
                self._metrics["train"]["prorl/logprob_mismatch"].append(difference.mean().item())
                self._metrics["train"]["prorl/logprob_mismatch_max"].append(difference.max().item())
        return result
