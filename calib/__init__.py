"""Calibration, NVFP4 quantization (ModelOpt) and parity measurement for Clef-Omni checkpoints."""
