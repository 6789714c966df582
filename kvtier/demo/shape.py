"""What the demo's engines agree on: the model namespace their chunks are stored under and a
chunk's row size (a 256-token chunk of a small fp16 model), shared by both of its nodes."""

NAMESPACE = "demo-model-fp16-c256"
ROW_BYTES = 256 * 1024
