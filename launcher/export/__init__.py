"""Export side: verification of HF unified checkpoints and dequantization of their tensors.

Modules (heavy imports stay inside functions; the layout checks need no torch):
  safetensors_dir  headers / index of a checkpoint directory (no torch)
  dequant          NVFP4 / FP8 exported tensors -> fp32
  verify_layout    files, index, quantization config, tensor dtypes/shapes, layers and experts
  verify_values    round trip, dequantized vs source, dequantized vs Megatron references
  megatron_ref     Megatron linears -> HF module names and their fake-quantized weights
  verify           ``verify_export`` (the report) and ``verify_export_main`` (the CLI)
The export stage itself is ``launcher.stages.export``.
"""
