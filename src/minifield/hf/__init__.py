"""The Hugging Face format: config.json, safetensors, directories read and written, pinned base models."""
