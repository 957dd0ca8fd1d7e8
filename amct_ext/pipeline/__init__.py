"""The blockwise PTQ job: calibration / evaluation text (leak guard, tokenizer, perplexity), PTQ units,
capture, the solver, phase timing, the run_ptq / evaluate workflow and its torchrun scale-out."""
