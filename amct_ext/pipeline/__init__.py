"""The blockwise PTQ job: calibration / evaluation text (leak guard, tokenizer, perplexity), PTQ units,
the run's spec (PtqSpec), capture, replay losses, phase timing, the run_blockwise_ptq / evaluate_blockwise
workflow and its torchrun scale-out."""
