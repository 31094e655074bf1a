"""Training machinery shared by the language-model strategies: the step, optimizer, LoRA, data parallelism, evaluation."""
