"""Models: ``ModelAndLoss`` (``forward(batch) -> (loss, outputs)``) and DLRM's tables."""
