"""Training data and training: the target rewrites the responses (regen), its features, the losses, the steps and the stages."""
