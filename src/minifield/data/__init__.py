"""Training data: file formats, tokenizers, chat templates, assistant spans, encoding, packing, mixtures, batches."""
