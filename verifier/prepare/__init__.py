"""Preparing float weights for W8A8 once at load: rotation, activation smoothing and GPTQ,
calibrated by running the float model."""
