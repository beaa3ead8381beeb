"""Artifacts that leave the pipeline: ONNX decoders with a KV cache, GGUF files, A8W8 in the
compressed-tensors format; each written, then checked with the runtime users deploy with."""
