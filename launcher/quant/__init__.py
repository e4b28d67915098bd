"""Quantization: recipe resolution, calibration data, and the post-quantization summary checks."""
