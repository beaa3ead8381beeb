"""Running a model variant for inference: loading a directory of any kind (HF, peft adapter on its
base, quantized, ONNX; `loading`) and batched generation on left-padded prompts (`generation`).
The verbs evaluate and predict and the server (stages.serving) share them; the prompt format (chat
template or plain) is stages.data.sft_format's decision.

Torch-free itself, so the predict rule's settings (stages.serving.generation_settings) read
BACKENDS while Snakemake parses the workflow."""

BACKENDS = ("torch", "onnxruntime")  # which runtime runs a model directory
